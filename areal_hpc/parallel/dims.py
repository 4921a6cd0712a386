"""Sizes of the trainer mesh: dp, tp, pp, cp and ep, checked once against the world, in Megatron-core's
rank order. Plain arithmetic (no torch), so launchers check a layout before they start anything.

Rank order is Megatron's default ``tp-cp-ep-dp-pp``: tensor-parallel peers are adjacent ranks (one
node's fast links), then context, then data parallel, pipeline stages outermost; the mesh's dims are
therefore ("pp", "dp", "cp", "tp"), slowest to fastest, and a Megatron engine that feeds these sizes
to ``initialize_model_parallel`` gets the same groups (tests check it against Megatron's own
``RankGenerator``). Expert parallelism splits the dp x cp ranks of a stage into ``ep`` consecutive
ranks (Megatron's ``tp-ep-dp-pp`` expert order with expert tp = tp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_hpc.errors import UserError

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
    sequence_parallel: bool = False
    fsdp: bool = False
    distributed_optimizer: bool = False  # ZeRO-1: optimizer state sharded over dp x cp (Megatron's)
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank

    @classmethod
    def from_config(cls, parallel, world_size: int) -> ParallelDims:
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
