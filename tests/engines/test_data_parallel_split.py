"""How a batch is dealt to data-parallel replicas: by tokens, in proportion to each replica's weight (the
planner's speed of its devices), checked over random lengths and weights against the bound the greedy
split guarantees; and the one-line refusal of weights that do not match the mesh."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.config import load_config
from areal_hpc.engines.sequence_batch import balanced_parts
from areal_hpc.errors import UserError
from areal_hpc.layout import data_parallel_weights


@given(
    lengths=st.lists(st.integers(1, 500), max_size=60),
    weights=st.lists(st.floats(0.05, 20.0, allow_nan=False), min_size=1, max_size=6),
)
def test_shares_follow_the_weights_within_one_sequence(lengths, weights):
    """Every sequence goes to exactly one replica, and no replica's tokens per unit of weight exceed
    another's by more than the longest sequence over the smallest weight (each sequence goes where it
    leaves the lowest load per weight; loads only grow)."""
    parts = balanced_parts(lengths, len(weights), weights)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    per_weight = [sum(lengths[i] for i in part) / w for part, w in zip(parts, weights)]
    assert max(per_weight) - min(per_weight) <= max(lengths, default=0) / min(weights) + 1e-9


def test_equal_weights_are_the_plain_split():
    lengths = [40, 10, 30, 20, 25, 5]
    assert balanced_parts(lengths, 3, [2.0, 2.0, 2.0]) == balanced_parts(lengths, 3)
    fast, slow = balanced_parts([10] * 8, 2, [3.0, 1.0])
    assert (len(fast), len(slow)) == (6, 2)


@pytest.mark.parametrize(
    "weights, message",
    [
        ([1, 2, 3], "must hold 2 positive numbers, one per data-parallel replica"),
        ([1, 0], "must hold 2 positive numbers"),
    ],
)
def test_weights_that_do_not_match_the_mesh_are_one_line(weights, message):
    cfg = load_config(None, [f"actor.parallel.dp_weights={weights}"])
    with pytest.raises(UserError, match=message):
        data_parallel_weights(cfg.actor.parallel, 2)
    assert data_parallel_weights(load_config(None).actor.parallel, 2) is None
