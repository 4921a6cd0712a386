"""A reward that hangs, raises or kills its worker is a recorded failure; the other scores survive."""

import time

import pytest

from areal_hpc.data.rewards import RewardPool

from . import rewards_for_tests as bad


@pytest.mark.parametrize("reward_fn, poison, error", [
    (bad.hangs, "hang", "timed out"),
    (bad.raises, "boom", "ValueError: bad reward code"),
    (bad.exits, "die", "timed out"),
])
def test_failures_are_recorded_and_other_items_still_score(reward_fn, poison, error):
    pairs = [("ok", None), (poison, None), ("ok", None), ("ok", None)]
    started = time.monotonic()
    with RewardPool(reward_fn, workers=2, timeout_s=2.0) as pool:  # margin for spawn start-up
        outcomes = pool.score(pairs)
        assert [o.value for o in outcomes] == [1.0, 0.0, 1.0, 1.0]
        assert error in outcomes[1].error
        assert all(o.error is None for i, o in enumerate(outcomes) if i != 1)
        assert pool.score([("ok", None)])[0].value == 1.0  # the pool keeps serving afterwards
    assert time.monotonic() - started < 20
