"""A reward that hangs, raises or kills its worker is a recorded failure of its kind; the other scores
survive, and the workers' start-up is not charged to the first call's timeout."""

import time

import pytest

from areal_hpc.data.rewards import RewardPool

from . import rewards_for_tests as bad
from . import slow_start_reward


@pytest.mark.parametrize("reward_fn, poison, error, kind", [
    (bad.hangs, "hang", "timed out", "timeout"),
    (bad.raises, "boom", "ValueError: bad reward code", "exception"),
    (bad.exits, "die", "timed out", "timeout"),
])
def test_failures_are_recorded_and_other_items_still_score(reward_fn, poison, error, kind):
    pairs = [("ok", None), (poison, None), ("ok", None), ("ok", None)]
    started = time.monotonic()
    with RewardPool(reward_fn, workers=2, timeout_s=2.0) as pool:
        outcomes = pool.score(pairs)
        assert [o.value for o in outcomes] == [1.0, 0.0, 1.0, 1.0]
        assert error in outcomes[1].error and outcomes[1].error_kind == kind
        assert all(o.error is None and o.error_kind is None for i, o in enumerate(outcomes) if i != 1)
        assert pool.score([("ok", None)])[0].value == 1.0  # the pool keeps serving afterwards
    assert time.monotonic() - started < 30


def test_worker_start_up_is_not_charged_to_the_reward_timeout():
    with RewardPool(slow_start_reward.correct, workers=2, timeout_s=1.0) as pool:
        outcomes = pool.score([("a", None), ("b", None), ("c", None)])
    assert [(o.value, o.error) for o in outcomes] == [(1.0, None)] * 3
