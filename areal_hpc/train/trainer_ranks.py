"""Rank 0's handle on the trainer ranks. Rank 0 runs the driver (rollout controller, shards, weight
sync) and forms each batch; every rank trains on its data-parallel replica's share through one
collective call, and takes part in every save and weight gathering (which are collective once
weights are sharded over tensor, pipeline or FSDP ranks); the other ranks just follow:

    rank 0:    group = TrainerRanks(actor, engines, mesh, cfg); stats = group.update(trajectories)
               group.engines["actor"].save(folder)   # announced, then made on every rank
               group.stop()
    rank > 0:  follow(actor, engines, mesh)           # returns when rank 0 calls stop()
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from areal_hpc.algo.temperature import run_temperature
from areal_hpc.config import RunConfig
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.engines.base import TrainEngine, WeightBucket, merge_stats
from areal_hpc.layout import data_parallel_weights
from areal_hpc.parallel.mesh import TrainMesh
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.checkpoint import save_checkpoint
from areal_hpc.train.trajectory_batch import build_batch, data_parallel_parts, split_minibatches

UPDATE, SAVE, WEIGHTS, STOP = "update", "save", "weights", "stop"
PER_STEP_KEYS = ("grad_norm", "lr")  # equal on every rank after the all-reduce: not summed over ranks


class TrainerRanks:
    """Rank 0's handle on every trainer rank (a ``trainer.Trainer``): ``update`` trains them all on a batch,
    ``stop`` releases them."""

    trains_elsewhere = False  # rank 0 trains in this process (``trainer_process.TrainerProcess``: in a child)

    def __init__(self, actor: PPOActor, engines: dict[str, TrainEngine], mesh: TrainMesh, cfg: RunConfig):
        self.actor, self.mesh, self.cfg = actor, mesh, cfg
        self.world, layout = dist.get_world_size(), mesh.layout
        self.data_ranks = [layout.replica(rank) for rank in range(self.world)]  # which share each rank trains on
        self.leaders = [rank for rank in range(self.world) if layout.leads_replica(rank)]  # one per replica
        self.replicas = layout.replicas  # over every training group
        self.dp_weights = data_parallel_weights(cfg.actor.parallel, self.replicas)  # faster replicas train more
        self.tree_cost = list(cfg.actor.tree_cost) if cfg.actor.tree_training == "dta" else None
        self.engines = {name: LeaderEngine(name, engine, self._announce) for name, engine in engines.items()}

    def update(
        self, trajectories: list[Trajectory], teacher_logprobs: list[list[float]] | None = None
    ) -> dict[str, float]:
        """Recompute logprobs and take the PPO steps of one batch on every rank; summed statistics.
        ``teacher_logprobs``: the distillation teacher's scores of the batch (``train.distill``)."""
        started = time.perf_counter()
        actor_cfg, max_new = self.cfg.actor, self.cfg.generation.max_new_tokens
        batch = build_batch(
            trajectories,
            actor_cfg,
            max_new,
            run_temperature(self.cfg.generation),
            teacher_logprobs,
            self.cfg.distill.reward_weight,
        )
        minibatches = split_minibatches(batch, trajectories, actor_cfg, max_new)
        parts = data_parallel_parts(minibatches, self.replicas, self.dp_weights, self.tree_cost)
        own = _scatter([(UPDATE, parts[d]) for d in self.data_ranks])[1]
        gathered = _gather(self.actor.update(own))
        every = [gathered[r] for r in self.leaders]  # a replica's ranks report the same numbers once
        stats = merge_stats(every)
        for key in stats:
            if key.endswith(PER_STEP_KEYS) or key.startswith("time/"):
                stats[key] = every[0][key]  # the same on every rank (or rank 0's clock): not summed
            if key.endswith(("loss", *PER_STEP_KEYS)):
                stats[key] /= len(minibatches)  # the mean over the step's optimizer steps
        stats.update(ppo_fractions(stats))
        stats["time/train"] = time.perf_counter() - started
        stats["train/tokens"] = float(batch.n_tokens)  # every token forwarded (prompts included)
        stats["train/trained_tokens"] = stats.get("actor/loss_tokens", 0.0)  # tokens with a loss: the outputs
        return stats

    def save_checkpoint(self, run_dir: Path, step: int, driver: dict[str, Any]) -> Path:
        """A checkpoint of every engine (each save collective over the ranks), this process's RNG streams
        (the training's) and the driver's JSON-able ``driver`` state."""
        return save_checkpoint(run_dir, step, self.engines, driver)

    def _announce(self, command: str, payload) -> None:
        if self.world > 1:
            _scatter([(command, payload)] * self.world)

    def stop(self) -> None:
        """Release the other ranks; every rank leaves together (``_leave``)."""
        if self.world > 1:
            self._announce(STOP, None)
            _leave()


