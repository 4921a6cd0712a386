"""Weight-update process groups between a trainer (rank 0) and rollout servers (ranks 1..n), set up the
way SGLang sets up its side, so a real SGLang server joins a trainer's group and our embedded server
joins one the way SGLang would.

SGLang's contract (``sgl-project/sglang``, ``python/sglang/srt/model_executor/model_runner.py``
``ModelRunner.init_weights_update_group`` and ``python/sglang/srt/utils/common.py``
``init_custom_process_group``): a server joins as rank ``rank_offset + tp_rank``, one rank per TP rank
of the server, through torch's ``tcp://master_address:master_port`` rendezvous (rank 0 hosts the
TCPStore, everyone else is a client); the store is wrapped in ``PrefixStore(group_name)`` and handed to
torch's ``_new_process_group_helper``, which adds ``"<group_name>/"`` and then the device of the backend
(``"cpu/"`` for gloo, ``"cuda/"`` for NCCL) before the backend rendezvous its ranks. A key of rank ``r``
of a gloo group ``G`` is thus ``G/G//cpu//0/r`` on the trainer's store. No barrier follows the join (SGLang
removed it in PR #5914, April 2025; we require sglang>=0.5).

We build the same prefixes and backend ourselves instead of calling torch's helper, which also
registers the group in torch's process-wide registry: there a group that a dead peer left blocked
could not be destroyed (its shutdown waits for the blocked work) and its name could not be used again.
``tests/rollout/test_weights.py`` checks the result against ranks set up exactly as SGLang sets up its own.

The trainer's rank 0 binds its store on port 0 (``host_store``) and invites the servers to the port
the system chose: no ``free_port()`` race, and ``host`` is an address the servers' nodes can reach.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

GROUP_TIMEOUT_S = 300.0  # joining, and each broadcast: a peer that stops answering fails the transfer after this
DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # the device torch's group helper names each backend's store prefix after


@dataclass
class WeightChannel:
    """The weight-update channel (SGLang's "weights update group"): a process group plus the store it lives
    on (the store must outlive the group)."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int

    def close(self) -> None:
        """Abort the group (NCCL frees its communicators now, not at garbage collection; pending work
        is dropped, not waited for, since the peer may be gone). Drop the object afterwards: gloo
        closes its connections when it is freed, and a peer blocked in a broadcast then fails at
        once instead of at the timeout."""
        self.group.abort()


def host_store(host: str, world_size: int, timeout_s: float = GROUP_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store, listening on a port the system picks (``store.port``); ``host`` is the address
    the other ranks will be told to connect to."""
    return dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = GROUP_TIMEOUT_S,
    store: dist.Store | None = None,
) -> WeightChannel:
    """Join group ``group_name``; blocks until all ``world_size`` ranks have joined. Without ``store``
    the ranks meet as in torch's ``tcp://`` rendezvous: rank 0 hosts the store on ``master_port``, the
    others connect to it; a trainer's rank 0 passes the store it already hosts (``host_store``)."""
    if backend not in DEVICES:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(DEVICES)}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(
        f"{DEVICES[backend]}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    group._set_sequence_number_for_group()  # as torch's group helper does for SGLang's ranks
    return WeightChannel(group, store, rank)


def broadcast_tensor(group: WeightChannel, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0 sends ``tensor``; every other rank receives into it (same shape and dtype)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.group.broadcast([tensor], options).wait()
    return tensor
