"""The local launcher behind ``areal-hpc train``: every process of an RL run on this machine.

    areal-hpc train --config configs/quickstart.yaml [--resume] [key=value ...]

1. the starting model: ``model.path``, or a fresh ``model.preset`` written into the run folder;
2. ``rollout.n_servers`` rollout servers (``areal-hpc serve``), loading while step 3 runs;
3. on a fresh run with ``rl.sft_warmup_steps``: SFT warm-up (``areal-hpc sft``) into ``<run>/sft_warmup``;
4. ``rl.trainer_processes`` trainer ranks (torch.distributed, rank 0 drives and prints progress).
It stops them all when the run ends, fails, or is interrupted; children die with it even on SIGKILL.
CPU cores are split evenly between servers and trainer ranks, so neither starves the other.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from areal_hpc.launch.name_resolve import ROLLOUT_SERVERS, NameResolve, bind
from areal_hpc.launch.supervisor import ServerProcess

RUN_MARKER = "AREAL_HPC_RUN"  # in every child's environment: which run a process belongs to
# `-c`, not `-m areal_hpc.train.async_rl`: reward workers (spawned) would re-import a `-m` main module and its torch.
TRAINER = "import sys; from areal_hpc.train.async_rl import main; sys.exit(main(sys.argv[1:]))"


def check_run_folder(cfg: RunConfig, resume: bool) -> None:
    """A fresh run never mixes with an old one's shards and checkpoints; a resume needs a checkpoint."""
    from areal_hpc.train.checkpoint import latest_checkpoint

    has_checkpoint = latest_checkpoint(cfg.run_dir) is not None
    if resume and not has_checkpoint:
        raise UserError(f"--resume: no checkpoint in {cfg.run_dir / 'checkpoints'} (run without --resume to start)")
    if not resume and (has_checkpoint or any((cfg.run_dir / "shards").glob("*.h5"))):
        raise UserError(f"{cfg.run_dir} already holds a run; pass --resume to continue it, or choose another "
                        f"experiment.trial=NAME")


def launch(config: str, overrides: list[str], resume: bool) -> int:
    cfg = load_config(config, overrides)
    check_run_folder(cfg, resume)
    run_dir, python = cfg.run_dir, sys.executable
    shutil.rmtree(run_dir / "name_resolve" / ROLLOUT_SERVERS, ignore_errors=True)  # addresses of a killed run
    procs = cfg.rollout.n_servers + cfg.rl.trainer_processes
    env = {RUN_MARKER: str(run_dir.resolve()), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs)),
           "HF_HUB_OFFLINE": "1"}
    cli = [python, "-m", "areal_hpc"]
    started: list[ServerProcess] = []

    def start(name: str, command: list[str], log: Path | None, extra_env: dict | None = None) -> ServerProcess:
        started.append(ServerProcess(name, command, log, {**env, **(extra_env or {})}).start())
        return started[-1]

    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the children
    try:
        model = Path(cfg.model.path) if cfg.model.path else run_dir / "init_model"
        if not cfg.model.path and not (model / "config.json").exists():
            _run_stage([*cli, "init-model", "--out", str(model), "--preset", cfg.model.preset,
                        "--seed", str(cfg.experiment.seed)], env)
        base = [f"--config={config}", *overrides]
        for i in range(cfg.rollout.n_servers):
            start(f"rollout server {i}", [*cli, "serve", *base, f"model.path={model}", "port=0"],
                  run_dir / "logs" / f"rollout-server-{i}.log")
        warm = run_dir / "sft_warmup" / "model"
        if cfg.rl.sft_warmup_steps and not resume:
            _run_stage([*cli, "sft", *base, f"model.path={model}", f"sft.total_train_steps={cfg.rl.sft_warmup_steps}",
                        f"experiment.trial={cfg.experiment.trial}/sft_warmup"], env)
        start_model = warm if cfg.rl.sft_warmup_steps and warm.exists() else model
        with bind("127.0.0.1", 0) as sock:
            master_port = str(sock.getsockname()[1])
        trainer_args = [*base, f"model.path={start_model}", *(["--resume"] if resume else [])]
        for rank in range(cfg.rl.trainer_processes):
            start(f"trainer rank {rank}", [python, "-c", TRAINER, *trainer_args],
                  None if rank == 0 else run_dir / "logs" / f"trainer-rank-{rank}.log",
                  {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.rl.trainer_processes),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port})
        return _supervise(started, driver=started[-cfg.rl.trainer_processes])
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=10)
        signal.signal(signal.SIGTERM, previous)


def _run_stage(command: list[str], env: dict) -> None:
    """A preparation step (model init, SFT warm-up) in the foreground; its failure ends the launch."""
    code = subprocess.run(command, env={**os.environ, **env}).returncode
    if code:
        raise UserError(f"`{' '.join(command[1:4])} ...` failed with exit code {code} (its output is above)")


def _supervise(procs: list[ServerProcess], driver: ServerProcess) -> int:
    """Wait for the driving trainer rank; any other process exiting first is a failure."""
    while True:
        code = driver.process.poll()
        if code is not None:
            if code:
                print(f"areal-hpc: error: {driver.name} exited with code {code}", file=sys.stderr)
            return code
        for proc in procs:
            if proc is not driver and proc.process.poll() is not None:
                raise proc.failure(f"exited with code {proc.process.returncode} during the run")
        time.sleep(0.2)
