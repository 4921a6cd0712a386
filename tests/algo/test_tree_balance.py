"""Tree batches over data-parallel replicas (``algo.tree_balance``): the O(1) cost of a run of the
depth-first order equals that of the minibatch tree's nodes its sequences pass through, whose
features match a token-level trie's (a dict of prefixes, not ``algo.prefix_tree``); the parts are
contiguous, hold every sequence once and reach the smallest possible largest cost, found by trying
every cut (hypothesis); the NNLS fit gets back the coefficients that made the times."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.algo.tree_balance import TREE_FEATURES, RangeCost, fit_cost, node_features, tree_parts
from areal_hpc.errors import UserError
from tests.algo.test_prefix_tree import shared_prefix_batches

costs = st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=5, max_size=5).filter(any)


def features_of(sequences: list[list[int]]) -> np.ndarray:
    """``TREE_FEATURES`` summed over the prefix tree of ``sequences``."""
    return node_features(build_prefix_tree([list(s) for s in sequences])).sum(0)


def trie_features(sequences: list[list[int]]) -> np.ndarray:
    """``TREE_FEATURES`` from the set of distinct prefixes: a node starts at a prefix whose parent prefix
    is empty, ends a sequence or has several extensions; its depth is the node starts above it."""
    prefixes = {tuple(s[:t]) for s in sequences for t in range(1, len(s) + 1)}
    ends = {tuple(s) for s in sequences}
    extensions = {p: sum(1 for q in prefixes if len(q) == len(p) + 1 and q[:-1] == p) for p in prefixes | {()}}
    starts = {p for p in prefixes if not p[:-1] or p[:-1] in ends or extensions[p[:-1]] > 1}

    def node_end(p: tuple) -> tuple:  # the last prefix of p's node: where a sequence ends or it branches
        while p not in ends and extensions[p] == 1:
            p = next(q for q in prefixes if len(q) == len(p) + 1 and q[:-1] == p)
        return p

    forks = sum(1 for p in prefixes if extensions[node_end(p)] > 1)
    levels = sum(sum(1 for t in range(1, len(p)) if p[:t] in starts) for p in starts)
    return np.array([len(sequences), len(prefixes), forks, sum(len(p) - 1 for p in starts), levels], dtype=float)


@settings(max_examples=150, deadline=None)
@given(shared_prefix_batches(), costs)
def test_a_runs_cost_counts_the_nodes_its_sequences_pass_through(sequences, cost):
    """Against the features of the union of the run's paths in the minibatch's tree, and, for leaves and
    tokens (the terms a run's own tree cannot change), against the run's own trie."""
    tree, cost = build_prefix_tree(sequences), np.array(cost)
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    run_cost = RangeCost(tree, order, cost)
    rows = node_features(tree)
    np.testing.assert_allclose(rows.sum(0), trie_features(sequences))
    for a, b in itertools.combinations(range(len(order) + 1), 2):
        nodes = sorted({n for i in order[a:b] for n in tree.paths[i]})
        through = rows[nodes].sum(0)
        through[0] = b - a
        assert run_cost(a, b) == pytest.approx(float(through @ cost))
        own = trie_features([sequences[i] for i in order[a:b]])
        assert through[:2].tolist() == own[:2].tolist()


@settings(max_examples=150, deadline=None)
@given(shared_prefix_batches(), st.integers(1, 4), costs, st.booleans())
def test_parts_are_contiguous_cover_every_sequence_once_and_minimise_the_largest(sequences, k, cost, weighted):
    weights = [1.0 + i for i in range(k)] if weighted else None
    parts = tree_parts(sequences, k, cost, weights)
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    assert len(parts) == k and [i for part in parts for i in part] == order
    w = np.array(weights or [1.0] * k)
    run_cost = RangeCost(build_prefix_tree(sequences), order, np.array(cost))
    ours = max(run_cost(*ends) / weight for ends, weight in zip(runs_of(parts), w))
    best = min(
        max(run_cost(a, b) / weight for (a, b), weight in zip(zip((0, *cuts), (*cuts, len(order))), w))
        for cuts in itertools.combinations_with_replacement(range(len(order) + 1), k - 1)
    )
    assert ours == pytest.approx(best)


def runs_of(parts: list[list[int]]) -> list[tuple[int, int]]:
    bounds = np.cumsum([0] + [len(p) for p in parts])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def test_grpo_groups_go_whole_to_replicas():
    """Four groups of 8 sharing a 40-token prompt over two replicas: two whole groups each."""
    groups = [[[g] * 40 + [100 + 10 * g + k] * 5 for k in range(8)] for g in range(4)]
    sequences = [s for group in groups for s in group]
    parts = tree_parts(sequences, 2, (0.0, 1.0, 0.0, 0.0, 0.0))
    assert sorted(sorted({i // 8 for i in part}) for part in parts) == [[0, 1], [2, 3]]


def test_more_parts_than_sequences_leaves_some_empty():
    parts = tree_parts([[1, 2], [1, 3]], 4)
    assert sorted(parts) == [[], [], [0], [1]]  # 2 tokens each rather than 3 on one replica


def test_the_fit_recovers_the_coefficients_that_made_the_times():
    rng = np.random.default_rng(0)
    truth = np.array([2e-4, 1e-5, 3e-6, 0.0, 5e-4])
    features = np.stack(
        [
            features_of([list(rng.integers(0, 3, int(rng.integers(1, 30)))) for _ in range(n)])
            for n in rng.integers(2, 40, 60)
        ]
    )
    np.testing.assert_allclose(fit_cost(features, features @ truth), truth, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("cost", [[1.0, 2.0], [0, 0, 0, 0, 0], [1, -1, 0, 0, 0], [float("nan")] * 5])
def test_a_bad_cost_is_one_user_error(cost):
    with pytest.raises(UserError, match="actor.tree_cost=.*5 non-negative numbers"):
        tree_parts([[1, 2], [1, 3]], 2, cost)
    assert len(TREE_FEATURES) == 5
