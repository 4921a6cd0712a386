"""How the trainer ranks are laid out: the sizes of one mesh (``ParallelDims``: dp, tp, pp, cp, ep) and the
meshes of different shapes one job may train on (``MixedLayout``), checked against the world. Plain
arithmetic on ``actor.parallel`` (no torch), so ``resolve`` checks a layout on a login node before
anything starts, the planner (``sched/``) sizes its candidates with it, and ``parallel.mesh`` builds it.

Rank order is Megatron's default ``tp-cp-ep-dp-pp``: tensor-parallel peers are adjacent ranks (one
node's fast links), then context, then data parallel, pipeline stages outermost; the mesh's dims are
therefore ("pp", "dp", "cp", "tp"), slowest to fastest, and a Megatron engine that feeds these sizes
to ``initialize_model_parallel`` gets the same groups (tests check it against Megatron's own
``RankGenerator``). Expert parallelism splits the dp x cp ranks of a stage into ``ep`` consecutive
ranks (Megatron's ``tp-ep-dp-pp`` expert order with expert tp = tp).

Training groups of different shapes: AReaL-Hex gives each device pool its own training layout (H100s at
dp2 x tp1, A100s at dp1 x tp2, ...), so the trainer ranks are cut into consecutive groups, each a mesh of
its own, and every group's data-parallel replicas together share each batch. ``actor.parallel.groups``
lists the groups' ``[dp, tp, pp]`` in rank order (``submit --plan`` writes it when the plan's training
groups differ in shape); empty, the trainer ranks form one mesh as ``actor.parallel`` lays it out.
Replicas are numbered group by group: group 0's dp ranks first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_hpc.config import ParallelConfig
from areal_hpc.errors import UserError

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest varying rank coordinate
EXPERT_DIMS = ("pp", "edp", "ep", "tp")  # the same ranks seen by MoE layers: dp x cp = edp x ep
ALLOCATION = re.compile(r"^megatron:d(\d+)p(\d+)t(\d+)$")
NOT_WITH_GROUPS = (("cp", 1), ("ep", 1), ("vpp", 1), ("distributed_optimizer", False), ("allocation", ""))


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False
    distributed_optimizer: bool = False  # ZeRO-1: optimizer state sharded over dp x cp (Megatron's)
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        """Sizes from ``actor.parallel`` (``allocation``, e.g. ``megatron:d8p1t1``, sets dp, pp and tp;
        dp=0 takes what the other sizes leave of ``world_size``), checked against the world."""
        dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
        if parallel.allocation:
            match = ALLOCATION.match(parallel.allocation.strip())
            if not match:
                raise UserError(
                    f"actor.parallel.allocation={parallel.allocation!r} is not a training allocation; "
                    "expected megatron:d<dp>p<pp>t<tp>, e.g. megatron:d8p1t1 (see `areal-hpc plan`)"
                )
            dp, pp, tp = (int(v) for v in match.groups())
        if dp == 0:
            model_parallel = tp * pp * parallel.cp
            if world_size % model_parallel:
                raise UserError(
                    f"actor.parallel tp={tp} x pp={pp} x cp={parallel.cp} needs rl.trainer_processes to be "
                    f"a multiple of {model_parallel}, got {world_size}"
                )
            dp = world_size // model_parallel
        dims = cls(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=parallel.cp,
            ep=parallel.ep,
            sequence_parallel=parallel.sequence_parallel,
            fsdp=parallel.fsdp,
            distributed_optimizer=parallel.distributed_optimizer,
            vpp=parallel.vpp,
        )
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
            raise UserError(
                f"parallel sizes dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} need "
                f"{self.world_size} processes, but {world_size} were started (set rl.trainer_processes="
                f"{self.world_size}, or actor.parallel.dp=0 to fill the world)"
            )
        if (self.dp * self.cp) % self.ep:
            raise UserError(
                f"actor.parallel.ep={self.ep} must divide dp x cp = {self.dp * self.cp} "
                "(experts are split over the data-parallel ranks of a stage)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise UserError("actor.parallel.sequence_parallel=true needs tp > 1")
        if self.vpp > 1 and self.pp == 1:
            raise UserError(
                f"actor.parallel.vpp={self.vpp} needs pp > 1 (virtual stages interleave pipeline ranks); "
                "set actor.parallel.vpp=1 or pp >= 2"
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each mesh dim (and its expert-parallel coordinates)."""
        rest, coords = rank, dict[str, int]()
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
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            by_key.setdefault(tuple(coords[k] for k in system if k not in names), []).append(rank)
        return list(by_key.values())


