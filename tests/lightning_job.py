"""Run under torchrun by test_integrations_lightning.py: ``trainer.init_module()`` before the process group exists.

Under a launcher that starts the processes (torchrun), ``Trainer(strategy="parts")`` starts the
process group inside ``trainer.init_module()`` so the model is sharded as it is built; ``fit``
then trains it. Prints ``result {json}`` on rank 0: whether every parameter was sharded right
after construction, whether the group existed before, and the losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_common import CONFIG, GPT, lightning_run, loader, module_class  # noqa: E402


def main(root: str) -> None:
    import lightning.pytorch as pl

    import parts.integrations.lightning  # noqa: F401
    from parts.partition import is_partitioned
    with lightning_run():
        before = dist.is_initialized()
        trainer = pl.Trainer(strategy="parts", accelerator="cpu", devices=2, max_steps=3, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                             enable_checkpointing=False)
        pl.seed_everything(0, verbose=False)
        with trainer.init_module():
            module = module_class()(GPT(CONFIG))
        sharded = all(is_partitioned(p) for p in module.parameters())
        trainer.fit(module, loader(2))
    if trainer.global_rank == 0:
        print("result " + json.dumps(dict(group_before=before, sharded=sharded, losses=module.losses)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
