"""Trainer rank 0's training in a child process (``rl.rank0_training=child``, ``train/trainer_process.py``):
it trains exactly as rank 0's own process does, its errors reach the parent (a user's mistake as one
line, exit code 2 on the command line), and it never outlives its parent nor goes unnoticed when it dies.
Each case runs in a process of its own (the fork of a child, as ``areal-hpc train`` makes it)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.config import load_config
from areal_hpc.resolve import Host, resolve
from tests.trainer_processes import run_ranks

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import torch
from areal_hpc.config import load_config
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.trainer import Trainer
from areal_hpc.train.trainer_process import TrainerProcess
from tests.trainer_processes import synthetic_batch

model, out, case = sys.argv[1:4]
cfg = load_config(None, [f"model.path={model}", "rl.total_train_steps=1", f"cluster.fileroot={out}"])
cfg = resolve(cfg, Host.probe()).cfg
with TrainerProcess.start(cfg, False) as trainer:
    batch = synthetic_batch(len(trainer.engines["actor"].tokenizer))
    child = trainer._process.pid
    if case == "train":
        assert isinstance(trainer, Trainer)
        stats = trainer.update(batch)
        trainer.engines["actor"].save(Path(out) / "model", optimizer=False)
        torch.save(stats, Path(out) / "stats.pt")
        trainer.stop()
        print("child alive after stop:", trainer._process.is_alive())
    elif case == "killed":
        os.kill(child, signal.SIGKILL)
        try:
            trainer.update(batch)
        except Exception as exc:
            print(type(exc).__name__, exc)
    elif case == "closed":  # a run that fails ends the block without stop(): the end of the pipe ends the child
        pass
    elif case == "orphaned":
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
print("child exit code:", trainer._process.exitcode)
"""


def run_case(model: Path, out: Path, case: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(out), case],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_child_trains_bit_for_bit_as_rank_0s_own_process(tiny_model_dir, tmp_path):
    reference = run_ranks(1, tiny_model_dir, tmp_path / "in_process.pt")  # TrainerRanks.update in the rank itself
    done = run_case(tiny_model_dir, tmp_path / "child", "train")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child alive after stop: False" in done.stdout
    saved = load_file(tmp_path / "child" / "model" / "model.safetensors")
    expected = reference["weights"]["actor"]
    assert set(saved) <= set(expected) and len(saved) >= len(expected) - 1  # a tied head is saved once
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    stats = torch.load(tmp_path / "child" / "stats.pt", weights_only=False)
    kept = {k for k in reference["stats"] if not k.startswith("time/") and not k.endswith("_seconds")}
    assert {k: stats[k] for k in kept} == {k: reference["stats"][k] for k in kept}


def test_a_child_that_dies_fails_the_next_call_with_its_exit_code(tiny_model_dir, tmp_path):
    done = run_case(tiny_model_dir, tmp_path, "killed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TrainerProcessError trainer rank 0's training process ended unasked (exit code -9)" in done.stdout


def test_a_parent_that_closes_without_stop_sees_the_child_end_by_itself(tiny_model_dir, tmp_path):
    """Not killed after the parent's join timeout (-9): the end of the pipe reached it."""
    done = run_case(tiny_model_dir, tmp_path, "closed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child exit code: 0" in done.stdout


def test_the_child_ends_with_its_parent(tiny_model_dir, tmp_path):
    done = run_case(tiny_model_dir, tmp_path, "orphaned")
    assert done.returncode == -signal.SIGKILL
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 60  # it notices at once; the bound is for a loaded machine
    while alive(child):
        assert time.monotonic() < deadline, f"the child outlived its parent by 60 s: {_stat(child)}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stat(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().strip()
    except OSError:
        return "gone"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.path="], "the trainer needs model.path=DIR"),  # raised by the child, while it builds the engines
        (
            ["rl.rank0_training=child", "rl.weight_sync=distributed"],
            "rl.rank0_training=child needs rl.weight_sync=disk",
        ),
    ],
)
def test_a_users_mistake_is_one_line_and_exit_code_2(tmp_path, overrides, message):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_hpc.train.driver",
            "--config",
            "configs/quickstart.yaml",
            f"cluster.fileroot={tmp_path}",
            *overrides,
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal-hpc: error: ") and message in lines[0], done.stderr


@pytest.mark.parametrize(
    "choice, sync, device, in_child",
    [
        ("auto", "disk", "cpu", True),
        ("auto", "disk", "cuda", False),  # the update waits on the device, not on the interpreter lock
        ("auto", "distributed", "cpu", False),  # the broadcast reads the training process's own tensors
        ("thread", "disk", "cpu", False),
        ("child", "disk", "cuda", True),  # asked for: honoured
    ],
)
def test_auto_trains_in_a_child_exactly_on_a_cpu_with_the_disk_sync(choice, sync, device, in_child):
    cfg = load_config(str(REPO / "configs/quickstart.yaml"), [f"rl.rank0_training={choice}", f"rl.weight_sync={sync}"])
    resolved = resolve(cfg, Host(device)).cfg  # the node's accelerator, as a trainer on it sees it
    assert (resolved.rl.rank0_training == "child") is in_child  # decided without touching one: it holds anywhere
