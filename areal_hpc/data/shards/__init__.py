"""Trajectory shards: the durable, crash-safe log of every trajectory a run produces (HDF5 + SWMR)."""

from areal_hpc.data.shards.consumer import ConsumerCursor, TrajectoryConsumer
from areal_hpc.data.shards.format import ShardDamageError
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.data.shards.writer import TrajectoryShardWriter, UnknownTrajectoryError

__all__ = [
    "ConsumerCursor",
    "ShardDamageError",
    "TrajectoryConsumer",
    "TrajectoryFilter",
    "TrajectoryShardWriter",
    "TrajectoryStore",
    "UnknownTrajectoryError",
]