@dataclass(frozen=True)
class MixedLayout:
    """The trainer ranks' layout: training meshes of different shapes in rank order (one per device pool,
    ``actor.parallel.groups``), or the one mesh of ``actor.parallel``."""

    groups: tuple[ParallelDims, ...]

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> MixedLayout:
        """The groups of ``actor.parallel.groups`` (each ``[dp, tp, pp]``), or the one mesh of
        ``actor.parallel``; checked against the world, and ``actor.parallel.dp_weights`` against the
        replicas."""
        layout = cls(_shaped_groups(parallel) if parallel.groups else (ParallelDims.from_config(parallel, world_size),))
        if layout.world_size != world_size:  # one mesh: ParallelDims.from_config has said so already
            raise UserError(
                f"actor.parallel.groups {[list(s) for s in parallel.groups]} hold {layout.world_size} "
                f"trainer ranks, but {world_size} were started (set rl.trainer_processes="
                f"{layout.world_size})"
            )
        data_parallel_weights(parallel, layout.replicas)
        return layout

    @property
    def world_size(self) -> int:
        return sum(g.world_size for g in self.groups)

    @property
    def offsets(self) -> list[int]:
        """Each group's first global rank."""
        starts = [0]
        for group in self.groups[:-1]:
            starts.append(starts[-1] + group.world_size)
        return starts

    @property
    def replicas(self) -> int:
        """Data-parallel replicas over every group: how many shares a batch is cut into."""
        return sum(g.dp for g in self.groups)

    def locate(self, rank: int) -> tuple[int, int]:
        """(group index, rank within the group) of a global rank."""
        for index, (offset, group) in enumerate(zip(self.offsets, self.groups)):
            if rank < offset + group.world_size:
                return index, rank - offset
        raise ValueError(f"rank {rank} is outside the {self.world_size} trainer ranks")

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's coordinates in its own group's mesh."""
        index, local = self.locate(rank)
        return self.groups[index].coordinates(local)

    def replica(self, rank: int) -> int:
        """Which share of each batch the rank trains on: its group's replicas come after the earlier
        groups' ones."""
        index, local = self.locate(rank)
        return sum(g.dp for g in self.groups[:index]) + self.groups[index].coordinates(local)["dp"]

    def stages(self) -> list[list[int]]:
        """The global ranks of each group's pipeline stages (group by group, stage by stage): the ranks
        holding the same parameters in a group, its first replica's first tensor-parallel rank first."""
        return [
            [offset + rank for rank in ranks]
            for offset, group in zip(self.offsets, self.groups)
            for ranks in group.groups("dp-cp-tp")
        ]

    def pipeline_ends(self) -> list[list[int]]:
        """[first stage's rank, last stage's rank] of every replica slot (dp, cp, tp) of every group
        with pipeline stages: where a tied embedding's gradients are summed."""
        return [
            [offset + ranks[0], offset + ranks[-1]]
            for offset, group in zip(self.offsets, self.groups)
            if group.pp > 1
            for ranks in group.groups("pp")
        ]

    def leads_replica(self, rank: int) -> bool:
        """First rank of its model replica (tp = cp = pp = 0 in its group)."""
        coords = self.coordinates(rank)
        return coords["tp"] == coords["cp"] == coords["pp"] == 0


def _shaped_groups(parallel: ParallelConfig) -> tuple[ParallelDims, ...]:
    """``actor.parallel.groups`` as meshes, each entry and the settings beside it checked."""
    for name, alone in NOT_WITH_GROUPS:
        if getattr(parallel, name) != alone:
            raise UserError(
                f"actor.parallel.{name}={getattr(parallel, name)!r} is not built for training groups "
                f"of different shapes (actor.parallel.groups); leave it at {alone!r}"
            )
    groups: list[ParallelDims] = []
    for shape in parallel.groups:
        if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(n, int) for n in shape)):
            raise UserError(
                f"actor.parallel.groups entry {shape!r} is not [dp, tp, pp]; expected e.g. [[2, 1, 1], [1, 2, 1]]"
            )
        if min(shape) < 1:
            raise UserError(f"actor.parallel.groups entry {list(shape)} has a size below 1")
        if parallel.sequence_parallel and shape[1] == 1:
            raise UserError(
                f"actor.parallel.sequence_parallel=true needs tp > 1 in every group; group {list(shape)} has tp=1"
            )
        dp, tp, pp = shape
        groups.append(
            ParallelDims(dp=dp, tp=tp, pp=pp, fsdp=parallel.fsdp, sequence_parallel=parallel.sequence_parallel)
        )
    return tuple(groups)


def data_parallel_weights(parallel: ParallelConfig, dp: int) -> list[float] | None:
    """``actor.parallel.dp_weights`` checked against the ``dp`` replicas over every training group (None:
    equal shares)."""
    weights = list(parallel.dp_weights)
    if not weights:
        return None
    if len(weights) != dp or not all(isinstance(w, (int, float)) and w > 0 for w in weights):
        raise UserError(
            f"actor.parallel.dp_weights={weights} must hold {dp} positive numbers, one per data-parallel replica"
        )
    return [float(w) for w in weights]
