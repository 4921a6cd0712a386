"""Tree batches balanced over data-parallel replicas (AReaL-DTA): a minibatch's sequences in the
depth-first order of their prefix tree (their sorted order), cut into K contiguous parts so that the
largest part's cost is as small as it can be, by binary search on that cost.

A part's cost is what tree training spends on the prefix tree of its sequences, modelled as
``c · features`` (``TREE_FEATURES``): c0 per sequence (its loss piece, a leaf), c1 per tree token
(every token's forward and backward once), c2 per fork token (a token of a node with two or more
children: its K/V is copied to each child chunk and receives their gradients), c3 per prefix token
(Σ over nodes of the depth they start at: the cache each node's chunk reads) and c4 per level
(Σ over nodes of their depth: one padded forward per level). The coefficients are non-negative least
squares (``scipy.optimize.nnls``) over measured steps: ``areal-hpc tree-cost RUN_DIR`` refits them from
a run's ``metrics.jsonl`` (the trainer logs each step's features and seconds) and prints the
``actor.tree_cost`` to set.

A run's cost counts the nodes of the whole minibatch's tree that its sequences pass through: exact for
leaves and tokens; a run that leaves out a branch may merge two of those nodes in its own tree, which
the per-node terms then count apart (an estimate, as the model is). Contiguous parts keep each shared
prefix on as few replicas as possible; a prefix cut by a part boundary is computed on both sides (the
cost counts it on both).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from areal_hpc.algo.prefix_tree import PrefixTree, build_prefix_tree
from areal_hpc.errors import UserError

TREE_FEATURES = ("leaves", "tokens", "fork_tokens", "prefix_tokens", "levels")
DEFAULT_COST = (0.0, 1.0, 0.0, 0.0, 0.0)  # tokens alone, until a fit on this machine says otherwise


def node_features(tree: PrefixTree) -> np.ndarray:
    """[nodes, 5]: each node's share of ``TREE_FEATURES`` (the leaves column counts the sequences that
    end at it)."""
    depth = np.zeros(len(tree.nodes))
    rows = np.zeros((len(tree.nodes), len(TREE_FEATURES)))
    for n, node in enumerate(tree.nodes):  # pre-order: a parent's depth is known before its children's
        depth[n] = 0 if node.parent < 0 else depth[node.parent] + 1
        ending = len(node.sequences) - sum(len(tree.nodes[c].sequences) for c in node.children)
        rows[n] = (ending, len(node.tokens), len(node.tokens) if len(node.children) > 1 else 0, node.start, depth[n])
    return rows


def check_cost(cost: Sequence[float]) -> np.ndarray:
    """``actor.tree_cost`` as an array, or one ``UserError``."""
    values = np.asarray(cost, dtype=float) if len(cost) == len(TREE_FEATURES) else None
    if values is None or not np.all(np.isfinite(values)) or values.min() < 0 or values.max() <= 0:
        raise UserError(
            f"actor.tree_cost={list(cost)} must hold {len(TREE_FEATURES)} non-negative numbers, not all 0 "
            f"(coefficients of {', '.join(TREE_FEATURES)}; 'areal-hpc tree-cost RUN_DIR' fits them)"
        )
    return values


class RangeCost:
    """The cost of the prefix tree of any contiguous run [a, b) of the sequences in depth-first order,
    in O(1): each node is paid by the first sequence through it; a run starting at a also pays for
    the nodes on a's path that earlier sequences paid for."""

    def __init__(self, tree: PrefixTree, order: list[int], cost: np.ndarray):
        position = {s: k for k, s in enumerate(order)}
        node_cost = node_features(tree)[:, 1:] @ cost[1:]
        paid = np.full(len(order), cost[0])  # per sequence: c0 and the nodes it pays for first
        inherited = np.zeros(len(order))  # per sequence: its path's nodes that an earlier one pays for
        for n, node in enumerate(tree.nodes):
            first = min(position[s] for s in node.sequences)
            paid[first] += node_cost[n]
            for s in node.sequences:
                if position[s] != first:
                    inherited[position[s]] += node_cost[n]
        self.cumulative = np.concatenate([[0.0], np.cumsum(paid)])
        self.inherited = inherited

    def __call__(self, a: int, b: int) -> float:
        return 0.0 if b <= a else float(self.cumulative[b] - self.cumulative[a] + self.inherited[a])

    def all_runs(self) -> np.ndarray:
        """The costs of every non-empty run [a, b)."""
        n = len(self.inherited)
        a, b = np.triu_indices(n + 1, 1)
        return self.cumulative[b] - self.cumulative[a] + self.inherited[a]


