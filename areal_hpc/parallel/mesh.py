"""The one named device mesh (torchtitan's ``ParallelDims`` idea): dp, tp, pp, cp, ep sizes checked
once against the world, and a ``DeviceMesh`` every component asks for the sub-mesh it needs.

The torch-native trainer of this release shards only over ``dp``; the other axes are declared here so
the Megatron/5D engine plugs into the same object. Ranks learn their place from the environment
``srun``, ``mpirun``, ``torchrun`` or our local launcher sets (``bootstrap.Placement``) and meet at
MASTER_ADDR:MASTER_PORT or through a name-resolve folder (``rendezvous``). gloo on CPU, NCCL on CUDA,
HCCL on Ascend.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_hpc.errors import UserError
from areal_hpc.parallel.bootstrap import INTERFACE, RENDEZVOUS, Placement, assigned_devices
from areal_hpc.parallel.rendezvous import RENDEZVOUS_TIMEOUT_S, rendezvous_store

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def check(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise UserError(f"parallel sizes dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} need "
                            f"{self.world_size} processes, but {world_size} were started")
        if (self.tp, self.pp, self.cp, self.ep) != (1, 1, 1, 1):
            raise UserError("the torch-native trainer shards over data parallelism only (tp=pp=cp=ep=1); "
                            "use the Megatron engine for tensor, pipeline, context or expert parallelism")

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        return init_device_mesh(device.type, (self.dp,), mesh_dim_names=("dp",))


def init_distributed(device: torch.device, timeout_s: float = 7 * 24 * 3600.0) -> tuple[int, int]:
    """Join the default process group; returns (rank, world size).

    Rank, world and local rank come from the launcher (``bootstrap.Placement``: RANK/WORLD_SIZE/
    LOCAL_RANK from torchrun or ours, else the Slurm step or MPI). The ranks meet at MASTER_ADDR:
    MASTER_PORT when both are set (torchrun), else through the shared folder in AREAL_HPC_RENDEZVOUS
    (rank 0's store on a port of the OS's choosing, see ``rendezvous``). A single process runs as a
    group of one, so one code path serves both. The timeout is long on purpose: ranks > 0 wait in a
    collective while rank 0 generates and evaluates; if a rank dies, the launcher stops the others.
    """
    placement = Placement.detect()
    rank, world, backend = placement.rank, placement.world, BACKENDS[device.type]
    timeout = datetime.timedelta(seconds=timeout_s)
    interface = os.environ.get(INTERFACE, "")
    if interface:  # the collectives' own sockets take the same network as the rendezvous
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    if device.type == "cuda":  # the ordinal of this rank's device among the visible ones
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if len(visible) == 1:  # a launcher gave this rank its own device
            torch.cuda.set_device(0)
        else:
            mine = assigned_devices(placement.local_rank, 1)[0]
            torch.cuda.set_device(visible.index(mine) if visible else int(mine))
    if world == 1:  # a group of one needs no rendezvous (and no port)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    elif os.environ.get(RENDEZVOUS):
        store = rendezvous_store(Path(os.environ[RENDEZVOUS]), rank, world, min(timeout_s, RENDEZVOUS_TIMEOUT_S),
                                 interface)
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        raise UserError(f"{world} ranks (from {placement.source} variables) need a rendezvous: {RENDEZVOUS} "
                        "(a shared folder; the launchers set it) or MASTER_ADDR and MASTER_PORT (torchrun)")
    return rank, world
