"""recipes/train_offload.py in one process (world 1): its build and steps on disk equal its --in-memory run
bitwise, and it prints the memory budget it chose and why."""

import math
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from harness import run

RECIPES = str(Path(__file__).resolve().parents[1] / "recipes")
TINY = (2, 64, 4)  # layers, width, heads: the recipe's GPT at a size a test trains in a second


def _recipe():
    """The recipe module, with a tiny preset beside its own."""
    if RECIPES not in sys.path:
        sys.path.insert(0, RECIPES)
    import train_offload

    train_offload.PRESETS.setdefault("tiny", TINY)
    return train_offload


def _store(recipe, tmp, flags):
    """The recipe's flags parsed from ``flags``, and a store sized by them as the recipe sizes its own."""
    from parts.offload import DiskStore

    with mock.patch.object(sys, "argv", ["train_offload.py", "--params", "tiny", "--store", tmp, *flags]):
        args = recipe.parse_args()
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    return args, DiskStore(f"{tmp}/rank{dist.get_rank()}", memory_budget=budget)


def body_train(tmp, flags):
    """Three steps of the recipe's own build and train_step: (losses, state before, state after)."""
    recipe = _recipe()
    from chardata import load_splits

    from parts.partition import detach, full_state_dict

    args, store = _store(recipe, tmp, ["--steps", "3", "--lr", "1e-2", *flags])
    model, optimizer, schedule = recipe.build(args, store, recipe.agreed_knobs(recipe.config_of(args), store))
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    tokens, _ = load_splits(None)
    gen = torch.Generator().manual_seed(args.seed)
    losses = [recipe.train_step(model, optimizer, schedule, tokens, gen, args) for _ in range(args.steps)]
    after = {k: v.clone() for k, v in full_state_dict(model).items()}
    detach(model)
    store.close()
    return losses, before, after


def body_budget_rows(tmp, flags):
    """The rows the recipe prints about its memory budget."""
    recipe = _recipe()
    args, store = _store(recipe, tmp, flags)
    config = recipe.config_of(args)
    rows = recipe.budget_rows(store, config, dist.get_world_size(), recipe.agreed_knobs(config, store))
    store.close()
    return rows


def test_world1_on_disk_equals_in_memory(tmp_path):
    budget = ["--memory-budget-gib", "0.5"]
    (off_losses, off_before, off_after), = run(1, body_train, str(tmp_path / "off"), budget)
    (mem_losses, mem_before, mem_after), = run(1, body_train, str(tmp_path / "mem"), [*budget, "--in-memory"])
    assert off_losses == mem_losses and all(map(math.isfinite, off_losses))  # bitwise
    assert sorted(off_after) == sorted(mem_after) and sorted(off_before) == sorted(mem_before)
    assert all(torch.equal(off_after[k], mem_after[k]) for k in mem_after)
    assert all(torch.equal(off_before[k], mem_before[k]) for k in mem_before)
    assert not all(torch.equal(off_after[k], off_before[k]) for k in off_before)  # it trained


def test_world1_prints_budget_and_why(tmp_path):
    given = run(1, body_budget_rows, str(tmp_path / "given"), ["--memory-budget-gib", "0.5"])[0]
    assert given[0] == ("memory budget per rank", "0.50 GiB: given (memory_budget=)"), given
    assert given[1][0] == "  bound of these knobs" and given[1][1].endswith(": within the budget"), given
    default = run(1, body_budget_rows, str(tmp_path / "default"), [])[0]
    assert "available / 1 local rank(s) (LOCAL_WORLD_SIZE) / 16" in default[0][1], default


def body_default_budgets_differ(tmp):
    """Each rank's default budget from a different available memory (as ranks reading MemAvailable
    a moment apart see): the knobs the recipe attaches with agree; each rank's own would not."""
    recipe = _recipe()
    from parts.partition import detach

    gib = 2**30
    with mock.patch("parts.offload._budget.available_memory", lambda: (64 + 32 * dist.get_rank()) * gib):
        args, store = _store(recipe, tmp, [])
    config = recipe.config_of(args)
    own, agreed = recipe.live_knobs(config, store), recipe.agreed_knobs(config, store)
    model, _, _ = recipe.build(args, store, agreed)  # attach checks that every rank passed the same
    detach(model)
    try:
        recipe.build(args, store, own)
        refused = ""
    except ValueError as e:
        refused = str(e)
    store.close()
    return own, agreed, refused


def test_ranks_whose_default_budgets_differ_attach_with_the_same_knobs(tmp_path):
    outs = run(2, body_default_budgets_differ, str(tmp_path))
    (own0, agreed0, refused), (own1, agreed1, _) = outs
    assert own0 != own1 and agreed0 == agreed1 == {k: min(own0[k], own1[k]) for k in own0}
    assert "disagree" in refused, refused
