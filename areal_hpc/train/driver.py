"""Asynchronous RL (AReaL) on trainer rank 0: rollouts never stop while the trainer trains.

    areal-hpc train --config configs/quickstart.yaml            # the launcher: servers + trainer ranks
    python -m areal_hpc.train.driver --config FILE [--resume]    # what the launcher runs per trainer rank

Each step: wait for a batch of finished groups no more than eta versions stale (generation and
rewards run all along, as many episodes as the staleness gate admits), read them back from the HDF5
shards, recompute the proximal logprobs and take the decoupled-PPO steps on every rank, then pause
(interrupt) generation, push the new weights to every server, and continue. eta = 0 is synchronous RL.
Rollouts that keep failing (``rollout.failure_budget``), or every server gone, end the run with one
line naming the cause and the last error, exit code 1. SIGUSR2 (Slurm's warning before a time limit or
preemption) or SIGTERM (requeue, scancel) saves a checkpoint at once (after the update in progress, if
any) and exits with ``SAVED_AND_STOPPED``; the launcher requeues and the next incarnation resumes.
Simplifications on purpose: single-turn RLVR workflow; evaluation runs through the rollout servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing.resource_tracker
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator

from areal_hpc.config import RunConfig, load_config
from areal_hpc.data.prompts import PromptStream
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.registry import build_task
from areal_hpc.data.shards.consumer import TrajectoryConsumer
from areal_hpc.data.shards.writer import TrajectoryShardWriter
from areal_hpc.errors import UserError
from areal_hpc.runtime.rollout_token import rollout_token
from areal_hpc.parallel.mesh import close_distributed
from areal_hpc.rollout.client import RolloutClient, RolloutError
from areal_hpc.rollout.workflows import Scorer
from areal_hpc.train.build import (build_actor, build_controller, build_weight_sync, open_proxy_records, open_shards,
                                   recovered_episodes, start_trainer, take_proxy_records, wait_for_servers)
from areal_hpc.runtime.run_state import SAVED_AND_STOPPED, latest_checkpoint
from areal_hpc.train.checkpoint import load_checkpoint, save_checkpoint
from areal_hpc.train.evaluate import evaluate_remote
from areal_hpc.train.progress import RLProgress
from areal_hpc.train.trainer_group import TrainerGroup, follow
from areal_hpc.train.weight_push import admit_servers


STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopRequested(Exception):
    """A stop signal arrived and the checkpoint of the last completed step is written."""


class EarlyStopSignal:
    """While the trainer is still loading (before ``drive``): SIGUSR2 is remembered, so the run saves
    as soon as it can; SIGTERM ends the process (nothing new to save yet)."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True


async def drive(cfg: RunConfig, group: TrainerGroup, state: dict, early: EarlyStopSignal | None = None) -> None:
    # The group's engines: their saves and weight gatherings are collective over every trainer rank.
    task, engines = build_task(cfg.dataset), group.engines
    actor = engines["actor"]
    stop = asyncio.Event()
    for signum in STOP_SIGNALS:
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    if early is not None and early.received:
        stop.set()
    version, total, batch_size = state["step"], cfg.rl.total_train_steps, cfg.rollout.consumer_batch_size
    addresses, servers = await wait_for_servers(cfg, cfg.rollout.launch_timeout_s)
    in_flight = cfg.rollout.max_concurrent_rollouts * cfg.gconfig.n_samples + len(task.eval)  # /generate at most
    with (RewardPool(task.reward) as rewards, RLProgress(cfg, version) as progress,
          shards(cfg, state.get("cursor", {})) as (writer, consumer),
          open_proxy_records(cfg, state.get("proxy_cursor")) or contextlib.nullcontext() as proxy_records):
        async with RolloutClient(addresses, cfg.rollout.request_timeout_s, in_flight,
                                 rollout_token(cfg.run_dir)) as client:
            sync = build_weight_sync(cfg, actor.device.type)
            await sync.connect(client)
            await sync.push(actor, client, version)  # the servers start from the trainer's weights
            prompts = PromptStream(task.train, cfg.experiment.seed, state.get("prompts_drawn", 0))

            def drop(episode) -> None:  # too stale to train: consumed without reading it back, and logged
                consumer.mark_ids(episode.ids)
                progress.dropped(episode.ids)

            controller = build_controller(cfg, client, actor.tokenizer, Scorer(rewards), task.name, prompts, writer,
                                          version, on_drop=drop)
            controller.restore(recovered_episodes(consumer, version))
            controller.dropped = state.get("dropped", 0)

            evaluated = [state.get("evaluated", version)]  # the last step evaluated

            def evaluation_due(step: int) -> bool:
                return step == total or step == 0 or bool(cfg.rl.eval_every_steps and step % cfg.rl.eval_every_steps == 0)

            async def evaluate(step: int) -> None:
                result = await evaluate_remote(client, actor.tokenizer, task.eval, rewards, cfg.gconfig.max_new_tokens)
                progress.evaluated(step, result)
                evaluated.append(step)

            def checkpoint(step: int) -> None:
                proxy_cursor = proxy_records.cursor.state_dict() if proxy_records is not None else None
                save_checkpoint(cfg.run_dir, step, engines, {"prompts_drawn": prompts.drawn, "dropped": controller.dropped,
                                                             "cursor": consumer.cursor.state_dict(),
                                                             "proxy_cursor": proxy_cursor, "evaluated": evaluated[-1]})

            def stop_now(step: int) -> None:
                checkpoint(step)
                progress.stopped(step)
                raise StopRequested

            if version == 0 or (evaluation_due(version) and evaluated[-1] != version):  # a stop skipped it
                await evaluate(version)
            await controller.start()
            progress.rollouts_started()
            watching = asyncio.create_task(progress.watch(controller))  # failures show while the trainer waits
            joining = asyncio.create_task(admit_servers(servers, client, sync, progress.console.print))  # new servers
            # An evaluation of version v runs beside the training of step v + 1 and ends before the weights of
            # v + 1 reach the servers, so every answer it scores is version v's.
            evaluation = asyncio.create_task(asyncio.sleep(0))
            try:
                for step in range(version, total):
                    tick = time.perf_counter()
                    async with stopping_wins(stop, lambda: stop_now(step)):
                        episodes = await until_stopped(controller.prepare_batch(batch_size), stop)  # gate, generate, reward
                    if episodes is None:
                        stop_now(step)
                    waited = time.perf_counter() - tick
                    batch = consumer.take_ids([i for e in episodes for i in e.ids])  # read back from the shards
                    if proxy_records is not None:  # and agents' sessions through the login-node proxy
                        fresh, stale = take_proxy_records(proxy_records, cfg.rl.proxy_records_per_step, step,
                                                          cfg.rollout.max_head_offpolicyness)
                        batch += fresh
                        if stale:
                            progress.dropped([t.id for t in stale])
                    stats = await asyncio.to_thread(group.update, batch)          # recompute + PPO steps

                    def trained_then_stop() -> None:  # the step is trained; its weight push is not needed
                        progress.trained(step + 1, batch, stats, waited, time.perf_counter() - tick, controller)
                        stop_now(step + 1)
                    if stop.is_set():  # saved without a weight push: servers may be stopping too
                        trained_then_stop()
                    async with stopping_wins(stop, trained_then_stop):
                        stats |= await sync.stage(actor, step + 1)                # written while generation goes on
                        await evaluation
                        await (controller.pause() if cfg.rl.interruptible else controller.drain())
                        stats |= await sync.push(actor, client, step + 1)         # new weights to every server
                        controller.set_version(step + 1)
                        await controller.resume()
                    progress.trained(step + 1, batch, stats, waited, time.perf_counter() - tick, controller)
                    if evaluation_due(step + 1):
                        evaluation = asyncio.create_task(evaluate(step + 1))
                    if step + 1 == total:
                        await evaluation
                    if step + 1 == total or (cfg.saver.freq_steps and (step + 1) % cfg.saver.freq_steps == 0):
                        checkpoint(step + 1)  # an evaluation still running is done again after a resume
            finally:
                evaluation.cancel()
                watching.cancel()
                joining.cancel()
                await controller.stop()
                progress.rollout_counts(controller)  # the last counts, however the run ends
    actor.save(cfg.run_dir / "model", optimizer=False)  # for `areal-hpc eval --model`
    progress.plot()


