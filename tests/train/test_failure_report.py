"""Failed episodes and rewards reach the user: the first of each kind shown once with the user's file and line
(and in the run's ``logs/failures.log``), the last line saying how many of each kind, and the exit status
``rollout.failure_budget.exit_code_on_failures`` (0 makes it a success); ``areal-hpc eval``."""

import re

from areal_hpc.rollout.controller import FailureLog
from areal_hpc.train.failure_report import FailureReport, failures_log, last_summary
from tests.conftest import run_cli
from tests.flaky_user_code import line_of, write_flaky_code

KEY = "rollout.failure_budget.exit_code_on_failures"


def test_the_first_failure_of_each_kind_is_shown_once_and_the_last_line_gives_the_exit_status(tmp_path):
    shown, log = [], failures_log(tmp_path)
    report, failures = FailureReport(shown.append, log, "rollout/failures/{kind}"), FailureLog()
    assert report.finish(failures, 3) == 0 and shown == [] and not log.exists()  # nothing failed: a success
    failures.add("reward_exception", "e1: reward raised ValueError: bad (my_reward.py:12)")
    failures.add("reward_exception", "e2: reward raised ValueError: worse (my_reward.py:12)")
    report.show_new(failures)
    report.show_new(failures)
    failures.add("workflow", "e3: RuntimeError: gave up (my_workflow.py:9)")
    assert report.finish(failures, 3) == 3
    assert shown == [
        "first reward_exception: e1: reward raised ValueError: bad (my_reward.py:12); "
        "later ones are counted in rollout/failures/reward_exception",
        "first workflow: e3: RuntimeError: gave up (my_workflow.py:9); "
        "later ones are counted in rollout/failures/workflow",
        f"finished with 3 failures (reward_exception 2, workflow 1); the first of each kind is in {log}; "
        f"exit 3 ({KEY})",
    ]
    assert [line.split(" ", 2)[2] for line in log.read_text().splitlines()] == shown  # each after a time stamp
    assert last_summary(tmp_path) == shown[-1]


def test_eval_shows_failed_episodes_and_rewards_and_exits_with_the_failure_status(tiny_model_dir, tmp_path):
    """Six problems: the workflow gives up on the 6th episode; of the five rewards, calls 1 and 5 raise, call 2
    is NaN (``--json`` carries the same counts: tests/train/test_sft.py)."""
    reward, workflow = write_flaky_code(tmp_path)
    args = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--limit",
        "6",
        f"reward.fn={reward}:flaky",
        f"rollout.workflow={workflow}:SometimesGivesUp",
        "rollout.workflow_args={every: 6}",
        "generation.max_new_tokens=4",
        "reward.workers=0",  # scored in the evaluating process: no worker to start
    ]
    text = run_cli(*args)
    assert text.returncode == 3, text.stderr[-3000:]
    lines = text.stdout.strip().splitlines()
    firsts = {line.split(":")[0]: line for line in lines if line.startswith("first ")}
    assert sorted(firsts) == ["first reward_exception", "first reward_invalid", "first workflow"]
    where = f"{reward}:{line_of(reward, 'raise')}"
    raised = rf"reward raised ValueError: cannot score call [15] \({re.escape(where)}\)$"
    assert re.search(raised, firsts["first reward_exception"].split(";")[0])
    assert f"reward {reward}:flaky (defined at {reward}:4) returned nan" in firsts["first reward_invalid"]
    where = f"{workflow}:{line_of(workflow, 'raise')}"
    gave_up = rf"RuntimeError: my workflow gave up on \S+ \({re.escape(where)}\)$"
    assert re.search(gave_up, firsts["first workflow"].split(";")[0])
    assert all(line.endswith("later ones are counted in the last line") for line in firsts.values())
    assert summary(lines[-1]) == ({"reward_exception": 2, "reward_invalid": 1, "workflow": 1}, f"; exit 3 ({KEY})")


def summary(line: str) -> tuple[dict[str, int], str]:
    """A last line "finished with N failures (kind n, ...)...": the counts by kind (they add up to N), and the rest."""
    found = re.fullmatch(r"finished with (\d+) failures \(([^)]*)\)(.*)", line)
    assert found, line
    counts = {kind: int(n) for kind, n in (part.split() for part in found[2].split(", "))}
    assert sum(counts.values()) == int(found[1])
    return counts, found[3]
