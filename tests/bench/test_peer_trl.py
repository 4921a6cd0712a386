"""bench/peer_trl.py's claims rest on a few pieces that can be checked without training: TRL's process
(bench/peer_trl_child.py) loads nothing of the project, its re-implemented reward decides as the project's
arithmetic reward does, the summary calls an interval that spans zero parity, the timed window leaves out
the start and ours' step-0 evaluation, the prompt check catches a row out of place, only the checkpoints the
final accuracy averages are evaluated unless every one is asked for, and reward_by_version.py reads those
evaluations from the run's evals.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peer_trl  # noqa: E402
from peer_trl_child import answer_reward  # noqa: E402

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.data.registry import build_task  # noqa: E402


@pytest.fixture(scope="module")
def project_reward():
    cfg = load_config(peer_trl.CONFIG)
    task = build_task(cfg.dataset, cfg.reward)
    return task, peer_trl.project_reward(task)


def test_the_trl_child_names_no_project_or_bench_module_anywhere():
    """Every import statement of the child, lazy ones included: no areal_hpc, nothing from bench/."""
    import ast

    tree = ast.parse((ROOT / "bench" / "peer_trl_child.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    bench = {path.stem for path in (ROOT / "bench").glob("*.py")}
    assert not {name for name in imported if name.split(".")[0] in {"areal_hpc", "tests", *bench}}


def test_the_trl_process_imports_nothing_of_the_project():
    """What the child imports to train (torch, transformers, datasets, trl's GRPOTrainer) pulls in no areal_hpc
    module; the child also asserts it at the end of every run, and the parent reads its report."""
    pytest.importorskip("trl")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peer_trl_child.py"), "--imports"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"areal_hpc_modules": []}


def test_the_child_reward_agrees_with_the_project_reward_on_edge_cases(project_reward):
    task, reward = project_reward
    cases = peer_trl.edge_cases(sorted({ex.answer for ex in task.eval}))
    assert peer_trl.check_rewards([(c, a, reward(c, a)) for c, a in cases], "edge cases") == len(cases)
    assert {reward(c, a) for c, a in cases} == {0.0, 1.0}  # both decisions are exercised


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789,.-+= ax\n", max_size=40), st.integers(-200, 200))
def test_the_child_reward_agrees_with_the_project_reward_on_any_text(project_reward, completion, answer):
    _, reward = project_reward
    for text in (completion, completion + str(answer), str(answer) + completion):
        assert answer_reward(text, str(answer)) == reward(text, str(answer))


def test_a_disagreeing_reward_stops_the_bench():
    with pytest.raises(SystemExit, match="disagrees"):
        peer_trl.check_rewards([("12", "12", 0.0)], "examples")


def test_the_verdict_is_parity_when_the_interval_spans_zero():
    assert peer_trl.verdict([-0.01, 0.02]) == "parity"
    assert peer_trl.verdict([0.0, 0.02]) == "parity"
    assert peer_trl.verdict([0.001, 0.02]) == "ours higher"
    assert peer_trl.verdict([-0.03, -0.001]) == "TRL higher"
    assert peer_trl.verdict(None).startswith("no interval")


def rows(differences: list[float]) -> list[dict]:
    out = []
    for seed, difference in enumerate(differences, 1):
        for trainer, accuracy, cpu in (("ours", 0.65 + difference, 0.2), ("trl", 0.65, 0.5)):
            out.append(
                {
                    "trainer": trainer,
                    "seed": seed,
                    "final_accuracy": accuracy,
                    "cpu_s_per_step": cpu,
                    "s_per_step": cpu / 1.5,
                    "peak_mib": 800.0 if trainer == "ours" else 1000.0,
                    "steady_mib": 700.0 if trainer == "ours" else 900.0,
                }
            )
    return out


def test_the_summary_says_parity_and_the_ratios_of_the_medians():
    summary = peer_trl.summarise(rows([0.01, -0.012, 0.004, -0.003, 0.0]))
    line = peer_trl.summary_line(summary)
    assert summary["accuracy_verdict"] == "parity" and line.startswith("accuracy: parity")
    assert summary["peak_mib_ratio"] == pytest.approx(0.8) and "peak PSS 0.80x (800 vs 1000 MiB)" in line
    assert summary["cpu_s_per_step_ratio"] == pytest.approx(0.4)
    assert peer_trl.summarise(rows([0.01, 0.012, 0.014]))["accuracy_verdict"] == "ours higher"
    assert peer_trl.summarise(rows([-0.01, -0.012, -0.014]))["accuracy_verdict"] == "TRL higher"
    assert "no interval" in peer_trl.summary_line(peer_trl.summarise(rows([0.01])))


def test_the_timed_window_starts_after_the_skipped_steps_and_the_in_run_evaluation():
    """Steps end every second from t=1; CPU grows 1.5 s per second; ours' step-0 evaluation ends at t=4.5:
    the window starts at the end of step 5 (t=5), the first after it, and counts steps 6-10."""
    records = [{"step": s, "time": float(s), "time/step": 1.0} for s in range(1, 11)]
    records.append({"step": 0, "time": 4.5, "eval/accuracy": 0.4, "eval/seconds": 4.0})
    samples = [(t / 2, 800.0, 1.5 * t / 2) for t in range(0, 24)]
    window = peer_trl.step_window(records, samples)
    assert window["steps_timed"] == 5 and not window["timed_beside_evaluation"]
    assert window["s_per_step"] == pytest.approx(1.0) and window["cpu_s_per_step"] == pytest.approx(1.5)
    without = peer_trl.step_window(records[:-1], samples)  # no evaluation: from the end of step SKIP_STEPS
    assert without["steps_timed"] == 10 - peer_trl.SKIP_STEPS


def test_the_prompt_check_catches_a_row_out_of_place(tmp_path):
    record = tmp_path / "prompt_ids.jsonl"
    rendered = [[1, 2], [3, 4]]
    record.write_text(json.dumps([[1, 2], [1, 2]]) + "\n" + json.dumps([[3, 4], [3, 4]]) + "\n")
    assert peer_trl.check_prompt_ids(record, rendered, 2, 4) == 4
    record.write_text(json.dumps([[1, 2], [3, 4]]) + "\n" + json.dumps([[3, 4], [3, 4]]) + "\n")
    with pytest.raises(SystemExit, match="prompt row 1"):
        peer_trl.check_prompt_ids(record, rendered, 2, 4)


def test_the_harness_maps_the_quickstart_onto_grpo_config():
    """TRL's own optimizer and schedule, through GRPOConfig's arguments: the quickstart's learning rate, its
    constant schedule with the project's warm-up, weight decay, checkpoints at the evaluation steps."""
    cfg = load_config(peer_trl.CONFIG, peer_trl.base_overrides(Path("/m"), 3, 200, []))
    args = peer_trl.grpo_config(cfg, Path("/o"), 3, 200, 20, 1, True)
    assert args["learning_rate"] == cfg.actor.lr and args["weight_decay"] == cfg.optimizer.weight_decay
    assert (args["lr_scheduler_type"], args["warmup_steps"]) == ("constant_with_warmup", 10)
    assert (args["save_strategy"], args["save_steps"], args["seed"]) == ("steps", 20, 3)
    assert args["per_device_train_batch_size"] == 128 and args["num_generations"] == 8
    assert peer_trl.trl_cannot_follow(cfg) == []


def test_only_the_checkpoints_the_final_accuracy_averages_are_evaluated_unless_every_one_is_asked_for():
    """At the defaults (200 steps, a checkpoint every 20) both sides save 10 checkpoints; the last LAST_EVALS
    are evaluated (with the start model as step 0), all 10 with --eval-every-checkpoint; the final accuracy
    is the same either way."""
    assert peer_trl.LAST_EVALS == 3
    assert peer_trl.checkpoint_steps(200, 20) == list(range(20, 201, 20))
    assert peer_trl.eval_steps(200, 20) == [160, 180, 200]
    assert peer_trl.eval_steps(200, 20, every_checkpoint=True) == list(range(20, 201, 20))
    assert peer_trl.eval_steps(200, 30) == [150, 180, 200]  # the last step is saved off the interval too
    assert peer_trl.eval_steps(7, 3) == peer_trl.eval_steps(7, 3, every_checkpoint=True) == [3, 6, 7]
    assert peer_trl.eval_steps(6, 3) == [3, 6]  # --quick: fewer checkpoints than LAST_EVALS, all evaluated
    assert peer_trl.eval_steps(200, 200) == [200]  # --eval-every 0: the last only
    accuracy = {step: step / 400 for step in range(0, 201, 20)}
    for every in (False, True):
        evals = [{"step": step, "accuracy": accuracy[step]} for step in [0, *peer_trl.eval_steps(200, 20, every)]]
        assert peer_trl.final_accuracy(evals) == pytest.approx((160 + 180 + 200) / 3 / 400)
    quick = [{"step": step, "accuracy": accuracy.get(step, 0.1)} for step in (0, 3, 6)]
    assert peer_trl.final_accuracy(quick) == pytest.approx(0.1)  # the start model (step 0) never counts


def test_ours_keeps_only_the_checkpoints_it_will_evaluate(tmp_path):
    run_dir, kept = tmp_path / "run", tmp_path / "kept"
    for step in (140, 160, 180):
        (run_dir / "checkpoints" / f"step{step:06d}" / "actor").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step{step:06d}" / "actor" / "config.json").write_text("{}")
    (run_dir / "checkpoints" / "step000200.partial" / "actor").mkdir(parents=True)
    peer_trl.keep_checkpoints(run_dir, kept, {160, 180, 200})
    assert sorted(folder.name for folder in kept.iterdir()) == ["step000160", "step000180"]
    assert (kept / "step000160" / "config.json").stat().st_nlink == 2  # a hard link, not a copy


def write_peer_run(root: Path, side: str, seed: int, rewards: list[float], evals: list[tuple[int, float]]) -> None:
    """A finished run as peer_trl.py leaves it: metrics.jsonl with no eval/accuracy (TRL's), evals.json beside."""
    run = root / f"{side}-seed{seed}"
    (run / peer_trl.RUN_FILE).parent.mkdir(parents=True)
    (run / peer_trl.RUN_FILE).write_text(
        "".join(
            json.dumps({"step": s + 1, "time": 1.0 + s, "time/step": 1.0, "rollout/reward": r}) + "\n"
            for s, r in enumerate(rewards)
        )
    )
    (run / "evals.json").write_text(json.dumps([{"step": step, "accuracy": a, "n": 500} for step, a in evals]))


def test_reward_by_version_reads_the_accuracies_of_peer_trl_runs_from_their_evals_json(tmp_path):
    import reward_by_version

    for seed, gap in ((1, 0.02), (2, 0.04)):
        write_peer_run(tmp_path, "trl", seed, [0.4] * 20, [(0, 0.45), (160, 0.6), (180, 0.62), (200, 0.64)])
        write_peer_run(
            tmp_path,
            "ours",
            seed,
            [0.4 + gap] * 20,
            [(0, 0.45), (160, 0.6 + gap), (180, 0.62 + gap), (200, 0.64 + gap)],
        )
    run = reward_by_version.run_summary(tmp_path / "trl-seed1" / peer_trl.RUN_FILE)
    assert run["final"] == pytest.approx(0.62) and run["staleness"] == 0.0
    done = subprocess.run(
        [
            sys.executable,
            "bench/reward_by_version.py",
            "--baseline",
            f"trl={tmp_path}/trl-seed{{seed}}/{peer_trl.RUN_FILE}",
            "--runs",
            f"ours={tmp_path}/ours-seed{{seed}}/{peer_trl.RUN_FILE}",
            "--seeds",
            "1",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| ours | 2 | 0.00 | +3.00 ± 1.00 | +3.00 ± 1.00 |" in done.stdout
    (tmp_path / "trl-seed1" / "evals.json").unlink()  # neither evals.json nor eval/accuracy: refused, not NaN
    with pytest.raises(SystemExit, match="no held-out evaluation"):
        reward_by_version.run_summary(tmp_path / "trl-seed1" / peer_trl.RUN_FILE)