STOP_GRACE_S = 2.0  # how long an error waits for the stop signal that may have caused it


@contextlib.asynccontextmanager
async def stopping_wins(stop: asyncio.Event, save_and_stop) -> AsyncIterator[None]:
    """Rollout-side work while a stop signal may arrive: Slurm signals every task of the job at once,
    so the servers may be gone before the trainer's handler has run. An error with a stop signal
    (already, or within ``STOP_GRACE_S``) is the stop's doing: ``save_and_stop()`` (the checkpoint of the
    last trained step, then ``StopRequested``) instead of failing the run without one."""
    try:
        yield
    except Exception:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STOP_GRACE_S)
        if not stop.is_set():
            raise
        save_and_stop()


async def until_stopped(work, stop: asyncio.Event):
    """``work``'s result, or None (and ``work`` cancelled) if ``stop`` is set first."""
    task, stopped = asyncio.ensure_future(work), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_hpc.train.driver", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, metavar="FILE")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    # Helper processes this one starts (multiprocessing's resource tracker, reward workers) start with
    # Slurm's stop warning ignored: it reaches every process of a step, and only this one acts on it.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    multiprocessing.resource_tracker.ensure_running()
    early = EarlyStopSignal()
    try:
        cfg = load_config(args.config, args.overrides)
        rank, mesh = start_trainer(cfg)
        try:
            return train(cfg, rank, mesh, args.resume, early)
        finally:
            close_distributed()  # after ``train`` returned: its engines are gone
    except UserError as exc:
        print(f"areal-hpc: error: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:  # the failure budget is spent, or every rollout server is gone
        print(f"areal-hpc: error: {exc}", file=sys.stderr)
        return 1


def train(cfg: RunConfig, rank: int, mesh, resume: bool, early: EarlyStopSignal) -> int:
    """This rank's part of the run: rank 0 drives it, the others follow. 0, or ``SAVED_AND_STOPPED``."""
    actor, engines = build_actor(cfg, mesh)
    checkpoint = latest_checkpoint(cfg.run_dir) if resume else None
    state = load_checkpoint(checkpoint, engines) if checkpoint else {"step": 0}
    if rank != 0:
        for signum in STOP_SIGNALS:  # rank 0 decides; the launcher stops this rank
            signal.signal(signum, signal.SIG_IGN)
        follow(actor, engines)
        return 0
    group = TrainerGroup(actor, engines, mesh, cfg)
    try:
        asyncio.run(drive(cfg, group, state, early))
    except StopRequested:
        group.stop()  # the other ranks exit too (they ignore the stop signals)
        return SAVED_AND_STOPPED
    finally:  # the loop's handlers are gone: a warning now must not kill a finished run
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    group.stop()  # only on success: after a failure the launcher stops the other ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
