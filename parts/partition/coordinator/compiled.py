"""``torch.compile`` on an attached model: each block compiles to one graph, the
coordinator's hooks run outside it.

Two ways, both with the coordinator's hooks outside the graphs (they run collectives,
switch parameter classes and resize storages: nothing dynamo can trace):

* ``torch.compile(model)`` / ``model.compile()``: the hooks are ``torch.compiler.disable``d
  (hooks.py ``eager``), so dynamo breaks the graph at each fetch unit's hooks and compiles
  the regions between them, FSDP2's way: a block's forward, whose submodules carry no hooks,
  is one graph. ``fullgraph=True`` cannot hold the hooks: dynamo raises, naming ``compile_blocks``.
* ``compile_blocks(model, blocks)`` *fuses* each block: the block's own hooks fetch every
  parameter of its subtree (one group of collectives, before forward and before backward),
  its submodules lose their hooks, and only the block's ``forward`` (not the hooked module
  call) is compiled, so ``fullgraph=True`` works. The hooks run eagerly around the compiled
  forward; inside it every parameter is gathered, so dynamo sees ordinary full parameters.

Limits of ``compile_blocks``: a fused block's parameters are not watched for reads by other
modules (a tied weight read outside its block must be declared with
``register_external_parameter``); the block's forward is compiled for the coordinator's use
only: after ``detach`` call ``uncompile_blocks`` (or the compiled forward meets released
parameters and raises).
"""

from __future__ import annotations

from typing import Any, Iterable, Union

import torch
from torch import nn

from parts.partition.construction.construct import drop_forward_check, restore_forward_check
from parts.partition.coordinator.coordinator import FetchCoordinator, attached_to


def _coordinator_of(model: nn.Module) -> FetchCoordinator:
    """The ``FetchCoordinator`` attached to ``model``; a clear error if there is none."""
    coordinator = attached_to(model)
    if coordinator is None or coordinator._root is None:
        raise RuntimeError(f"compile_blocks: {type(model).__name__} has no attached FetchCoordinator; "
                           "call parts.partition.attach(model) first, then compile_blocks")
    return coordinator


def fuse(coordinator: FetchCoordinator, block: nn.Module) -> None:
    """Make ``block`` fetch its whole subtree's parameters itself; its submodules lose their hooks."""
    table = coordinator.table
    unit = table.index.get(id(block))
    if unit is None:
        raise ValueError(f"compile_blocks: {type(block).__name__} is not a module of the attached model")
    if unit in coordinator._units:
        raise ValueError(f"compile_blocks: module '{table.names[unit]}' is inside the already fused "
                         f"block '{table.names[coordinator._units[unit]]}'")
    for sub in list(block.modules())[1:]:
        index = table.index[id(sub)]
        for pid in list(table.sets[index]):
            table.add_external(unit, pid)
        hooks = coordinator._hooks.pop(index, None)
        if hooks is not None:
            hooks.remove()
        coordinator._units[index] = unit
    for sub in block.modules():
        drop_forward_check(sub)
    if table.sets[unit]:
        coordinator._hook(unit)
        coordinator._hooks[unit].unwatch()


def compile_blocks(model: nn.Module, blocks: Union[nn.Module, Iterable[nn.Module]],
                   **compile_kwargs: Any) -> list[nn.Module]:
    """``torch.compile`` the forward of each block of an attached ``model``: one graph per block.

    ``blocks``: modules of ``model`` (a ``nn.ModuleList`` of transformer blocks, or any
    iterable of modules, none inside another). ``compile_kwargs`` go to ``torch.compile``
    (``backend``, ``mode``, ``dynamic``, ...). Returns the blocks.
    """
    coordinator = _coordinator_of(model)
    blocks = list(blocks.children()) if isinstance(blocks, nn.ModuleList) else list(blocks)
    for block in blocks:
        if "forward" in block.__dict__:
            raise ValueError(f"compile_blocks: {type(block).__name__} already has an instance "
                             "forward (compiled already?)")
        fuse(coordinator, block)
        block.__dict__["forward"] = torch.compile(block.forward, **compile_kwargs)
    return blocks


def uncompile_blocks(blocks: Union[nn.Module, Iterable[nn.Module]]) -> None:
    """Give compiled blocks back their own ``forward`` (e.g. after ``detach``)."""
    blocks = list(blocks.children()) if isinstance(blocks, nn.ModuleList) else list(blocks)
    for block in blocks:
        block.__dict__.pop("forward", None)
        for sub in block.modules():
            restore_forward_check(sub)
