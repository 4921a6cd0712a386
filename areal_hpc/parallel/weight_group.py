"""Weight-update process groups between a trainer (rank 0) and rollout servers (ranks 1..n).

The group is standalone (its own TCPStore, not the default process group), so a trainer that
already runs data-parallel training can broadcast to servers without touching its training group.
gloo on CPU, NCCL on GPU, the same calls on both sides as SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``. A server that joins a new group (the trainer restarted)
closes the one it had.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class UpdateGroup:
    """A process group plus the store it lives on (the store must outlive the group)."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int

    def close(self) -> None:
        """Abort the group (NCCL frees its communicators now, not at garbage collection; pending work
        is dropped, not waited for, since the peer may be gone). Drop the object afterwards: gloo
        closes its connections when it is freed, and a peer blocked in a broadcast then fails at
        once instead of at the timeout."""
        self.group.abort()


def join_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout_s: float = 300.0) -> UpdateGroup:
    """Blocks until all ``world_size`` ranks have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"backend {backend!r} is not one of gloo, nccl")
    return UpdateGroup(group, store, rank)


def broadcast_tensor(group: UpdateGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0 sends ``tensor``; every other rank receives into it (same shape and dtype)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.group.broadcast([tensor], options).wait()
    return tensor
