"""A trainer rank for the parallel-layout tests: one PPO update on a seeded synthetic batch.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.trainer_processes MODEL OUT [KEY=VALUE ...]

(``run_ranks`` starts them on loopback; under Slurm, ``srun`` does and the ranks meet through a
name-resolve folder.)

Every rank builds the same engines on the mesh of ``actor.parallel`` (and ``actor.engine``); rank 0
forms the batch, scatters the shares, gathers the updated weights (actor, and critic for PPO) under
their Hugging Face names through the collective ``rollout_weights``, and writes them and the step's
statistics to OUT (a torch file).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from areal_hpc.config import RunConfig, load_config
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.launch.roles import FORK_SERVER_PRELOAD
from areal_hpc.parallel.mesh import close_distributed
from areal_hpc.resolve import Host, resolve
from areal_hpc.runtime.bootstrap import Placement
from areal_hpc.runtime.exit import exit_process
from areal_hpc.runtime.forkserver import PR_SET_CHILD_SUBREAPER, Forker, _prctl
from areal_hpc.runtime.name_resolve import free_port
from areal_hpc.train.build import build_actor, start_trainer
from areal_hpc.train.trainer_ranks import TrainerRanks, follow

REPO = Path(__file__).resolve().parent.parent


def synthetic_batch(vocab: int, groups: int = 4, group_size: int = 4, seed: int = 0) -> list[Trajectory]:
    """GRPO groups of varied lengths, rewards and behaviour logprobs (a little off-policy)."""
    rng = np.random.default_rng(seed)
    batch = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, int(rng.integers(4, 12)))
        for _k in range(group_size):
            n = int(rng.integers(2, 9))
            segment = Segment(prompt, rng.integers(3, vocab, n), -rng.uniform(0.5, 3.0, n), np.zeros(n, dtype=int))
            batch.append(Trajectory([segment], group_id=f"g{g}", rewards=[Reward(float(rng.integers(0, 2)))]))
    return batch


def settled(overrides: list[str]) -> RunConfig:
    """The run's config resolved on this node for the ranks started (WORLD_SIZE, or srun's tasks), as the
    launchers pass ``rl.trainer_processes`` to every rank."""
    world = f"rl.trainer_processes={Placement.detect().world}"
    return resolve(load_config(None, [world, *overrides]), Host.probe()).cfg


def main(model: str, out: str, overrides: list[str]) -> None:
    cfg = settled([f"model.path={model}", "rl.total_train_steps=1", *overrides])
    rank, mesh = start_trainer(cfg)
    actor, engines = build_actor(cfg, mesh)
    if rank == 0:
        group = TrainerRanks(actor, engines, mesh, cfg)
        stats = group.update(synthetic_batch(len(actor.actor.tokenizer)))
        weights = {
            name: {k: v.clone() for bucket in engine.rollout_weights(1 << 20) for k, v in bucket}
            for name, engine in group.engines.items()
        }
        group.stop()
        torch.save({"weights": weights, "stats": stats}, out)
    else:
        follow(actor, engines, mesh)


# What the rank scripts import (the launcher's roles' modules, the trainer's build, and Megatron's engine for
# its rank scripts), imported once by one fork server for the session's ranks (as the launcher's, on CPU): a
# rank starts as a fork of it in ~0.1 s instead of 4-7.5 s of imports.
RANK_PRELOAD = (*FORK_SERVER_PRELOAD, "areal_hpc.train.build", "areal_hpc.engines.megatron.engine")
_rank_forks: list[Forker] = []


@contextlib.contextmanager
def adopting_ranks():
    """The fork server's children come to this process as they start (it is a subreaper, as the
    launcher is), and only then: other tests' orphans still go to init, never to stay zombies here."""
    if not _rank_forks:
        with contextlib.chdir(REPO):  # the ranks' ``python -m tests...`` are found from here
            _rank_forks.append(Forker({}, preload=RANK_PRELOAD).start())
        atexit.register(_rank_forks[0].close)
    else:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield _rank_forks[0]
    finally:
        _prctl(PR_SET_CHILD_SUBREAPER, 0)


def failure(log: Path) -> str:
    """A failed rank's traceback (the extension modules' exit noise after it left out), or its log's end."""
    text = log.read_text()
    start = text.find("Traceback")
    return text[start : start + 3000] if start >= 0 else text[-3000:]


def run_ranks(
    world: int, model, out, *overrides: str, timeout: float = 300, module: str = "tests.trainer_processes"
) -> dict:
    """Start ``world`` ranks of a rank script (this one by default) on loopback; what rank 0 wrote.
    Each rank's output goes to ``OUT.rank<r>.log``; a rank that fails, or ranks still running after
    ``timeout`` seconds, show their logs' ends."""
    port = str(free_port("127.0.0.1"))
    logs = [Path(f"{out}.rank{r}.log") for r in range(world)]
    command = [sys.executable, "-m", module, str(model), str(out), *overrides]
    envs = [
        {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        for r in range(world)
    ]
    with adopting_ranks() as forks:
        ranks = [forks.spawn(f"rank{r}", command, envs[r], None, logs[r]) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        try:
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in ranks]
        except subprocess.TimeoutExpired:
            running = [r for r, p in enumerate(ranks) if p.poll() is None]
            raise AssertionError(
                f"ranks {running} still running after {timeout:g} s:\n"
                + "\n".join(
                    f"rank {r} ({'running' if r in running else f'exited {ranks[r].poll()}'}):\n{failure(logs[r])}"
                    for r in range(world)
                )
            ) from None
        assert codes == [0] * world, "\n".join(
            f"rank {r} exited {code}:\n{failure(logs[r])}" for r, code in enumerate(codes) if code != 0
        )
    finally:
        for p in ranks:
            p.send_signal(signal.SIGKILL)
    return torch.load(out, weights_only=False)


def end_rank() -> NoReturn:
    """After a rank script's ``main`` (its engines gone with its frame): leave the process group and
    end the process at once (``areal_hpc.runtime.exit``: ~1 s less per rank than the interpreter's exit)."""
    close_distributed()
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    end_rank()
