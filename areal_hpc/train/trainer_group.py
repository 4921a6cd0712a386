"""Rank 0's handle on the data-parallel trainer ranks. Rank 0 runs the driver (rollout controller,
shards, weight sync) and forms each batch; every rank trains on its share through one collective
call; the other ranks just follow:

    rank 0:    group = TrainerGroup(actor, cfg); stats = group.update(trajectories); ...; group.stop()
    rank > 0:  follow(actor)        # returns when rank 0 calls stop()
"""

from __future__ import annotations

import time

import torch.distributed as dist

from areal_hpc.config import RunConfig
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.engine import merge_stats
from areal_hpc.train.trajectory_batch import build_batch, data_parallel_parts, split_minibatches

UPDATE, STOP = "update", "stop"
PER_STEP_KEYS = ("grad_norm", "lr")  # equal on every rank after the all-reduce: not summed over ranks


class TrainerGroup:
    def __init__(self, actor: PPOActor, cfg: RunConfig):
        self.actor, self.cfg = actor, cfg
        self.world = dist.get_world_size()

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Recompute logprobs and take the PPO steps of one batch on every rank; summed statistics."""
        started = time.perf_counter()
        actor_cfg, max_new = self.cfg.actor, self.cfg.gconfig.max_new_tokens
        batch = build_batch(trajectories, actor_cfg, max_new)
        minibatches = split_minibatches(batch, trajectories, actor_cfg, max_new)
        parts = data_parallel_parts(minibatches, self.world)
        own = _scatter([(UPDATE, part) for part in parts])[1]
        every = _gather(self.actor.update(own))
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

    def stop(self) -> None:
        if self.world > 1:
            _scatter([(STOP, None)] * self.world)


def ppo_fractions(stats: dict[str, float]) -> dict[str, float]:
    """The loss statistics people read, per trained token, from the summed counts."""
    tokens = stats.get("actor/loss_tokens", 0.0)
    if not tokens:
        return {}
    return {"actor/clip_fraction": stats["actor/clipped_tokens"] / tokens,
            "actor/behav_masked_fraction": 1.0 - stats["actor/kept_tokens"] / tokens,
            "actor/behav_capped_fraction": stats["actor/capped_tokens"] / tokens,
            "actor/behav_weight_dev": stats["actor/behav_weight_dev_sum"] / tokens,
            "actor/approx_kl": stats["actor/approx_kl_sum"] / tokens,
            "actor/entropy": stats["actor/entropy_sum"] / tokens}


def follow(actor: PPOActor) -> None:
    """Ranks > 0: train on whatever share rank 0 scatters until it says stop."""
    while True:
        command, part = _scatter(None)
        if command == STOP:
            return
        _gather(actor.update(part))


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
