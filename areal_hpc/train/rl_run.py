"""What the asynchronous RL driver is made of, built from the config on trainer rank 0: rollout
servers found in name-resolve, the prompt stream, the workflow, the shard writer and consumer, the
staleness gate and controller, the weight sync, and resume state from the latest checkpoint.

``async_rl.py`` holds the loop itself; this module keeps the wiring out of it.
"""

from __future__ import annotations

import asyncio
import random
import time

from areal_hpc.algo.filters import is_informative_group
from areal_hpc.config import RunConfig
from areal_hpc.data.shards.consumer import ConsumerCursor, TrajectoryConsumer
from areal_hpc.data.shards.reader import TrajectoryStore
from areal_hpc.data.shards.writer import TrajectoryShardWriter
from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import UserError
from areal_hpc.launch.name_resolve import ROLLOUT_SERVERS, NameResolve
from areal_hpc.parallel.mesh import BACKENDS
from areal_hpc.rollout.controller import Episode, RolloutController
from areal_hpc.rollout.staleness import StalenessGate
from areal_hpc.rollout.workflows import RLVRWorkflow, Sampling, Scorer
from areal_hpc.train.weight_update import DiskWeightSync, DistributedWeightSync

SHARD_WRITER = "rollout"


class PromptStream:
    """Training prompts in seeded shuffled passes, endless; ``drawn`` says where to continue after a resume."""

    def __init__(self, examples: list[Example], seed: int, drawn: int = 0):
        self.examples, self.seed, self.drawn = examples, seed, 0
        self._order: list[int] = []
        for _ in range(drawn):
            next(self)

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> Example:
        position = self.drawn % len(self.examples)
        if position == 0:
            self._order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + self.drawn // len(self.examples)).shuffle(self._order)
        self.drawn += 1
        return self.examples[self._order[position]]


async def wait_for_servers(cfg: RunConfig, timeout_s: float) -> list[str]:
    """The ``host:port`` of every rollout server of this run, once all ``rollout.n_servers`` registered."""
    names = NameResolve(cfg.run_dir / "name_resolve")
    deadline = time.monotonic() + timeout_s
    while len(addresses := names.values(ROLLOUT_SERVERS)) < cfg.rollout.n_servers:
        if time.monotonic() > deadline:
            raise UserError(f"{len(addresses)} of {cfg.rollout.n_servers} rollout servers registered in "
                            f"{names.root} within {timeout_s:g} s (see {cfg.run_dir / 'logs'})")
        await asyncio.sleep(0.2)
    return addresses


def build_weight_sync(cfg: RunConfig, device_type: str):
    if cfg.rl.weight_sync == "disk":
        return DiskWeightSync(cfg.run_dir / "weights")
    backend = BACKENDS[device_type] if device_type == "cuda" else "gloo"
    return DistributedWeightSync(backend, cfg.rl.weight_sync_bucket_mb << 20)


def build_controller(cfg: RunConfig, client, tokenizer, scorer: Scorer, task_name: str, prompts: PromptStream,
                     writer: TrajectoryShardWriter, version: int, on_drop) -> RolloutController:
    workflow = RLVRWorkflow(tokenizer, Sampling.from_config(cfg.gconfig), cfg.gconfig.n_samples, scorer, task_name)
    gate = StalenessGate.resumed(cfg.rollout.consumer_batch_size, cfg.rollout.max_head_offpolicyness,
                                 cfg.rollout.max_concurrent_rollouts, version)

    def store(episode: Episode) -> None:  # one commit per group: a crash never leaves half a group
        for trajectory in episode.trajectories:
            writer.append(trajectory)
        writer.flush()

    accept = ((lambda group: is_informative_group([t.reward or 0.0 for t in group]))
              if cfg.actor.dynamic_sampling else (lambda group: True))
    return RolloutController(client, workflow, gate, prompts, on_accept=store, accept=accept, on_drop=on_drop)


def open_shards(cfg: RunConfig, cursor_state: dict) -> tuple[TrajectoryShardWriter, TrajectoryConsumer]:
    folder = cfg.run_dir / "shards"
    writer = TrajectoryShardWriter(folder, SHARD_WRITER, experiment=cfg.experiment.name,
                                   trial=cfg.experiment.trial, flush_every=1 << 30)  # flushed per group
    return writer, TrajectoryConsumer(TrajectoryStore(folder), ConsumerCursor.from_state_dict(cursor_state))


def recovered_episodes(consumer: TrajectoryConsumer, version: int) -> list[Episode]:
    """Groups that were stored before a restart but not trained by the checkpoint we resumed from.
    Those generated after it carry versions of a timeline that was lost: they count as ``version``."""
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in consumer.pending():
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    return [Episode(group, min(version, *(t.version_range[0] for t in group))) for group in groups.values()]
