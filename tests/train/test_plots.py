"""Run curves: the moving average drawn over per-step metrics is the plain trailing mean, and a long
curve gets it."""

import json

from hypothesis import given
from hypothesis import strategies as st
from matplotlib.image import imread

from areal_hpc.train.plots import SMOOTH_FROM, moving_average, plot_curves


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=80), st.integers(1, 20))
def test_moving_average_is_the_trailing_mean(values, window):
    expected = [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]
    assert all(abs(a - b) <= 1e-6 * (1 + abs(b)) for a, b in zip(moving_average(values, window), expected))


def test_curves_of_a_long_run_are_drawn(tmp_path):
    records = [{"step": s, "rollout/reward": (s % 7) / 7} for s in range(1, 3 * SMOOTH_FROM)]
    records += [{"step": 0, "eval/accuracy": 0.1}, {"step": 50, "eval/accuracy": 0.4}]
    out = plot_curves(
        records, {"reward": "rollout/reward", "eval accuracy": "eval/accuracy"}, tmp_path / "c.png", json.dumps("t")
    )
    image = imread(out)
    assert image.shape[1] > image.shape[0] > 100 and image[..., :3].std() > 0.01  # two panels, not blank
