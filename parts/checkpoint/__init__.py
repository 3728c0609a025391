"""parts.checkpoint: activation checkpointing with exact RNG replay and partitioned,
offloaded or buffered saved inputs."""

from parts.checkpoint.api import checkpoint
from parts.checkpoint.buffers import ContiguousBuffers
from parts.checkpoint.policy import CheckpointPolicy
from parts.checkpoint.rng import MODEL_PARALLEL_RNG, RNGSnapshot, RNGTracker, seed_model_parallel

__all__ = ["checkpoint", "CheckpointPolicy", "ContiguousBuffers", "RNGTracker",
           "RNGSnapshot", "seed_model_parallel", "MODEL_PARALLEL_RNG"]
