"""What trainer rank 0's asynchronous loop works with, opened together and closed together: the task
and its workflow, the reward pool (and, with ``reward.model``, the task's own for evaluations), the
progress display, the trajectory shards (and the proxy's
records), the rollout client, the chat gateway agent workflows talk to, the weight sync and the rollout
controller; and the loop's steps that are not the algorithm itself
(taking a batch through the shards, pushing weights, evaluating, checkpointing).

Opening it pushes the trainer's weights to every server, evaluates the starting policy and starts
generation; closing it stops generation and the background tasks, however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

from areal_hpc.agents.chat import optional_chat
from areal_hpc.agents.engine import EpisodeSettings, Scorer
from areal_hpc.agents.groups import EpisodeGroups
from areal_hpc.agents.registry import build_workflow
from areal_hpc.algo.temperature import run_temperature
from areal_hpc.config import RunConfig
from areal_hpc.data.prompts import PromptStream
from areal_hpc.data.shards.consumer import TrajectoryConsumer
from areal_hpc.data.shards.writer import TrajectoryShardWriter
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.controller import Episode
from areal_hpc.runtime.rollout_token import rollout_token
from areal_hpc.train.build import (
    build_controller,
    build_weight_sync,
    engine_settings,
    open_proxy_records,
    open_shards,
    recovered_episodes,
    take_proxy_records,
    wait_for_servers,
)
from areal_hpc.train.demo_tuning import ThreadPlacement
from areal_hpc.train.distill import Teacher, open_teacher
from areal_hpc.train.evaluate import evaluate
from areal_hpc.train.progress import RLProgress
from areal_hpc.train.stopping import StopRequested
from areal_hpc.train.task_setup import open_task, reward_pool
from areal_hpc.train.trainer import Trainer
from areal_hpc.train.weight_push import admit_servers


class RLRun:
    """One run's open resources on trainer rank 0 (``open``), from its starting ``version``."""

    def __init__(
        self,
        cfg: RunConfig,
        trainer: Trainer,
        state: dict,
        task,
        workflow,
        settings: EpisodeSettings,
        eval_settings: EpisodeSettings,
        progress: RLProgress,
        writer: TrajectoryShardWriter,
        consumer: TrajectoryConsumer,
        proxy_records,
        client: RolloutClient,
        placement: ThreadPlacement,
        teacher: Teacher | None,
        stopping: asyncio.Event,
    ):
        self.cfg, self.trainer, self.task, self.workflow, self.progress = cfg, trainer, task, workflow, progress
        self.placement, self.teacher = placement, teacher
        self.settings, self.consumer, self.proxy_records, self.client = settings, consumer, proxy_records, client
        self.eval_settings = eval_settings
        self.actor = trainer.engines["actor"]  # its saves and weight gatherings are collective over every rank
        self.version = state["step"]
        self.evaluated = state.get("evaluated", self.version)  # the last step evaluated
        self.prompts = PromptStream(task.train, cfg.experiment.seed, state.get("prompts_drawn", 0))
        self.sync = build_weight_sync(cfg, self.actor.device.type, placement.training)
        groups = EpisodeGroups(
            workflow,
            lambda _client: settings,
            cfg.generation.n_samples,
            task.name,
            seed=cfg.experiment.seed,
            first_group=self.prompts.drawn,
            merge_groups=cfg.rollout.merge_group_requests,
        )
        self.controller = build_controller(
            cfg,
            client,
            groups,
            self.prompts,
            writer,
            self.version,
            on_drop=self._drop,
            commit_executor=placement.shard_commits,
            stopping=stopping,
        )
        self.controller.restore(recovered_episodes(consumer, self.version))
        self.controller.dropped = state.get("dropped", 0)
        # An evaluation of version v runs beside the training of step v + 1 and ends before the weights of
        # v + 1 reach the servers, so every answer it scores is version v's.
        self.evaluation: asyncio.Future = asyncio.create_task(asyncio.sleep(0))
        self.pushing: asyncio.Task | None = None  # a weight push running beside the next step's update
        self.background: list[asyncio.Task] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, cfg: RunConfig, trainer: Trainer, state: dict, stopping: asyncio.Event) -> AsyncIterator[RLRun]:
        """``stopping``: set once a stop signal arrived (an episode failing after it is the stop's doing)."""
        # the update on this process's cores (or a child's there), this thread on the rollout side's
        with ThreadPlacement(training_elsewhere=trainer.trains_elsewhere) as placement:
            tokenizer, model_dir = trainer.engines["actor"].tokenizer, cfg.tokenizer.path or cfg.model.path
            task = open_task(cfg, tokenizer, model_dir)
            workflow = build_workflow(cfg.rollout)
            addresses, servers = await wait_for_servers(cfg, cfg.rollout.launch_timeout_s)
            # requests in flight at most
            in_flight = cfg.rollout.max_concurrent_rollouts * cfg.generation.n_samples + len(task.eval)
            with (
                reward_pool(cfg, task, training=True) as rewards,
                reward_pool(cfg, task) if cfg.reward.model else contextlib.nullcontext() as eval_rewards,
                RLProgress(cfg, state["step"]) as progress,
                shards(cfg, state.get("cursor", {})) as (writer, consumer),
                open_proxy_records(cfg, state.get("proxy_cursor")) or contextlib.nullcontext() as proxy_records,
            ):
                async with (
                    open_teacher(cfg, tokenizer) as teacher,
                    RolloutClient(
                        addresses, cfg.rollout.request_timeout_s, in_flight, rollout_token(cfg.run_dir)
                    ) as client,
                    optional_chat(client.generate, model_dir, cfg.rollout.turn_discount) as chat,
                ):
                    settings = engine_settings(cfg, client, tokenizer, rewards, chat)
                    # accuracy is the task's, whatever the rollouts are scored by
                    eval_settings = settings if eval_rewards is None else replace(settings, scorer=Scorer(eval_rewards))
                    run = cls(
                        cfg,
                        trainer,
                        state,
                        task,
                        workflow,
                        settings,
                        eval_settings,
                        progress,
                        writer,
                        consumer,
                        proxy_records,
                        client,
                        placement,
                        teacher,
                        stopping,
                    )
                    await run._start(servers)
                    try:
                        yield run
                    finally:
                        await run._stop()

    async def _start(self, servers) -> None:
        await self.sync.connect(self.client)
        await self.sync.push(self.actor, self.client, self.version)  # the servers start from the trainer's weights
        if self.version == 0 or (self._evaluation_due(self.version) and self.evaluated != self.version):
            await self._evaluate(self.version)  # (a stop skipped it)
        await self.controller.start()
        self.progress.rollouts_started()
        self.background = [
            asyncio.create_task(self.progress.watch(self.controller)),  # failures show meanwhile
            asyncio.create_task(
                admit_servers(
                    servers,
                    self.client,
                    self.sync,  # new servers
                    self.progress.console.print,
                )
            ),
        ]

    async def _stop(self) -> None:
        for task in [self.evaluation, self.pushing, *self.background]:
            if task is not None:
                task.cancel()
        await self.controller.stop()
        self.progress.rollout_counts(self.controller)  # the last counts, however the run ends

    def _drop(self, episode: Episode) -> None:
        """Too stale to train: consumed without reading it back, and logged."""
        self.consumer.mark_ids(episode.ids)
        self.progress.dropped(episode.ids)

    def take_batch(self, episodes: list[Episode], step: int) -> list[Trajectory]:
        """The batch of ``step``: its episodes (committed to the shards before they were queued, so they are
        consumed through the shards' cursor, not read back: 128 records decoded again cost rank 0's
        interpreter, which the update shares), and agents' sessions through the login-node proxy (those too
        stale are consumed and logged)."""
        self.consumer.mark_ids([i for e in episodes for i in e.ids])
        batch = [t for e in episodes for t in e.trajectories]
        if self.proxy_records is not None:
            fresh, stale = take_proxy_records(
                self.proxy_records, self.cfg.rl.proxy_records_per_step, step, self.cfg.rollout.max_head_offpolicyness
            )
            batch += fresh
            if stale:
                self.progress.dropped([t.id for t in stale])
        return batch

    async def update(self, batch: list[Trajectory]) -> dict[str, float]:
        """Proximal logprobs and the decoupled-PPO steps of ``batch`` on every rank, on the training thread
        (first scored by the teacher, when distilling)."""
        teacher_logprobs, scored = None, {}
        if self.teacher is not None:
            teacher_logprobs, scored = await self.teacher.score(batch, run_temperature(self.cfg.generation))
        stats = await asyncio.get_running_loop().run_in_executor(
            self.placement.training, self.trainer.update, batch, teacher_logprobs
        )
        return {**stats, **scored}

    async def push_weights(self, version: int) -> dict[str, float]:
        """Stage the weights of ``version`` (on the training thread, once the previous push has ended),
        then push them: pause (interrupt) or drain generation, every server loads them, continue. With a
        sync that stages a copy (disk) the push runs beside the next step's update; otherwise it is
        awaited here. Each push logs its own record under ``version`` when it ends (``time/push``,
        ``sync/*``). Returns this step's part: ``time/stage``, with ``time/eval_wait`` the part of it
        spent waiting for an evaluation to end (the previous push waits for the one beside it)."""
        started = time.perf_counter()
        evaluation_ended = await self._pushed()
        stats = {"time/eval_wait": max(0.0, evaluation_ended - started)}
        stats |= await self.sync.stage(self.actor, version)  # written while generation goes on
        # the evaluation of the version before ends first: every answer it scores is that version's
        self.pushing = asyncio.create_task(self._push(version, self.evaluation))
        if not self.sync.stages_a_copy:
            await self._pushed()
        return stats | {"time/stage": time.perf_counter() - started}

    async def _push(self, version: int, evaluation: asyncio.Future) -> float:
        """The push of ``version``, logged; when the evaluation it waited for ended."""
        started = time.perf_counter()
        await evaluation
        evaluation_ended = time.perf_counter()
        await (self.controller.pause() if self.cfg.rl.interruptible else self.controller.drain())
        stats = await self.sync.push(self.actor, self.client, version)
        self.controller.set_version(version)
        await self.controller.resume()
        self.progress.pushed(version, stats | {"time/push": time.perf_counter() - started})
        return evaluation_ended

    async def _pushed(self) -> float:
        """Wait for the running push (if any) to end; when the evaluation it waited for ended (0: none)."""
        pushing, self.pushing = self.pushing, None
        return 0.0 if pushing is None else await pushing

    def trained(
        self, version: int, batch: list[Trajectory], stats: dict[str, float], waited: float, started: float
    ) -> None:
        self.progress.trained(version, batch, stats, waited, time.perf_counter() - started, self.controller)

    async def evaluate_and_save(self, version: int) -> None:
        """Start an evaluation of ``version`` when one is due (awaited at the last step), then save a
        checkpoint when one is due (an evaluation still running is done again after a resume)."""
        last = version == self.cfg.rl.total_train_steps
        if self._evaluation_due(version):
            self.evaluation = asyncio.create_task(self._evaluate(version, self.pushing))
        if last:
            await self.evaluation
        if last or (self.cfg.saver.freq_steps and version % self.cfg.saver.freq_steps == 0):
            self.checkpoint(version)

    def save_and_stop(self, version: int) -> None:
        self.checkpoint(version)
        self.progress.stopped(version)
        raise StopRequested

    def checkpoint(self, version: int) -> None:
        proxy_cursor = self.proxy_records.cursor.state_dict() if self.proxy_records is not None else None
        self.trainer.save_checkpoint(
            self.cfg.run_dir,
            version,
            {
                "prompts_drawn": self.prompts.drawn,
                "dropped": self.controller.dropped,
                "cursor": self.consumer.cursor.state_dict(),
                "proxy_cursor": proxy_cursor,
                "evaluated": self.evaluated,
            },
        )

    def finish(self) -> int:
        """After the last step: the model for ``areal-hpc eval --model``, the run's plots and its exit status
        (non-zero when episodes or rewards failed, ``RLProgress.finish``)."""
        self.actor.save(self.cfg.run_dir / "model", optimizer=False)
        return self.progress.finish(self.controller.failures)

    def _evaluation_due(self, version: int) -> bool:
        every = self.cfg.rl.eval_every_steps
        return version in (0, self.cfg.rl.total_train_steps) or bool(every and version % every == 0)

    async def _evaluate(self, version: int, pushing: asyncio.Task | None = None) -> None:
        if pushing is not None:  # the servers evaluate the weights of ``version`` once they have them
            await asyncio.shield(pushing)
        started = time.perf_counter()
        result = await evaluate(self.eval_settings, self.workflow, self.task.eval)
        self.progress.evaluated(version, result, time.perf_counter() - started)
        self.evaluated = version


@contextlib.contextmanager
def shards(cfg: RunConfig, cursor_state: dict) -> Iterator[tuple[TrajectoryShardWriter, TrajectoryConsumer]]:
    """The run's shard writer and consumer, both closed when the run ends. After a failure the
    writer's last commit may fail too (a full disk): that must not hide the error that stopped the run."""
    writer, consumer = open_shards(cfg, cursor_state)
    try:
        yield writer, consumer
    except BaseException:
        with contextlib.suppress(OSError):
            writer.close()
        raise
    else:
        writer.close()
    finally:
        consumer.close()
