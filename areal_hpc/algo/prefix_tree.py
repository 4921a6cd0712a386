"""The prefix tree of a training batch (AReaL-DTA): sequences sharing a prefix (a GRPO group's prompt, a
multi-turn episode's earlier turns) share its tokens once, in a compressed trie whose nodes are segments.

Built from the sorted sequences and the longest common prefixes of neighbours. A sequence that is a
prefix of another ends at an internal node (an internal loss point); equal sequences end at the same
node. Per-token fields stay per sequence: sequence i's positions [node.start, node.stop) are the
tokens of each node on its path, so any field of i is sliced the same way (``Segment``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from areal_hpc.errors import UserError


@dataclass
class TreeNode:
    tokens: list[int]  # the segment
    start: int  # tokens before the segment on every path through it (its ancestors' total)
    parent: int  # index of the parent node, -1 for a root
    children: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)  # the batch's sequences whose path runs through it

    @property
    def stop(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixTree:
    nodes: list[TreeNode]  # in depth-first pre-order: every parent before its children
    paths: list[list[int]]  # per sequence of the batch: its nodes, root first; the last is where it ends

    @property
    def n_tokens(self) -> int:
        """Tokens the tree holds (each shared prefix once)."""
        return sum(len(node.tokens) for node in self.nodes)

    @property
    def n_sequence_tokens(self) -> int:
        """Tokens of the batch's sequences (each shared prefix once per sequence)."""
        return sum(self.nodes[path[-1]].stop for path in self.paths)

    @property
    def compression(self) -> float:
        """Sequence tokens over tree tokens: how many times a flat pass recomputes each tree token."""
        return self.n_sequence_tokens / self.n_tokens

    @property
    def roots(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.parent < 0]

    def sequence(self, i: int) -> list[int]:
        """Sequence i rebuilt from the segments of its path."""
        return [token for node in self.paths[i] for token in self.nodes[node].tokens]

    def locate(self, i: int, position: int) -> tuple[int, int]:
        """(node, offset in its segment) of token ``position`` of sequence i."""
        for node in self.paths[i]:
            if position < self.nodes[node].stop:
                return node, position - self.nodes[node].start
        raise IndexError(f"position {position} is past the end of sequence {i}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prefix_tree(sequences: list[list[int]], min_saved_tokens: int = 0, shared_within: int = 0) -> PrefixTree:
    """The compressed trie of ``sequences`` (each at least one token). Sorted, a node is a run of sorted
    sequences [a, b) at depth ``start``: its segment runs to the shortest common prefix of the run
    (neighbours' LCPs, and its shortest sequence), the sequences that stop there end at it, and the
    others split into child runs wherever a neighbour's LCP is exactly that long.

    ``min_saved_tokens``: a branching node whose sharing saves fewer token computations than this (its
    segment's length times its branches less one) is not made: its branches start where it would have,
    each with its segment as its own first tokens. Each level of the tree costs tree training one more
    forward and backward of the model, more than a few shared tokens save (the one- to three-token
    branches of a GRPO group's answers, a chat template's first tokens shared across groups). Except
    where its subtree holds at most ``shared_within`` tokens and sharing saves at least as many token
    computations as it widens the row: tree training forwards such a subtree as one row
    (``engines.torch.tree.Segments``), where sharing costs no forward, only width (the row holds every
    branch where each branch's own row would hold one; rows are padded to the widest of their chunk)
    -- a group's prompt over its few distinct answers, not two groups over a shared first digit."""
    if not sequences:
        raise UserError("tree training got an empty batch (no sequences); every rank needs at least one")
    if empty := [i for i, s in enumerate(sequences) if not s]:
        raise UserError(f"tree training got sequence {empty[0]} with no tokens; every sequence needs at least one")
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    ordered = [sequences[i] for i in order]
    lcp = [0] + [_common_prefix(a, b) for a, b in itertools.pairwise(ordered)]  # lcp[k]: with the one before
    nodes: list[TreeNode] = []
    paths: list[list[int]] = [[] for _ in sequences]

    def trie_tokens(a: int, b: int, depth: int) -> int:
        """Tokens of the sorted sequences [a, b) from ``depth`` on, each common prefix counted once."""
        return sum(len(ordered[k]) - (depth if k == a else max(depth, lcp[k])) for k in range(a, b))

    def free_to_share(branches: list[tuple[int, int]], start: int, stop: int) -> bool:
        """Whether the node [start, stop) over ``branches`` fits a row and saves more than it widens it."""
        if trie_tokens(branches[0][0], branches[-1][1], start) > shared_within:
            return False
        below = [trie_tokens(c, d, stop) for c, d in branches]
        return (stop - start) * (len(branches) - 1) >= sum(below) - max(below)

    def runs(a: int, b: int, depth: int) -> list[tuple[int, int]]:
        """[a, b) cut before every k whose LCP with its neighbour is ``depth`` (none for an empty range)."""
        if a == b:
            return []
        cuts = [k for k in range(a + 1, b) if lcp[k] == depth]
        return list(zip([a, *cuts], [*cuts, b]))

    pending = [(a, b, 0, -1) for a, b in reversed(runs(0, len(ordered), 0))]  # a stack: depth-first pre-order
    while pending:
        a, b, start, parent = pending.pop()
        stop = min([*lcp[a + 1 : b], *(len(ordered[k]) for k in range(a, b))])
        ending = a  # sorted: the sequences that end here come first in the run
        while ending < b and len(ordered[ending]) == stop:
            ending += 1
        children = runs(ending, b, stop)
        branches = ([(a, ending)] if ending > a else []) + children  # the sequences ending here: one branch
        if (
            len(branches) >= 2
            and (stop - start) * (len(branches) - 1) < min_saved_tokens
            and not free_to_share(branches, start, stop)
        ):
            pending += [(c, d, start, parent) for c, d in reversed(branches)]
            continue
        index = len(nodes)
        nodes.append(TreeNode(ordered[a][start:stop], start, parent, sequences=[order[k] for k in range(a, b)]))
        if parent >= 0:
            nodes[parent].children.append(index)
        for k in range(a, b):
            paths[order[k]].append(index)
        pending += [(c, d, stop, index) for c, d in reversed(children)]
    return PrefixTree(nodes, paths)
