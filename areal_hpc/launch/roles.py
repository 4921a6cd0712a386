"""The processes of an RL run and how each one starts: the same entry points whether the local launcher
starts them all on this machine (``local.py``) or each is one task of a Slurm job (``slurm_task.py``).

- preparation, on trainer rank 0 before it trains: the starting model (``model.path``, or a fresh
  ``model.preset`` written into the run folder) and, on a fresh run, the SFT warm-up;
- a rollout server (``areal-hpc serve``), which starts from the initial model and receives the
  trainer's weights on the first push;
- a trainer rank (``areal_hpc.train.driver``): rank 0 drives the asynchronous loop, the others follow.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from areal_hpc.config import RunConfig
from areal_hpc.errors import UserError
from areal_hpc.runtime.forkserver import Forker
from areal_hpc.runtime.supervisor import SupervisedProcess

# `-c`, not `-m areal_hpc.train.driver`: reward workers (spawned) would re-import a `-m` main module and its torch.
TRAINER = (
    "import sys; from areal_hpc.train.driver import main; from areal_hpc.runtime.exit import exit_process; "
    "exit_process(main(sys.argv[1:]))"
)
MODEL_TIMEOUT_S = 3600.0  # how long a rollout server waits for trainer rank 0 to write the initial model
# What these roles import, imported once by the local launcher's fork server on a CPU machine (each role then
# starts as a fork of it, ``runtime.forkserver``): torch, the model family, the rollout server, the trainer, SFT.
FORK_SERVER_PRELOAD = (
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "areal_hpc.rollout.server",
    "areal_hpc.train.driver",
    "areal_hpc.train.sft",
)


def areal_cli() -> list[str]:
    return [sys.executable, "-m", "areal_hpc"]


def config_args(config: str, overrides: list[str]) -> list[str]:
    return [f"--config={config}", *overrides]


def incarnation_folder(run_dir: Path, incarnation: str) -> Path:
    """Name-resolve folder of one launch of a run: trainer rank 0's rendezvous address
    (``trainer/``) and, under Slurm, the mark that the run has finished."""
    return run_dir / "name_resolve" / "job" / incarnation


def forget_other_incarnations(run_dir: Path, incarnation: str) -> None:
    """Remove what earlier launches (a killed run, a requeued job) left in name-resolve and the
    weight folders they pushed; the new launch pushes its own weights first."""
    for folder in (run_dir / "name_resolve" / "job").glob("*"):
        if folder.name != incarnation:
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(run_dir / "weights", ignore_errors=True)


def initial_model(cfg: RunConfig) -> Path:
    """The weights rollout servers load at start: ``model.path``, or the run's fresh ``init_model``."""
    return Path(cfg.model.path) if cfg.model.path else cfg.run_dir / "init_model"


def prepare_start_model(cfg: RunConfig, args: list[str], env: dict, fork_server: Forker | None = None) -> Path:
    """Write the initial model if the run has none, then (fresh runs with ``rl.sft_warmup_steps``) run
    the SFT warm-up (again from its start, when an earlier launch was stopped before it saved its model);
    returns the model the trainer starts from. With ``fork_server`` both stages are forks of it, and it is
    closed while the warm-up runs and started again after it (``run_stage``'s ``release``)."""
    model = initial_model(cfg)
    if not cfg.model.path and not (model / "config.json").exists():
        run_stage(
            "model initialisation",
            [
                *areal_cli(),
                "init-model",
                "--out",
                str(model),
                "--preset",
                cfg.model.preset,
                "--seed",
                str(cfg.experiment.seed),
            ],
            env,
            fork_server,
        )
    warm = start_model_path(cfg)
    if warm != model and not warm.exists():
        shutil.rmtree(warm.parent, ignore_errors=True)  # this run's unfinished warm-up (the launch resumes the run)
        run_stage(
            "SFT warm-up",
            [
                *areal_cli(),
                "sft",
                *args,
                f"model.path={model}",
                f"sft.total_train_steps={cfg.rl.sft_warmup_steps}",
                f"experiment.trial={cfg.experiment.trial}/sft_warmup",
                *([f"dataset.path={cfg.rl.sft_warmup_path}"] if cfg.rl.sft_warmup_path else []),
            ],
            env,
            fork_server,
            release=True,
        )
    return warm


def start_model_path(cfg: RunConfig) -> Path:
    """The model the trainer ranks start from: the SFT warm-up's output, or the initial model."""
    return cfg.run_dir / "sft_warmup" / "model" if cfg.rl.sft_warmup_steps else initial_model(cfg)


def wait_for_model(model: Path, timeout_s: float = MODEL_TIMEOUT_S) -> Path:
    """Tasks started beside trainer rank 0 (rollout servers, other trainer ranks) wait until the model
    it prepares is on the shared filesystem (model folders appear whole: written aside, renamed)."""
    deadline = time.monotonic() + timeout_s
    while not (model / "config.json").exists():
        if time.monotonic() > deadline:
            raise UserError(f"no model at {model} after {timeout_s:g} s (trainer rank 0 prepares it; see its log)")
        time.sleep(1.0)
    return model


def server_command(args: list[str], model: Path) -> list[str]:
    return [*areal_cli(), "serve", *args, f"model.path={model}", "port=0"]


def trainer_command(args: list[str], start_model: Path, resume: bool) -> list[str]:
    return [sys.executable, "-c", TRAINER, *args, f"model.path={start_model}", *(["--resume"] if resume else [])]


def run_stage(
    name: str, command: list[str], env: dict, fork_server: Forker | None = None, release: bool = False
) -> None:
    """A preparation step (model init, SFT warm-up) with its output on this terminal; it dies with the
    launcher, and its failure ends the launch. ``release``: once the stage is forked, ``fork_server`` is
    closed until the stage ends, then started again. Beside a forked warm-up, the idle fork server held
    the pages its child had written or never touched: the calculator's warm-up peaked at 962 MiB PSS with
    it, 819 without, for one more start of it (its imports, ~5 s) after the stage
    (bench/results/run_memory-calculator-2026-12-06.md)."""
    stage = SupervisedProcess(name, command, None, env, fork_server=fork_server).start()
    if release and fork_server is not None:
        fork_server.close()
    try:
        code = stage.process.wait()
    finally:
        stage.stop(grace_s=10)
    if code:
        raise UserError(f"{name} failed with exit code {code} (its output is above)")
    if release and fork_server is not None:
        fork_server.start()
