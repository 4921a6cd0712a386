"""The one named device mesh of the trainer ranks: dp, tp, pp, cp and ep sizes checked once against
the world, laid out in Megatron-core's rank order, and handed to engines as a ``TrainMesh`` (engines
receive the mesh, never raw groups).

Rank order is Megatron's default ``tp-cp-ep-dp-pp``: tensor-parallel peers are adjacent ranks (one
node's fast links), then context, then data parallel, pipeline stages outermost; the mesh's dims
are therefore ("pp", "dp", "cp", "tp"), slowest to fastest, and a Megatron engine that feeds these
sizes to ``initialize_model_parallel`` gets the same groups (tests check it against Megatron's own
``RankGenerator``). Expert parallelism splits the dp x cp ranks of a stage into ``ep`` consecutive
ranks (Megatron's ``tp-ep-dp-pp`` expert order with expert tp = tp).

Ranks learn their place from the environment ``srun``, ``mpirun``, ``torchrun`` or our local launcher
sets (``bootstrap.Placement``) and meet at MASTER_ADDR:MASTER_PORT or through a name-resolve folder
(``rendezvous``). gloo on CPU, NCCL on CUDA, HCCL on Ascend.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_hpc.errors import UserError
from areal_hpc.parallel.bootstrap import INTERFACE, RENDEZVOUS, Placement, assigned_devices
from areal_hpc.parallel.rendezvous import RENDEZVOUS_TIMEOUT_S, rendezvous_store

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest varying rank coordinate
EXPERT_DIMS = ("pp", "edp", "ep", "tp")  # the same ranks seen by MoE layers: dp x cp = edp x ep
ALLOCATION = re.compile(r"^megatron:d(\d+)p(\d+)t(\d+)$")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "ParallelDims":
        """Sizes from ``actor.parallel`` (``allocation``, e.g. ``megatron:d8p1t1``, sets dp, pp and tp;
        dp=0 takes what the other sizes leave of ``world_size``), checked against the world."""
        dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
        if parallel.allocation:
            match = ALLOCATION.match(parallel.allocation.strip())
            if not match:
                raise UserError(f"actor.parallel.allocation={parallel.allocation!r} is not a training allocation; "
                                "expected megatron:d<dp>p<pp>t<tp>, e.g. megatron:d8p1t1 (see `areal-hpc plan`)")
            dp, pp, tp = (int(v) for v in match.groups())
        if dp == 0:
            model_parallel = tp * pp * parallel.cp
            if world_size % model_parallel:
                raise UserError(f"tp={tp} x pp={pp} x cp={parallel.cp} = {model_parallel} does not divide the "
                                f"{world_size} trainer processes (rl.trainer_processes)")
            dp = world_size // model_parallel
        dims = cls(dp=dp, tp=tp, pp=pp, cp=parallel.cp, ep=parallel.ep, vpp=parallel.vpp,
                   sequence_parallel=parallel.sequence_parallel, fsdp=parallel.fsdp)
        dims.check(world_size)
        return dims

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def check(self, world_size: int) -> None:
        if min(self.dp, self.tp, self.pp, self.cp, self.ep, self.vpp) < 1:
            raise UserError(f"parallel sizes must be at least 1, got {self}")
        if self.world_size != world_size:
            raise UserError(f"parallel sizes dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} need "
                            f"{self.world_size} processes, but {world_size} were started (set rl.trainer_processes="
                            f"{self.world_size}, or actor.parallel.dp=0 to fill the world)")
        if (self.dp * self.cp) % self.ep:
            raise UserError(f"actor.parallel.ep={self.ep} must divide dp x cp = {self.dp * self.cp} "
                            "(experts are split over the data-parallel ranks of a stage)")
        if self.sequence_parallel and self.tp == 1:
            raise UserError("actor.parallel.sequence_parallel=true needs tp > 1")
        if self.vpp > 1 and self.pp == 1:
            raise UserError(f"actor.parallel.vpp={self.vpp} needs pp > 1 (virtual stages interleave pipeline stages)")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each mesh dim (and its expert-parallel coordinates)."""
        rest, coords = rank, {}
        for name in reversed(MESH_DIMS):
            rest, coords[name] = divmod(rest, getattr(self, name))
        data = coords["dp"] * self.cp + coords["cp"]  # position among the dp x cp ranks of a stage
        coords["edp"], coords["ep"] = divmod(data, self.ep)
        return coords

    def groups(self, dims: str) -> list[list[int]]:
        """Rank lists of the groups that vary ``dims`` ("tp", "dp-cp", "tp-ep", ...) with the other
        coordinates fixed: what Megatron's ``RankGenerator.get_ranks`` returns for the same names."""
        names = dims.split("-")
        system = EXPERT_DIMS if {"ep", "edp"} & set(names) else MESH_DIMS
        if not set(names) <= set(system):
            raise ValueError(f"cannot group over {dims!r}: dims are {MESH_DIMS} or {EXPERT_DIMS}")
        by_key: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            by_key.setdefault(tuple(coords[k] for k in system if k not in names), []).append(rank)
        return list(by_key.values())

    def build_mesh(self, device: torch.device) -> "TrainMesh":
        """Collective: every rank calls it after ``init_distributed``."""
        mesh = init_device_mesh(device.type, self.shape, mesh_dim_names=MESH_DIMS)
        return TrainMesh(self, mesh, device)


class TrainMesh:
    """The trainer ranks' ``DeviceMesh`` with named sub-meshes: "pp", "dp", "cp", "tp", "dp_cp" (where
    gradients are reduced), "ep" and "edp" (expert and expert-data parallel)."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh, device: torch.device):
        self.dims, self.mesh, self.device = dims, mesh, device
        self.rank = dist.get_rank()
        self.coords = dims.coordinates(self.rank)
        self._extra: dict[str, DeviceMesh] = {}

    def __getitem__(self, name: str) -> DeviceMesh:
        if name in MESH_DIMS:
            return self.mesh[name]
        if name not in self._extra:  # collective on first use: every rank must ask for it in the same order
            if name == "dp_cp":
                self._extra[name] = self.mesh["dp", "cp"]._flatten("dp_cp")
            elif name in ("ep", "edp"):
                flat = self["dp_cp"]
                split = flat._unflatten(0, (self.dims.dp * self.dims.cp // self.dims.ep, self.dims.ep), ("edp", "ep"))
                self._extra["ep"], self._extra["edp"] = split["ep"], split["edp"]
            else:
                raise KeyError(f"no mesh dim {name!r}; have {[*MESH_DIMS, 'dp_cp', 'ep', 'edp']}")
        return self._extra[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def size(self, name: str) -> int:
        return {"dp_cp": self.dims.dp * self.dims.cp, "edp": self.dims.dp * self.dims.cp // self.dims.ep}.get(
            name, getattr(self.dims, name, 0)) or self[name].size()

    @property
    def data_rank(self) -> int:
        """Which share of each batch this rank trains on: its dp coordinate (tp, pp and cp peers share it)."""
        return self.coords["dp"]

    @property
    def leads_replica(self) -> bool:
        """First rank of its model replica (tp = cp = pp = 0): the one whose statistics count."""
        return self.coords["tp"] == self.coords["cp"] == self.coords["pp"] == 0


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
