"""Run under torchrun by test_no_numpy.py: object exchange and load_full_state_dict with numpy unimportable."""

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` now raises ImportError
import warnings  # noqa: E402

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch says so once at import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parts.comm import all_gather_objects, broadcast_object  # noqa: E402
from parts.partition import full_state_dict, load_full_state_dict, partitioned  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import numpy  # noqa: F401
        raise AssertionError("numpy should not be importable here")
    except ImportError:
        pass
    assert all_gather_objects({"rank": rank, "pad": "x" * rank}) == [
        {"rank": r, "pad": "x" * r} for r in range(world)]
    assert broadcast_object(("from", rank) if rank == 1 else None, src=1) == ("from", 1)
    torch.manual_seed(0)
    reference = torch.nn.Linear(5, 3).state_dict()
    with partitioned():
        model = torch.nn.Linear(5, 3)
    result = load_full_state_dict(model, reference if rank == 0 else {})
    full = full_state_dict(model, rank0_only=False)
    assert all(torch.equal(full[k], reference[k]) for k in reference), full
    print(f"rank {rank}: no-numpy ok, missing {list(result.missing_keys)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
