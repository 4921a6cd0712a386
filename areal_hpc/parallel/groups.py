"""Training groups of different shapes in one job: AReaL-Hex gives each device pool its own training
layout (H100s at dp2 x tp1, A100s at dp1 x tp2, ...), so the trainer ranks are cut into consecutive
groups, each a mesh of its own (``ParallelDims``), and every group's data-parallel replicas together
share each batch. Plain arithmetic (no torch), like ``dims.py``, but for ``check_group_training``, which
asks the engine's class (it imports the engine) when groups are set.

``actor.parallel.groups`` lists the groups' ``[dp, tp, pp]`` in rank order (``submit --plan`` writes it
when the plan's training groups differ in shape); empty, the trainer ranks form one mesh as
``actor.parallel`` lays it out. Replicas are numbered group by group: group 0's dp ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hpc import builtins
from areal_hpc.errors import UserError
from areal_hpc.parallel.dims import ParallelDims

NOT_WITH_GROUPS = (("cp", 1), ("ep", 1), ("vpp", 1), ("distributed_optimizer", False), ("allocation", ""))


@dataclass(frozen=True)
class MixedLayout:
    """The trainer ranks' layout: training meshes of different shapes in rank order (one per device pool,
    ``actor.parallel.groups``), or the one mesh of ``actor.parallel``."""

    groups: tuple[ParallelDims, ...]

    @classmethod
    def from_config(cls, parallel, world_size: int) -> MixedLayout:
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


def _shaped_groups(parallel) -> tuple[ParallelDims, ...]:
    """``actor.parallel.groups`` as meshes, each entry and the settings beside it checked."""
    for name, alone in NOT_WITH_GROUPS:
        if getattr(parallel, name) != alone:
            raise UserError(
                f"actor.parallel.{name}={getattr(parallel, name)!r} is not built for training groups "
                f"of different shapes (actor.parallel.groups); leave it at {alone!r}"
            )
    groups = []
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


def data_parallel_weights(cfg, dp: int) -> list[float] | None:
    """``actor.parallel.dp_weights`` checked against the ``dp`` replicas over every training group (None:
    equal shares)."""
    weights = list(cfg.dp_weights)
    if not weights:
        return None
    if len(weights) != dp or not all(isinstance(w, (int, float)) and w > 0 for w in weights):
        raise UserError(
            f"actor.parallel.dp_weights={weights} must hold {dp} positive numbers, one per data-parallel replica"
        )
    return [float(w) for w in weights]


def check_group_training(actor_cfg) -> None:
    """With ``actor.parallel.groups``: an engine that sums the groups' gradients (its class says
    ``supports_training_groups``: the torch engine's); what else needs collectives over every replica (a
    critic's whitening, M2PO's batch-wide bound) or a gradient path of its own (LoRA, tree training) is
    not built for them: one line each."""
    if not actor_cfg.parallel.groups:
        return
    engine, loss = builtins.load("train_engine", actor_cfg.engine), builtins.load("policy_loss", actor_cfg.policy_loss)
    unbuilt = [
        ("actor.engine", actor_cfg.engine, not engine.supports_training_groups, "torch"),
        (
            "actor.adv_estimator",
            actor_cfg.adv_estimator,
            builtins.uses_critic(actor_cfg.adv_estimator),
            "an estimator without a critic, e.g. grpo",
        ),
        ("actor.policy_loss", actor_cfg.policy_loss, loss.trust_region, "a policy loss without a trust region"),
        ("actor.lora.rank", actor_cfg.lora.rank, actor_cfg.lora.rank != 0, "0"),
        ("actor.tree_training", actor_cfg.tree_training, actor_cfg.tree_training == "dta", "off or auto"),
    ]
    for name, value, refused, instead in unbuilt:
        if refused:
            raise UserError(
                f"{name}={value} is not built for training groups of different shapes "
                f"(actor.parallel.groups={list(actor_cfg.parallel.groups)}); use {instead}, or one mesh"
            )
