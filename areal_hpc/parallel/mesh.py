"""The one named device mesh (torchtitan's ``ParallelDims`` idea): dp, tp, pp, cp, ep sizes checked
once against the world, and a ``DeviceMesh`` every component asks for the sub-mesh it needs.

The torch-native trainer of this release shards only over ``dp``; the other axes are declared here so
the Megatron/5D engine plugs into the same object. Ranks find each other through the environment
that ``torchrun``, ``srun`` (via ``launch/``) or our local launcher sets: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. gloo on CPU, NCCL on CUDA, HCCL on Ascend.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_hpc.errors import UserError

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
    """Join the default process group from the environment; returns (rank, world size).

    A single process without the environment runs as a group of one, so one code path serves both.
    The timeout is long on purpose: ranks > 0 wait in a collective while rank 0 generates and
    evaluates; if a rank dies, the launcher stops the others.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world == 1:  # a group of one needs no rendezvous (and no port)
        dist.init_process_group(BACKENDS[device.type], store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise UserError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (the launcher, torchrun or srun sets them)")
    dist.init_process_group(BACKENDS[device.type], rank=rank, world_size=world, timeout=timeout)
    return rank, world