class LeaderEngine:
    """Rank 0's view of an engine: ``save`` and ``rollout_weights`` are announced to the other ranks,
    which make the same call (``follow``); everything else is the engine's own."""

    def __init__(self, name: str, engine: TrainEngine, announce):
        self.name, self.engine, self._announce = name, engine, announce

    def __getattr__(self, attribute: str):
        return getattr(self.engine, attribute)

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        self._announce(SAVE, (self.name, folder, optimizer))
        self.engine.save(folder, optimizer=optimizer)

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        self._announce(WEIGHTS, (self.name, bucket_bytes))
        buckets = self.engine.rollout_weights(bucket_bytes)
        try:
            yield from buckets
        finally:  # a push that stops early still ends the gathering the other ranks take part in
            for _ in buckets:
                pass


def ppo_fractions(stats: dict[str, float]) -> dict[str, float]:
    """The loss statistics people read, per trained token, from the summed counts."""
    tokens = stats.get("actor/loss_tokens", 0.0)
    if not tokens:
        return {}
    return {
        "actor/clip_fraction": stats["actor/clipped_tokens"] / tokens,
        "actor/behav_masked_fraction": 1.0 - stats["actor/kept_tokens"] / tokens,
        "actor/behav_capped_fraction": stats["actor/capped_tokens"] / tokens,
        "actor/behav_weight_mean": stats["actor/behav_weight_sum"] / tokens,
        "actor/behav_weight_dev": stats["actor/behav_weight_dev_sum"] / tokens,
        "actor/approx_kl": stats["actor/approx_kl_sum"] / tokens,
        "actor/entropy": stats["actor/entropy_sum"] / tokens,
    }


def follow(actor: PPOActor, engines: dict[str, TrainEngine], mesh: TrainMesh) -> None:
    """Ranks > 0: train on whatever share rank 0 scatters, and join its saves and weight gatherings
    (those of rank 0's training group: the other groups hold the same weights), until it says stop."""
    while True:
        command, payload = _scatter(None)
        if command == STOP:
            _leave()
            return
        if command == UPDATE:
            _gather(actor.update(payload))
        elif mesh.index != 0:
            continue
        elif command == SAVE:
            name, folder, optimizer = payload
            engines[name].save(folder, optimizer=optimizer)
        elif command == WEIGHTS:
            name, bucket_bytes = payload
            for _ in engines[name].rollout_weights(bucket_bytes):
                pass


def _leave() -> None:
    """A barrier before the ranks tear their process groups down: a gloo rank whose peer closed its
    sockets first sometimes aborts in teardown (seen about 1 run in 7 with FSDP2 or replicate)."""
    dist.barrier()


def _scatter(items):
    if dist.get_world_size() == 1:
        return items[0]
    out = [None]
    dist.scatter_object_list(out, items, src=0)
    return out[0]


def _gather(stats: dict) -> list[dict] | None:
    if dist.get_world_size() == 1:
        return [stats]
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stats, every, dst=0)
    return every
