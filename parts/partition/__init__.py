"""parts.partition: sharded parameters, gathered on demand.

Build a model under ``partitioned()`` (or call ``partition_module``) and every parameter
keeps only this rank's shard; ``gather``/``release``/``gathered`` bring full tensors in
and out, ``reduce_scatter_grads`` turns full grads into fp32 grad shards, ``shards`` hands
the shards to any torch optimizer, ``full_state_dict``/``load_full_state_dict`` move
consolidated weights; ``sharded_state_dict``/``sharded_optimizer_state_dict`` (and their
``load_`` twins) are per-rank views for ``torch.distributed.checkpoint``, at any world size;
``full_optimizer_state_dict`` is the optimizer's state at full parameter shapes
(``load_full_optimizer_state_dict`` loads it back, at any world size).

Layers: ``core`` (records, gather, grads, sharding, state dicts), ``construction``
(``partitioned``, ``partition_module``) and ``coordinator`` (``attach``), on ``parts.comm``
and ``parts.base``.

Example (``torchrun --nproc-per-node 2``)::

    import torch, torch.distributed as dist
    from parts.partition import partitioned, gathered, reduce_scatter_grads, shards, full_state_dict

    dist.init_process_group("gloo")
    with partitioned():                        # each module is sharded right after its __init__
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    optimizer = torch.optim.AdamW(shards(model), lr=1e-3)
    with gathered(model.parameters()):         # full weights inside (a coordinator does this per module)
        model(torch.randn(4, 1024)).square().mean().backward()
        reduce_scatter_grads(model.parameters())  # fp32 grad shards, averaged over ranks
    optimizer.step()                           # steps this rank's shards
    state = full_state_dict(model)             # plain state_dict keys, on rank 0
"""

from parts.base.layout import ShardLayout
from parts.base.storage_pool import StoragePool
from parts.comm.counter import CommCounter, comm_counter
from parts.partition.construction.construct import partition_module, partitioned
from parts.partition.construction.materialize import materialize
from parts.partition.core.gather import GatherHandle, gather, gathered, release
from parts.partition.core.grads import ReduceHandle, reduce_scatter_grads, shards, use_shards
from parts.partition.core.param import ParamMeta, ParamStatus, is_partitioned, meta
from parts.partition.core.precision import MixedPrecision
from parts.partition.core.compression import Compression
from parts.partition.core.state_dict import full_state_dict, load_full_state_dict
from parts.partition.interop import (clip_grad_norm_, grad_norm, load_pretrained, num_parameters,
                                     resize_token_embeddings)
from parts.partition.coordinator.compiled import compile_blocks, uncompile_blocks
from parts.partition.interop.full_optim import full_optimizer_state_dict, load_full_optimizer_state_dict
from parts.partition.interop.sharded_optim import (load_sharded_optimizer_state_dict,
                                                   sharded_optimizer_state_dict)
from parts.partition.interop.sharded_state import load_sharded_state_dict, sharded_state_dict
from parts.partition.coordinator import (CoordinatorStats, FetchCoordinator, RankDivergence, attach,
                                         detach, no_sync, refresh, register_external_parameter,
                                         set_replica_sync)
from parts.partition.coordinator.generating import generating
from parts.partition.whole import route
from parts.partition.reproducible import backward_units, mean_loss, unit_range, unit_rows

__all__ = [
    "ShardLayout",
    "partitioned", "partition_module", "materialize",
    "ParamMeta", "ParamStatus", "is_partitioned", "meta",
    "GatherHandle", "gather", "release", "gathered", "generating", "StoragePool",
    "ReduceHandle", "reduce_scatter_grads", "shards", "use_shards", "route",
    "full_state_dict", "load_full_state_dict",
    "sharded_state_dict", "load_sharded_state_dict",
    "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict", "full_optimizer_state_dict",
    "load_full_optimizer_state_dict",
    "CommCounter", "comm_counter",
    "FetchCoordinator", "attach", "detach", "register_external_parameter", "refresh", "set_replica_sync",
    "no_sync",
    "RankDivergence", "CoordinatorStats", "MixedPrecision", "Compression",
    "clip_grad_norm_", "grad_norm", "load_pretrained", "num_parameters", "resize_token_embeddings",
    "compile_blocks", "uncompile_blocks",
    "backward_units", "mean_loss", "unit_range", "unit_rows",
]
