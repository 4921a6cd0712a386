"""The trainer ranks' device mesh: ``TrainMesh`` wraps the ``DeviceMesh`` that ``ParallelDims``
(``areal_hpc.layout``: sizes, Megatron's rank order) lays out, and hands engines the sub-meshes they ask for
by name (engines receive the mesh, never raw groups). With training groups of different shapes
(``layout.MixedLayout``) each rank's ``TrainMesh`` is its own group's mesh, and knows the others.

Ranks learn their place from the environment ``srun``, ``mpirun``, ``torchrun`` or our local launcher
sets (``bootstrap.Placement``) and meet at MASTER_ADDR:MASTER_PORT or through a name-resolve folder
(``rendezvous``). gloo on CPU, NCCL on CUDA, HCCL on Ascend.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_hpc.errors import UserError
from areal_hpc.layout import MESH_DIMS, MixedLayout, ParallelDims
from areal_hpc.runtime.bootstrap import INTERFACE, RENDEZVOUS, Placement, assigned_devices
from areal_hpc.runtime.rendezvous import RENDEZVOUS_TIMEOUT_S, rendezvous_store

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
UNMADE = object()  # a process group not created yet (None is a made one this rank is not in)


def build_mesh(dims: ParallelDims, device: torch.device) -> TrainMesh:
    """Collective: every rank calls it after ``init_distributed``."""
    return TrainMesh(dims, init_device_mesh(device.type, dims.shape, mesh_dim_names=MESH_DIMS), device)


@dataclass
class StageLinks:
    """The process groups that sum gradients across training groups (``mixed_gradients``): ``writers``,
    the first rank of every group's every pipeline stage; ``stage``, this rank's stage (None when the
    stage is this rank alone), whose first rank is ``stage_writer``."""

    writers: dist.ProcessGroup
    writes: bool
    stage: dist.ProcessGroup | None
    stage_writer: int


def build_group_meshes(layout: MixedLayout, device: torch.device) -> TrainMesh:
    """This rank's group's mesh. Collective: every rank builds every group's ``DeviceMesh`` (and a
    process group of its ranks) in turn, then the groups that link the stages across them and the
    pipelines' ends, as creating a process group asks of all ranks in one order: a group that only one
    training group's ranks made later (a pipeline's tied-embedding pairs did) would pair off every
    creation after it wrongly."""
    if len(layout.groups) == 1:
        return build_mesh(layout.groups[0], device)
    rank, own = dist.get_rank(), None
    for index, (offset, dims) in enumerate(zip(layout.offsets, layout.groups)):
        ranks = torch.arange(offset, offset + dims.world_size)
        mesh = DeviceMesh(device.type, ranks.view(dims.shape), mesh_dim_names=MESH_DIMS)
        members = dist.new_group(ranks.tolist())
        if offset <= rank < offset + dims.world_size:
            own = TrainMesh(dims, mesh, device, layout, index, members)
    stages = layout.stages()
    writers = [ranks[0] for ranks in stages]
    writers_group, own_stage, own_writer = dist.new_group(writers), None, rank
    for ranks in stages:
        stage = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks and stage is not None:
            own_stage, own_writer = stage, ranks[0]
    own.links = StageLinks(writers_group, rank in writers, own_stage, own_writer)
    own.make_pipeline_ends()
    return own


class TrainMesh:
    """The trainer ranks' ``DeviceMesh`` with named sub-meshes: "pp", "dp", "cp", "tp", "dp_cp" (where
    gradients are reduced), "ep" and "edp" (expert and expert-data parallel). ``layout``: every
    training group of the job (this mesh is group ``index`` of it, its ranks in ``members``)."""

    def __init__(
        self,
        dims: ParallelDims,
        mesh: DeviceMesh,
        device: torch.device,
        layout: MixedLayout | None = None,
        index: int = 0,
        members: dist.ProcessGroup | None = None,
    ):
        self.dims, self.mesh, self.device = dims, mesh, device
        self.layout, self.index = layout or MixedLayout((dims,)), index
        self.members = members or dist.group.WORLD
        self.links: StageLinks | None = None  # with several groups (``build_group_meshes``)
        self._pipeline_ends: dist.ProcessGroup | object | None = UNMADE  # made once, by every rank
        self.rank = dist.get_rank()
        self.coords = self.layout.coordinates(self.rank)
        self._extra: dict[str, DeviceMesh] = {}

    def make_pipeline_ends(self) -> None:
        """Create every replica slot's [first stage, last stage] group (``MixedLayout.pipeline_ends``).
        Collective over every rank, once: ``build_group_meshes`` makes them before any group's engine
        runs, one mesh's pipeline on first use."""
        if self._pipeline_ends is UNMADE:
            ends = self.layout.pipeline_ends()
            self._pipeline_ends = dist.new_subgroups_by_enumeration(ends)[0] if ends else None

    @property
    def pipeline_ends(self) -> dist.ProcessGroup | None:
        """The group of this rank's replica slot's first and last pipeline stage (None on other stages):
        where a tied embedding's gradients are summed."""
        self.make_pipeline_ends()
        return self._pipeline_ends

    @property
    def mixed(self) -> bool:
        """Whether the job trains in several groups (gradients are then summed across them)."""
        return len(self.layout.groups) > 1

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
            name, getattr(self.dims, name, 0)
        ) or self[name].size()

    @property
    def data_rank(self) -> int:
        """Which share of each batch this rank trains on: its replica over every group (tp, pp and cp
        peers share it)."""
        return self.layout.replica(self.rank)

    @property
    def leads_replica(self) -> bool:
        """First rank of its model replica (tp = cp = pp = 0): the one whose statistics count."""
        return self.coords["tp"] == self.coords["cp"] == self.coords["pp"] == 0


def close_distributed() -> None:
    """Leave the process groups once nothing holds them. Call it after the engines are gone (return
    from the function that built them): FSDP and DTensor state keep their groups alive through
    reference cycles, which are collected here, first; a gloo group left to interpreter shutdown
    instead sometimes aborts the process after a successful run ("terminate called without an active
    exception", about 1 two-rank run in 20 here)."""
    gc.collect()
    dist.destroy_process_group()


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
        store = rendezvous_store(
            Path(os.environ[RENDEZVOUS]), rank, world, min(timeout_s, RENDEZVOUS_TIMEOUT_S), interface
        )
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        raise UserError(
            f"{world} ranks (from {placement.source} variables) need a rendezvous: {RENDEZVOUS} "
            "(a shared folder; the launchers set it) or MASTER_ADDR and MASTER_PORT (torchrun)"
        )
    return rank, world
