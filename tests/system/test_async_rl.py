"""`areal-hpc train` end to end: real rollout servers, real trainer ranks on gloo, real shards.

A short asynchronous run (two trainer ranks, distributed weight sync) whose weight updates interrupt
generation, PPO with a critic and a KL penalty, a run killed with SIGKILL and resumed (no trajectory
trained twice, none lost, no process left behind), the one-line errors of a run folder that is
already taken or has nothing to resume, a run whose rollouts all fail (prompts longer than the
context): it stops with one line and exit code 1, its failures counted in the metrics meanwhile, and one
whose reward and workflow fail only sometimes: it shows the first failure of each kind with the user's
file and line, counts every kind, says so in its last line and exits 3; run again, it is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.config import load_config
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.data.shards.writer import TrajectoryShardWriter
from areal_hpc.data.trajectory import Segment, Trajectory
from areal_hpc.engines.optim import lr_multiplier
from areal_hpc.fsio import read_json_lines
from areal_hpc.rollout.controller import FAILURE_KINDS
from areal_hpc.runtime.bootstrap import RUN_MARKER
from tests.conftest import REPO, run_cli
from tests.flaky_user_code import line_of, write_flaky_code
from tests.run_audit import assert_each_trajectory_trained_once, read_audit, untrained_at

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SMALL_RUN = [
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "rl.sft_warmup_steps=0",
    "rollout.consumer_batch_size=4",
    "rollout.max_concurrent_rollouts=8",
    "generation.n_samples=4",
    "generation.max_new_tokens=6",
    "rollout.max_running_requests=32",
    "stats.tensorboard=false",
]


def train_args(model: Path, fileroot: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={model}",
        f"cluster.fileroot={fileroot}",
        *SMALL_RUN,
        *extra,
    ]


def run_dir(fileroot: Path) -> Path:
    return fileroot / "quickstart" / "trial0"


def metrics(run: Path) -> list[dict]:
    """The records written so far (a line still being written is skipped)."""
    return read_json_lines(run / "metrics.jsonl")


def wait_for_no_processes(run: Path, seconds: float = 60) -> list[int]:
    deadline = time.monotonic() + seconds
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_of(run)


def processes_of(run: Path) -> list[int]:
    """Live processes whose environment says they belong to this run (servers, trainers, reward workers)."""
    marker = f"{RUN_MARKER}={run.resolve()}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and marker in (proc / "environ").read_bytes().split(b"\0")
                and (proc / "stat").read_text().split(") ")[1][0] != "Z"
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.smoke
def test_the_quickstart_trains_five_steps(tiny_model_dir, tmp_path):
    """The quickstart's own settings, shrunk: five asynchronous steps, each with its reward and staleness."""
    result = run_cli(*train_args(tiny_model_dir, tmp_path, "rl.total_train_steps=5", "rl.eval_every_steps=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in metrics(run_dir(tmp_path)) if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(0 <= r["rollout/reward"] <= 1 and r["staleness/max"] <= 2 for r in steps)
    assert (run_dir(tmp_path) / "checkpoints" / "latest").read_text().strip() == "step000005"


def test_async_run_with_two_trainer_ranks_and_distributed_weight_sync(tiny_model_dir, tmp_path):
    """One KV slot on the server makes generation the slow side (eta * B groups decode one sequence
    at a time while a step trains), so weight updates find requests in flight and interrupt them:
    a synchronous run, which also keeps staleness <= eta, would show no interruption."""
    result = run_cli(
        *train_args(
            tiny_model_dir,
            tmp_path,
            "rl.total_train_steps=3",
            "rl.eval_every_steps=3",
            "rl.trainer_processes=2",
            "rl.weight_sync=distributed",
            "rollout.max_head_offpolicyness=2",
            "rollout.max_running_requests=1",
            "generation.max_new_tokens=32",
        ),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_dir(tmp_path)
    steps = [r for r in metrics(run) if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] <= 2 and r["rollout/failures_total"] == 0 for r in steps)
    pushes = [r for r in metrics(run) if "sync/bytes" in r]  # each push's own record, when it ended
    assert [r["step"] for r in pushes] == [1, 2, 3] and all(r["sync/bytes"] > 0 for r in pushes)
    assert sum(r["rollout/interruptions"] for r in steps) > 0
    with TrajectoryStore(run / "shards") as store:  # a request cut by an update finished on the new weights
        assert any(t.version_range[0] < t.version_range[1] for t in store.trajectories())
    assert [r["step"] for r in metrics(run) if "eval/accuracy" in r] == [0, 3]
    # every trained trajectory came from the shards, and none twice
    trained = [
        i
        for line in (run / "logs" / "batches.jsonl").read_text().splitlines()
        for i in json.loads(line).get("trained", [])
    ]
    assert len(trained) == len(set(trained)) == 3 * 4 * 4
    with TrajectoryStore(run / "shards") as store:
        assert set(trained) <= store.ids()
    assert run_cli("shards", "verify", str(run / "shards")).returncode == 0
    assert (run / "rl_curves.png").stat().st_size > 0 and (run / "model" / "config.json").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step000003"
    assert wait_for_no_processes(run) == []


@pytest.mark.parametrize("eta", [0, 1])
def test_disk_pushes_beside_the_next_update_keep_every_trained_token_within_eta(tiny_model_dir, tmp_path, eta):
    """With the disk sync a step's weight push runs beside the next step's update. Read from the shards
    (not the run's own staleness metric): every token step s trained was generated by version s - 1 - eta
    or later (eta = 0: exactly s - 1, nothing dropped); evaluations still come every 2 steps."""
    result = run_cli(
        *train_args(
            tiny_model_dir,
            tmp_path,
            "rl.eval_every_steps=2",
            f"rollout.max_head_offpolicyness={eta}",
            "rollout.max_running_requests=1",
            "generation.max_new_tokens=32",
            "rl.total_train_steps=8",
        ),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_dir(tmp_path)
    audit = read_audit(run)
    assert sorted(audit.effective) == list(range(1, 9))
    with TrajectoryStore(run / "shards") as store:
        trained = {t.id: t for t in store.trajectories() if t.id in set(audit.trained)}
    for step, ids in audit.effective.items():
        oldest = [trained[i].version_range[0] for i in ids]
        assert min(oldest) >= step - 1 - eta, (step, oldest)
        if eta == 0:
            assert {v for i in ids for v in trained[i].version_range} == {step - 1}
    if eta == 0:
        assert not audit.dropped
    steps = [r for r in metrics(run) if "rollout/reward" in r]
    assert all("time/stage" in r for r in steps)
    assert [r["step"] for r in metrics(run) if "time/push" in r] == list(range(1, 9))  # each push, when it ended
    evaluations = [r for r in metrics(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 2, 4, 6, 8] and all(r["eval/seconds"] > 0 for r in evaluations)


def test_ppo_with_a_critic_and_a_kl_penalty_trains_both_models(tiny_model_dir, tmp_path):
    result = run_cli(
        *train_args(
            tiny_model_dir,
            tmp_path,
            "rl.total_train_steps=2",
            "rl.eval_every_steps=0",
            "actor.adv_estimator=ppo",
            "actor.kl_coef=0.1",
            "actor.ppo_n_minibatches=2",
            "actor.eps_clip_high=0.28",
        ),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_dir(tmp_path)
    last = [r for r in metrics(run) if "rollout/reward" in r][-1]
    assert last["critic/loss"] > 0 and last["actor/ref_kl_sum"] > 0 and last["actor/grad_norm"] > 0
    assert (run / "checkpoints" / "step000002" / "critic" / "training_state.pt").exists()


def test_a_run_killed_with_sigkill_resumes_and_trains_each_trajectory_once(tiny_model_dir, tmp_path):
    total = 10  # the kill at step 3 leaves 7 steps to go: a slow poll cannot let the run finish first
    args = train_args(
        tiny_model_dir,
        tmp_path,
        f"rl.total_train_steps={total}",
        "rl.eval_every_steps=0",
        "saver.freq_steps=2",
        "rollout.max_head_offpolicyness=2",
        "optimizer.lr_scheduler_type=linear",
    )
    run = run_dir(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and any(r["step"] >= 3 for r in metrics(run))):
        assert launcher.poll() is None and time.monotonic() < deadline, "run ended or stalled before step 3"
        time.sleep(0.1)
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher only: its children must die with it
    launcher.wait()
    assert wait_for_no_processes(run) == [], "processes of the killed run are still alive"
    killed_at = max(r["step"] for r in metrics(run))
    checkpoint = int((run / "checkpoints" / "latest").read_text().strip()[len("step") :])
    assert 2 <= checkpoint <= killed_at and checkpoint % 2 == 0
    untrained = untrained_at(run, checkpoint)

    result = run_cli(*args, "--resume", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in metrics(run) if "rollout/reward" in r]
    assert [r["step"] for r in records] == list(range(1, total + 1))  # lost steps were replaced, not duplicated
    cfg = load_config(
        str(REPO / "configs/quickstart.yaml"),
        SMALL_RUN + [f"rl.total_train_steps={total}", "optimizer.lr_scheduler_type=linear"],
    )
    for r in records:  # the schedule continued from the checkpoint (optimizer and scheduler state restored)
        assert r["actor/lr"] == pytest.approx(cfg.actor.lr * lr_multiplier(r["step"] - 1, total, cfg.optimizer))

    audit = assert_each_trajectory_trained_once(run, total)
    assert untrained, "the kill left nothing to recover: the test did not exercise recovery"
    assert untrained <= set(audit.trained) | audit.dropped | untrained_at(run, total)  # none lost
    assert untrained & audit.trained_after_resume  # the recovered ones were trained after the resume
    assert wait_for_no_processes(run) == []


@pytest.mark.parametrize(
    "stop, everyone",
    [(signal.SIGUSR2, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["SIGUSR2", "SIGTERM", "SIGTERM to every process"],
)
def test_a_stop_signal_saves_at_once_and_resume_auto_continues_exactly(tiny_model_dir, tmp_path, stop, everyone):
    """Slurm's stop warning (SIGUSR2) or a SIGTERM (scancel, requeue, Ctrl-C's cousin) on a local run,
    to the launcher or, as Slurm does, to every process at once (the rollout servers die while the
    trainer may be pushing weights to them): the trainer saves the step it is at (no periodic
    checkpoint would), the launcher exits 75 with how to continue, and --resume=auto loses nothing."""
    args = train_args(
        tiny_model_dir, tmp_path, "rl.total_train_steps=40", "rl.eval_every_steps=0", "saver.freq_steps=1000"
    )
    run = run_dir(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and any(r["step"] >= 3 for r in metrics(run))):
        assert launcher.poll() is None and time.monotonic() < deadline, "run ended or stalled before step 3"
        time.sleep(0.1)
    (os.killpg if everyone else os.kill)(launcher.pid, stop)
    stderr = launcher.communicate(timeout=60)[1]
    assert launcher.returncode == 75, stderr[-3000:]
    assert "--resume" in stderr.splitlines()[-1]
    saved = int((run / "checkpoints" / "latest").read_text().strip()[len("step") :])
    assert 3 <= saved < 40 and saved == max(read_audit(run).effective)  # the step it was at, not an older one
    assert wait_for_no_processes(run) == []
    with TrajectoryShardWriter(run / "shards", "proxy") as other:  # another writer's records beside the run's
        for i in range(4):
            other.append(
                Trajectory(
                    [Segment(np.arange(5), np.arange(3), np.zeros(3), np.zeros(3, np.int32))],
                    group_id=f"agent-{i}",
                    tenant="team-a",
                )
            )

    result = run_cli(*args, "--resume=auto", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    audit = read_audit(run)
    assert audit.resumed_from == [saved]
    with TrajectoryStore(run / "shards") as store:
        foreign = {t.id for t in store.trajectories(TrajectoryFilter(tenant="team-a"))}
    assert len(foreign) == 4 and not foreign & (set(audit.trained) | audit.dropped)  # recovery left them alone
    assert_each_trajectory_trained_once(run, 40)


def test_a_taken_run_folder_and_a_missing_checkpoint_are_one_line_errors(tiny_model_dir, tmp_path):
    resume = run_cli(*train_args(tiny_model_dir, tmp_path), "--resume")
    assert resume.returncode == 2 and resume.stderr.count("\n") == 1 and "nothing to resume" in resume.stderr
    (run_dir(tmp_path) / "checkpoints").mkdir(parents=True)
    (run_dir(tmp_path) / "checkpoints" / "step000001").mkdir()
    (run_dir(tmp_path) / "checkpoints" / "step000001" / "driver.json").write_text("{}")
    (run_dir(tmp_path) / "checkpoints" / "latest").write_text("step000001\n")
    again = run_cli(*train_args(tiny_model_dir, tmp_path))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--resume" in again.stderr


def test_a_run_whose_rollouts_all_fail_stops_with_one_line_and_its_failures_in_the_metrics(tiny_model_dir, tmp_path):
    """Training prompts longer than the servers' context: every /generate is refused (400). The run
    used to wait forever behind a frozen progress line; now the failure budget stops it, and the
    metrics and TensorBoard said why all along (no step ever trained)."""
    long_question = "Tom has {i} apples and " + "gives one to a friend, then " * 12 + "how many are left?"
    (tmp_path / "long.jsonl").write_text(
        "".join(json.dumps({"question": long_question.format(i=i), "answer": f"#### {i}"}) + "\n" for i in range(40))
    )
    (tmp_path / "short.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(4))
    )
    result = run_cli(
        *train_args(
            tiny_model_dir,
            tmp_path,
            "dataset.task=gsm8k",
            f"dataset.path={tmp_path}/long.jsonl",
            f"dataset.eval_path={tmp_path}/short.jsonl",
            "rollout.context_length=64",
            "dataset.max_prompt_tokens=4096",  # kept by the trainer, refused by the servers
            "stats.tensorboard=true",
        ),
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("areal-hpc: error: rollouts keep failing: 32 episodes in a row failed (rejected ")
    assert "/generate answered 400: too many tokens" in last and "> context length 64" in last
    run = run_dir(tmp_path)
    records = metrics(run)
    assert not [r for r in records if "rollout/reward" in r]
    assert max(r.get("rollout/failures/rejected", 0) for r in records) >= 32
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert max(e.value for e in events.Scalars("rollout/failures/rejected")) >= 32
    assert wait_for_no_processes(run) == []


def test_a_run_whose_reward_and_workflow_fail_sometimes_says_where_and_exits_3_and_is_not_replaced(
    tiny_model_dir, tmp_path
):
    """The reward raises on every 4th call and returns NaN on every 4th; the workflow gives up on every 5th
    episode. The run trains its steps, and the first failure of each kind is printed once with the user's file
    and line, and written to logs/failures.log (an evaluation's line says what failed in it); the metrics count
    every kind; the last line says how many; the exit status is 3. The same command again is refused in one
    line and changes nothing."""
    reward, workflow = write_flaky_code(tmp_path)
    args = train_args(
        tiny_model_dir,
        tmp_path,
        "rl.total_train_steps=2",
        "rl.eval_every_steps=0",
        f"reward.fn={reward}:flaky",
        f"rollout.workflow={workflow}:SometimesGivesUp",
    )
    result = run_cli(*args, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    firsts = [line for line in result.stdout.splitlines() if line.startswith("first ")]
    where = {
        "reward_exception": (
            "reward raised ValueError: cannot score call ",
            f"({reward}:{line_of(reward, 'raise')}); ",
        ),
        "reward_invalid": (f"reward {reward}:flaky (defined at {reward}:4) returned nan", ""),
        "workflow": ("RuntimeError: my workflow gave up on ", f"({workflow}:{line_of(workflow, 'raise')}); "),
    }
    for kind, words in where.items():
        [line] = [line for line in firsts if line.startswith(f"first {kind}: ")]
        assert all(w in line for w in words) and line.endswith(f"later ones are counted in rollout/failures/{kind}")
    [evaluated] = [line for line in result.stdout.splitlines() if line.startswith("step 0: eval accuracy ")]
    assert " failed (" in evaluated and "the first: " in evaluated  # evaluations say what failed too
    run = run_dir(tmp_path)
    records = metrics(run)
    assert [r["step"] for r in records if "rollout/reward" in r] == [1, 2]
    counted = [r for r in records if "rollout/failures_total" in r][-1]
    assert all(f"rollout/failures/{kind}" in counted for kind in FAILURE_KINDS)
    assert all(counted[f"rollout/failures/{kind}"] >= 1 for kind in where)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("areal-hpc: finished with ") and last.endswith(
        "exit 3 (rollout.failure_budget.exit_code_on_failures)"
    )
    logged = (run / "logs" / "failures.log").read_text()
    assert all(line in logged for line in firsts) and last.removeprefix("areal-hpc: ") in logged

    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    again = run_cli(*args)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert again.stderr.startswith(f"areal-hpc: error: {run} already holds a run (") and "--resume" in again.stderr
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before
