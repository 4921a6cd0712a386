"""The async-RL simulator: the synchronous bound, staleness, interruption."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.sched.simulator import AsyncRLSimulator, ReplicaSpeed, sample_lengths


@settings(max_examples=40, deadline=None)
@given(
    replicas=st.integers(1, 4),
    slots=st.integers(1, 16),
    waves=st.integers(0, 3),
    partial=st.floats(0, 1),
    answer=st.integers(1, 500),
    prompt=st.integers(0, 100),
    step_1=st.floats(1e-3, 0.05),
    growth=st.floats(0, 2e-3),
    per_token=st.floats(0, 1e-3),
    fixed=st.floats(0, 5),
    sync=st.floats(0, 5),
)
def test_synchronous_rl_reaches_the_analytic_bound(
    replicas, slots, waves, partial, answer, prompt, step_1, growth, per_token, fixed, sync
):
    """η = 0 with equal lengths: generation, training and sync never overlap. The batch is either
    ``waves`` full waves of every slot, or (waves = 0) one partial wave spread over the replicas."""
    speed = ReplicaSpeed(slots, step_1, step_1 + growth * (slots - 1))
    batch = waves * replicas * slots or max(1, round(partial * replicas * slots))
    sim = AsyncRLSimulator([speed] * replicas, batch, prompt, per_token, fixed, sync, staleness=0)
    result = sim.run(np.full(batch * 20, float(answer)), steps=5)
    busiest = slots if waves else math.ceil(batch / replicas)
    generation = max(waves, 1) * answer * speed.step_s(busiest)
    step = generation + fixed + batch * (prompt + answer) * per_token + sync
    assert result.tokens_per_s == pytest.approx(batch * (prompt + answer) / step, rel=1e-9)


def test_staleness_overlaps_generation_with_training():
    lengths = sample_lengths(np.random.default_rng(0), 40_000, 300, 1000, 0.6)
    runs = {
        eta: AsyncRLSimulator([ReplicaSpeed(64, 0.01, 0.02)] * 2, 64, 50, 2e-4, 1.0, 0.5, eta).run(lengths, 10)
        for eta in (0, 1, 4)
    }
    assert runs[0].tokens_per_s < runs[1].tokens_per_s <= runs[4].tokens_per_s * 1.001
    assert runs[4].trainer_idle < runs[0].trainer_idle


def test_interruption_beats_draining_with_long_tails():
    lengths = sample_lengths(np.random.default_rng(1), 40_000, 300, 2000, 1.0)
    runs = [
        AsyncRLSimulator([ReplicaSpeed(64, 0.01, 0.02)] * 2, 64, 50, 1e-4, 0.5, 0.5, 4, interruptible)
        .run(lengths, 10)
        .tokens_per_s
        for interruptible in (True, False)
    ]
    assert runs[0] > runs[1]


def test_throughput_never_exceeds_either_side():
    lengths = sample_lengths(np.random.default_rng(2), 40_000, 300, 1000, 0.6)
    speed = ReplicaSpeed(32, 0.01, 0.02)
    result = AsyncRLSimulator([speed] * 3, 64, 50, 1e-4, 0.2, 0.1, 8).run(lengths, 10)
    rollout_capacity = 3 * 32 / 0.02 * (350 / 300)  # answer tokens/s at full batch, scaled to trained tokens
    assert result.tokens_per_s <= rollout_capacity * 1.05
    assert result.tokens_per_s <= 1 / 1e-4


def test_lengths_are_cut_at_the_context():
    lengths = sample_lengths(np.random.default_rng(0), 10_000, 4000, 7936, 0.6)
    assert lengths.max() == 7936 and lengths.min() >= 1
    assert lengths.mean() == pytest.approx(4000, rel=0.1)
