"""Learning-rate schedules: warm-up to the peak, then constant/linear/cosine down to min_lr_ratio."""

import itertools
import math

import pytest
import torch

from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.optim import build_optimizer, build_scheduler, lr_multiplier


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedule_warms_up_peaks_and_ends_at_min_ratio(kind):
    cfg = OptimizerConfig(lr_scheduler_type=kind, warmup_steps_proportion=0.1, min_lr_ratio=0.1)
    factors = [lr_multiplier(s, 100, cfg) for s in range(100)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert max(factors) == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(factors[10:]))  # never rises after warm-up
    expected_end = {"constant": 1.0, "linear": 0.1 + 0.9 / 90, "cosine": 0.1 + 0.45 * (1 + math.cos(math.pi * 89 / 90))}
    assert factors[-1] == pytest.approx(expected_end[kind])


def test_scheduler_drives_the_optimizer_and_skips_decay_on_vectors():
    model = torch.nn.Linear(4, 4)
    cfg = OptimizerConfig(lr_scheduler_type="linear", warmup_steps_proportion=0.0, weight_decay=0.1)
    optimizer = build_optimizer(model, cfg, lr=1.0)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    scheduler = build_scheduler(optimizer, cfg, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25])
