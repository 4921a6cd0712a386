"""Asynchronous RL (AReaL) on trainer rank 0: rollouts never stop while the trainer trains.

    areal-hpc train --config configs/quickstart.yaml            # the launcher: servers + trainer ranks
    python -m areal_hpc.train.driver --config FILE [--resume]    # what the launcher runs per trainer rank

Each step: wait for a batch of finished groups no more than eta versions stale (generation and
rewards run all along, as many episodes as the staleness gate admits), consume them through the HDF5
shards, recompute the proximal logprobs and take the decoupled-PPO steps on every rank, then stage the
new weights, pause (interrupt) generation, push them to every server, and continue; with the disk sync
the push runs beside the next step's update. eta = 0 is synchronous RL.
Rollouts that keep failing (``rollout.failure_budget``), or every server gone, end the run with one
line naming the cause and the last error, exit code 1; a run that finished with failed episodes or
rewards says so in its last line and exits with ``rollout.failure_budget.exit_code_on_failures``. A stop
signal from Slurm saves a checkpoint and exits with ``SAVED_AND_STOPPED`` (``stopping``). What the loop
works with is ``rl_run.RLRun``.
Simplifications on purpose: single-turn RLVR workflow; evaluation runs through the rollout servers.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing.resource_tracker
import signal
import sys
import time

from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import close_distributed
from areal_hpc.resolve import Host, resolve
from areal_hpc.rollout.client import RolloutError
from areal_hpc.runtime.bootstrap import Placement
from areal_hpc.runtime.run_state import SAVED_AND_STOPPED
from areal_hpc.train.build import build_engines, start_trainer
from areal_hpc.train.rl_run import RLRun
from areal_hpc.train.stopping import STOP_SIGNALS, EarlyStopSignal, StopGuard, StopRequested
from areal_hpc.train.trainer import Trainer
from areal_hpc.train.trainer_process import TrainerProcess
from areal_hpc.train.trainer_ranks import TrainerRanks, follow


async def drive(cfg: RunConfig, trainer: Trainer, state: dict, early: EarlyStopSignal | None = None) -> int:
    """Trainer rank 0's loop from ``state["step"]``: gate -> generate -> reward -> commit -> update ->
    push -> evaluate and checkpoint. A stop signal saves the last trained step (``StopRequested``).
    The run's exit status (``RLRun.finish``)."""
    stop = StopGuard(early)
    async with RLRun.open(cfg, trainer, state, stop.event) as run:
        for step in range(run.version, cfg.rl.total_train_steps):
            started = time.perf_counter()
            # The staleness gate admits episodes all along; servers generate them, the reward pool scores them.
            # trained at version ``step``, which the servers may still be loading (the push runs beside this)
            episodes = await stop.unless_stopped(
                run.controller.prepare_batch(cfg.rollout.consumer_batch_size, step),
                on_stop=lambda: run.save_and_stop(step),  # noqa: B023 - called before this step ends
            )
            waited = time.perf_counter() - started
            batch = run.take_batch(episodes, step)  # consumed through the HDF5 shards, with agents' proxy records
            stats = await run.update(batch)  # proximal logprobs + decoupled-PPO steps, on the training thread

            def trained_then_stop() -> None:  # the step is trained; its weight push is not needed
                run.trained(step + 1, batch, stats, waited, started)  # noqa: B023 - called within this iteration
                run.save_and_stop(step + 1)  # noqa: B023 - called within this iteration

            stop.check(trained_then_stop)  # saved without a weight push: servers may be stopping too
            async with stop.excusing_errors(trained_then_stop):
                stats |= await run.push_weights(step + 1)  # stage; interrupt generation, new weights, continue
            run.trained(step + 1, batch, stats, waited, started)
            await run.evaluate_and_save(step + 1)
    return run.finish()


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
        cfg = resolve(load_config(args.config, args.overrides), Host.probe()).cfg  # settled on this node
        if Placement.detect().rank == 0 and cfg.rl.rank0_training == "child":
            with TrainerProcess.start(cfg, args.resume) as trainer:  # trainer rank 0 is its child
                return lead(cfg, trainer, trainer.state, early)
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
    """This rank's part of the run: rank 0 drives it, the others follow. Its exit status (``lead``'s)."""
    actor, engines, state = build_engines(cfg, mesh, resume)
    if rank != 0:
        for signum in STOP_SIGNALS:  # rank 0 decides; the launcher stops this rank
            signal.signal(signum, signal.SIG_IGN)
        follow(actor, engines, mesh)
        return 0
    return lead(cfg, TrainerRanks(actor, engines, mesh, cfg), state, early)


def lead(cfg: RunConfig, trainer: Trainer, state: dict, early: EarlyStopSignal) -> int:
    """Rank 0: drive the run through ``trainer`` (the training in this process, or in its child). Its exit
    status: ``drive``'s, or ``SAVED_AND_STOPPED``."""
    stopped, code = False, 0
    try:
        code = asyncio.run(drive(cfg, trainer, state, early))
    except StopRequested:
        stopped = True
    finally:  # the loop's handlers are gone: a warning now (one more from Slurm while the training
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # child ends, say) must not kill a finished run
    trainer.stop()  # the other ranks exit too; only without an error: after one the launcher stops them
    return SAVED_AND_STOPPED if stopped else code


if __name__ == "__main__":
    sys.exit(main())
