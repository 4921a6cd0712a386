"""A reward that hangs, raises, kills its worker or returns something that is not a finite number is a
recorded failure of its kind; the other scores survive, and the workers' start-up is not charged to the
first call's timeout. A reward named by file path, async, or returning metrics scores in the workers; one
with ``score_batch`` gets each worker's share of a call in one batch, its failures confined to that share.
With ``workers=0`` the calling thread scores, and what a call raises or returns is recorded as the
workers' outcome would be."""

import multiprocessing
import os
import threading
import time

import pytest

from areal_hpc.config import load_config
from areal_hpc.data.rewards import RewardFunction, RewardPool, RewardRequest
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.train.task_setup import open_task
from tests import rewards_for_tests as bad
from tests import slow_start_reward
from tests.conftest import REPO


def request(completion: str, **fields) -> RewardRequest:
    return RewardRequest("What is 2+2?", completion, [1, 2], [3], {"answer": "4", **fields})


@pytest.mark.parametrize(
    "reward_fn, poison, error, kind",
    [
        (bad.hangs, "hang", "timed out", "timeout"),
        (bad.raises, "boom", "ValueError: bad reward code", "exception"),
        (bad.exits, "die", "timed out", "timeout"),
        (bad.not_a_number, "nan", "returned nan", "invalid"),
        (bad.not_a_number, "text", "returned '1.0' (str)", "invalid"),
        (bad.not_a_number, "none", "returned None", "invalid"),
        (bad.not_a_number, "dict", "without 'reward'", "invalid"),
    ],
)
def test_failures_are_recorded_and_other_items_still_score(reward_fn, poison, error, kind):
    requests = [request("ok"), request(poison), request("ok"), request("ok")]
    started = time.monotonic()
    with RewardPool(reward_fn, workers=2, timeout_s=2.0) as pool:
        outcomes = pool.score(requests)
        assert [o.value for o in outcomes] == [1.0, 0.0, 1.0, 1.0]
        assert error in outcomes[1].error and outcomes[1].error_kind == kind
        assert all(o.error is None and o.error_kind is None for i, o in enumerate(outcomes) if i != 1)
        assert pool.score([request("ok")])[0].value == 1.0  # the pool keeps serving afterwards
    assert time.monotonic() - started < 30


FLAKY_REWARD = """
def flaky(prompt, completion, prompt_ids, completion_ids, **fields):
    if completion == "boom":
        raise ValueError("cannot score " + completion)
    return float("nan") if completion == "nan" else 1.0
"""


def test_a_failed_reward_names_the_users_file_and_line(tmp_path):
    """Where the user's reward raised (from the worker, where its traceback is), and where a reward that returned
    no number is defined."""
    (tmp_path / "my_reward.py").write_text(FLAKY_REWARD)
    path = (tmp_path / "my_reward.py").resolve()
    with RewardPool(RewardFunction(f"{path}:flaky"), workers=1, timeout_s=5.0) as pool:
        raised, invalid, scored = pool.score([request("boom"), request("nan"), request("4")])
    assert raised.error == f"reward raised ValueError: cannot score boom ({path}:4)"
    assert invalid.error.startswith(f"reward {path}:flaky (defined at {path}:2) returned nan (float)")
    assert (raised.error_kind, invalid.error_kind, scored.error) == ("exception", "invalid", None)


def test_worker_start_up_is_not_charged_to_the_reward_timeout():
    with RewardPool(slow_start_reward.correct, workers=2, timeout_s=1.0) as pool:
        outcomes = pool.score([request("a"), request("b"), request("c")])
    assert [(o.value, o.error) for o in outcomes] == [(1.0, None)] * 3


USER_REWARD = """
import asyncio

async def graded(prompt, completion, prompt_ids, completion_ids, answer, weight=1.0, **fields):
    await asyncio.sleep(0)
    right = completion.strip() == answer
    return {"reward": weight * right, "length": len(completion_ids), "saw_prompt": float(prompt.startswith("What"))}
"""