def tree_parts(
    sequences: list[list[int]], parts: int, cost: Sequence[float] = DEFAULT_COST, weights: list[float] | None = None
) -> list[list[int]]:
    """Sequence indices of ``parts`` contiguous runs of the depth-first order minimising the largest
    cost(run) / weight (``weights``: each replica's relative speed, default equal). Runs may be empty
    (more parts than sequences, or a sequence too costly to share)."""
    weights, cost = np.asarray(weights or [1.0] * parts, dtype=float), check_cost(cost)
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    if not sequences or parts == 1:  # nothing to cut (one process trains every step this way)
        return [order] + [[] for _ in range(parts - 1)]
    run_cost = RangeCost(build_prefix_tree(sequences), order, cost)

    def boundaries(limit: float) -> list[int] | None:
        """Greedy: each part, in order, takes sequences while its cost stays within limit · weight."""
        cuts, a = [0], 0
        for weight in weights:
            b = a
            while b < len(order) and run_cost(a, b + 1) <= limit * weight * (1 + 1e-12):
                b += 1
            cuts.append(b)
            a = b
        return cuts if a == len(order) else None

    candidates = np.unique(np.divide.outer(run_cost.all_runs(), weights))  # the optimum is one of them
    low, high = 0, len(candidates) - 1  # the largest is feasible: any one part may take everything
    while low < high:
        middle = (low + high) // 2
        if boundaries(candidates[middle]) is None:
            low = middle + 1
        else:
            high = middle
    cuts = boundaries(candidates[low])
    return [order[a:b] for a, b in itertools.pairwise(cuts)]


def fit_cost(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares coefficients of ``seconds`` [m] on ``features`` [m, 5] (columns
    scaled to unit norm for the solve)."""
    from scipy.optimize import nnls

    features, seconds = np.asarray(features, dtype=float), np.asarray(seconds, dtype=float)
    if features.ndim != 2 or features.shape[1] != len(TREE_FEATURES) or len(features) != len(seconds):
        raise UserError(
            f"a cost fit needs one row of {len(TREE_FEATURES)} features per measured step, got "
            f"{features.shape} features for {seconds.shape} times"
        )
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0
    coefficients, _ = nnls(features / scale, seconds)
    return coefficients / scale


def fit_from_records(records: list[dict], prefix: str = "actor/") -> tuple[np.ndarray, float, int]:
    """(coefficients, median relative error of the fit, steps used) from a run's metric records: the
    steps that logged tree training's features and seconds (``<prefix>tree_<feature>``,
    ``<prefix>tree_seconds``)."""
    names = [f"{prefix}tree_{name}" for name in TREE_FEATURES]
    steps = [r for r in records if all(name in r for name in names) and f"{prefix}tree_seconds" in r]
    if len(steps) < len(TREE_FEATURES):
        raise UserError(
            f"the cost fit needs at least {len(TREE_FEATURES)} steps trained with actor.tree_training=dta "
            f"(metrics {prefix}tree_*), found {len(steps)}"
        )
    features = np.array([[r[name] for name in names] for r in steps])
    seconds = np.array([r[f"{prefix}tree_seconds"] for r in steps])
    coefficients = fit_cost(features, seconds)
    error = float(np.median(np.abs(features @ coefficients - seconds) / seconds))
    return coefficients, error, len(steps)
