"""parts.comm: the communication layer below every part.

The communication device of a group (``comm_device``: every tensor a collective sees lives
there; ``parts.comm.device``), the one process-group handle (``GroupInfo``, ``resolve_group``/``group_info``, membership
and world-size checks), the collectives (each counted in ``comm_counter``, one documented
convention: see ``parts.comm.counter``), object exchange, checks agreed across ranks
(``agree``), the gloo algorithms that beat
gloo's own, and the handles of issued collectives (``Work``, ``WorkList``). Each part keeps
a small module of its domain collectives on top of this; nothing else in ``parts`` imports
``torch.distributed`` (torch-version shims stay in ``parts._compat``).
"""

from parts.comm.collectives import (ReduceOp, all_reduce_async, group_key, all_gather, all_gather_list, all_gather_many,
                                    all_reduce, all_to_all, broadcast, comm_device, max_everywhere, min_max, new_group,
                                    reduce_scatter, reduce_scatter_many, same_everywhere)
from parts.comm.agree import RankDisagreement, agree
from parts.comm import exit as _exit  # noqa: F401  (process groups end at interpreter exit)
from parts.comm.counter import CommCounter, comm_counter, wire_bytes
from parts.comm.device import comm_tensor, declared_comm_device, gloo_algorithms, to_comm, to_host, torch_algorithms
from parts.comm.fake import block_layout, fake_world
from parts.comm.heartbeat import Heartbeat
from parts.comm.heartbeat_report import PeerFailure
from parts.comm.launch import init_process_group
from parts.comm.snapshots import Snapshots
from parts.comm.snapshot_restore import Restored
from parts.comm.objects import all_gather_objects, broadcast_object
from parts.comm.gloo import all_gather_direct, reduce_scatter_consuming
from parts.comm.group import (GroupArg, GroupInfo, ProcessGroup, WeakGroup, check_member, env_world_size, hybrid_groups,
                              global_rank, group_info, is_distributed, is_member, require_distributed,
                              resolve_group)
from parts.comm.topology import Topology, launcher_ranks_per_node
from parts.comm.compressed import (Codec, all_gather_quantized, all_reduce_mean_quantized,
                                   reduce_scatter_quantized)
from parts.comm.quantize import ErrorFeedback, Quantized, dequantize, quantize
from parts.comm.work import Waitable, Work, WorkList

__all__ = [
    "ProcessGroup", "GroupArg", "GroupInfo", "WeakGroup", "resolve_group", "group_info", "check_member", "is_member",
    "require_distributed", "is_distributed", "global_rank", "env_world_size", "hybrid_groups",
    "CommCounter", "comm_counter", "wire_bytes",
    "ReduceOp", "all_gather_many", "reduce_scatter_many", "all_gather", "reduce_scatter",
    "all_reduce", "all_reduce_async", "all_to_all", "same_everywhere", "max_everywhere", "min_max", "broadcast",
    "broadcast_object",
    "all_gather_objects", "all_gather_list",
    "new_group", "comm_device", "declared_comm_device", "comm_tensor", "to_comm", "to_host", "torch_algorithms",
    "gloo_algorithms", "group_key", "all_gather_direct", "reduce_scatter_consuming",
    "Waitable", "Work", "WorkList", "Topology", "launcher_ranks_per_node",
    "agree", "RankDisagreement", "fake_world", "block_layout", "Heartbeat", "PeerFailure",
    "init_process_group", "Snapshots", "Restored",
    "Codec", "all_gather_quantized", "reduce_scatter_quantized", "all_reduce_mean_quantized",
    "ErrorFeedback", "Quantized", "quantize", "dequantize",
]