def test_a_reward_by_file_path_runs_async_in_the_workers_and_returns_metrics(tmp_path):
    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    spec = f"{tmp_path / 'my_reward.py'}:graded"
    with RewardPool(RewardFunction(spec), workers=2, timeout_s=5.0) as pool:
        right, wrong = pool.score([request("4", weight=0.5), request("5")])
    assert (right.value, right.metrics) == (0.5, {"length": 1.0, "saw_prompt": 1.0})
    assert (wrong.value, wrong.error) == (0.0, None)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_colon", ["'reward.fn'", "'no_colon'", "package.module:name"]),
        ("areal_hpc.no_such_module:f", ["cannot import", "areal_hpc.no_such_module"]),
        ("areal_hpc.data.rewards:no_such_function", ["has no 'no_such_function'", "RewardPool"]),
        ("areal_hpc.data.rewards:MAX_SCORED_CHARS", ["is a int, not a function"]),
        ("missing/file.py:f", ["no file", "missing/file.py"]),
    ],
)
def test_a_bad_reward_spec_is_one_line_naming_it(spec, words):
    with pytest.raises(UserError) as err:
        RewardFunction(spec).load()
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_a_reward_file_that_fails_to_import_says_why(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_package_anywhere\n")
    with pytest.raises(UserError, match="broken.py failed to load: ModuleNotFoundError"):
        RewardFunction(f"{tmp_path / 'broken.py'}:f").load()


def test_a_reward_with_score_batch_gets_a_share_per_worker_and_its_failures_stay_in_that_share():
    with RewardPool(bad.scores_in_batches, workers=2, timeout_s=2.0) as pool:
        outcomes = pool.score([request("a" * n) for n in range(1, 6)])
        assert [(o.value, o.metrics) for o in outcomes] == [(n, {"batch": 3.0 if n % 2 else 2.0}) for n in range(1, 6)]
        # shares are requests 0, 2, 4 and 1, 3: a failure in one leaves the other share scored
        for poison, error, kind in (
            ("boom", "ValueError: bad batch code", "exception"),
            ("short", "score_batch returned 1 results for 2 requests", "invalid"),
        ):
            outcomes = pool.score([request("a"), request(poison), request("abc"), request("ab")])
            assert [o.value for o in outcomes] == [1.0, 0.0, 3.0, 0.0]
            assert all(error in outcomes[i].error and outcomes[i].error_kind == kind for i in (1, 3))
        nan = pool.score([request("a"), request("nan"), request("abc")])  # one bad value fails that item only
        assert [o.value for o in nan] == [1.0, 0.0, 3.0] and nan[1].error_kind == "invalid" and nan[2].error is None


@pytest.mark.parametrize(
    "reward_fn, poison",
    [
        (bad.raises, "boom"),
        (bad.not_a_number, "nan"),
        (bad.not_a_number, "text"),
        (bad.not_a_number, "none"),
        (bad.not_a_number, "dict"),
        (bad.scores_in_batches, "boom"),
        (bad.scores_in_batches, "short"),
        (bad.scores_in_batches, "nan"),
        (bad.exact_answer, "4"),
    ],
)
def test_scoring_in_the_calling_thread_records_what_the_workers_would(reward_fn, poison):
    requests = [request("4"), request(poison), request("ab"), request("5")]
    with RewardPool(reward_fn, workers=1, timeout_s=5.0) as pool:
        in_worker = pool.score(requests)
    with RewardPool(reward_fn, workers=0) as pool:
        here = pool.score(requests)
    assert [(o.value, o.error, o.error_kind, o.metrics) for o in here] == [
        (o.value, o.error, o.error_kind, o.metrics) for o in in_worker
    ]
    assert any(o.error for o in here) == (poison != "4")


def test_workers_zero_scores_in_the_calling_thread_without_a_process():
    with RewardPool(bad.scored_where, workers=0) as pool:
        [outcome] = pool.score([request("4")])
        assert multiprocessing.active_children() == []
    assert outcome.metrics == {"pid": float(os.getpid()), "thread": float(threading.get_ident())}
    with RewardPool(bad.scored_where, workers=1) as pool:
        [outcome] = pool.score([request("4")])
    assert outcome.value == 1.0 and outcome.metrics["pid"] != float(os.getpid())


def test_a_reward_that_fails_to_load_fails_each_call_in_the_calling_thread(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_package_anywhere\n")
    with RewardPool(RewardFunction(f"{tmp_path / 'broken.py'}:f"), workers=0) as pool:
        outcomes = pool.score([request("4"), request("5")])
    assert [o.error_kind for o in outcomes] == ["exception"] * 2
    assert all("broken.py failed to load: ModuleNotFoundError" in o.error for o in outcomes)


def test_your_reward_in_the_trainers_process_is_said_once_and_the_built_in_one_is_not(tiny_model_dir):
    yours = f"reward.fn={REPO / 'tests' / 'rewards_for_tests.py'}:exact_answer"
    said = {}
    for name, extra in (("yours", [yours]), ("built-in", []), ("yours, in a worker", [yours, "reward.workers=1"])):
        cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [f"model.path={tiny_model_dir}", *extra])
        lines = []
        open_task(cfg, load_tokenizer(tiny_model_dir), tiny_model_dir, say=lines.append)
        said[name] = [line for line in lines if "reward.workers" in line]
    assert said["built-in"] == said["yours, in a worker"] == []
    assert len(said["yours"]) == 1 and "reward.timeout_s cannot stop it" in said["yours"][0]
