"""A radix tree of token sequences with a payload per run of tokens: the embedded engine's prefix cache
(the keys and values of sequences it has run, kept across requests, so a prompt that starts with a cached
sequence, the conversation so far or a GRPO group's prompt, prefills only the rest), and the rollout
client's map of which server holds which conversation (session affinity).

Each node holds a run of tokens and their payload; its path from the root spells the prefix they continue.
Past ``budget`` tokens, ``evict`` drops the least recently used tokens down to ``low_mark(budget)`` (7/8 of
it: one scan of the tree then makes room for many inserts), from the ends of sequences (a leaf's tail is
trimmed, so exactly that many stay), never a token on a path a caller pinned (a running request's prefix).
A lookup or insert marks every token on its path used.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

P = TypeVar("P")


@dataclass(eq=False)
class Node(Generic[P]):
    tokens: list[int]
    payload: P
    start: int  # position of its first token in the sequences through it
    parent: Node[P] | None = None
    children: dict[int, Node[P]] = field(default_factory=dict)
    used: int = 0  # the tree's clock at its last use
    pins: int = 0  # pins on it or a node below it


class PrefixTree(Generic[P]):
    """Token sequences and their payloads; ``split(payload, k)`` cuts a payload of n tokens into those of
    its first k and its last n - k (a node is split where a sequence leaves it, or trimmed)."""

    def __init__(self, budget: int, split: Callable[[P, int], tuple[P, P]]):
        self.budget, self.split = budget, split
        self.size = 0  # tokens held
        self.epoch = 0  # clears so far: what was matched in an earlier epoch is not this tree's any more
        self._root: Node[P] = _root()
        self._clock = itertools.count(1)

    def match(self, tokens: list[int]) -> tuple[int, Node[P]]:
        """The longest prefix of ``tokens`` the tree holds: its length and the node it ends in (the root
        when none); a node it ends inside is split there first. Marks the prefix used."""
        node, matched = self._root, 0
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            common = _common_length(child.tokens, tokens, matched)
            if common < len(child.tokens):
                child = self._split(child, common)
            node, matched = child, matched + common
        self._use(node)
        return matched, node

    def insert(self, tokens: list[int], payload: Callable[[int, int], P]) -> None:
        """Hold ``tokens``: what the tree lacks of them (positions start..end) gets ``payload(start, end)``.
        Call ``evict`` to come back within budget."""
        matched, node = self.match(tokens)
        if matched < len(tokens):
            leaf = Node(list(tokens[matched:]), payload(matched, len(tokens)), matched, node, used=next(self._clock))
            node.children[tokens[matched]] = leaf
            self.size += len(leaf.tokens)

    def segments(self, node: Node[P]) -> list[tuple[int, P]]:
        """(start position, payload) of each node from the root's child down to ``node``."""
        out = []
        while node.parent is not None:
            out.append((node.start, node.payload))
            node = node.parent
        return out[::-1]

    def pin(self, node: Node[P]) -> None:
        """Keep ``node`` and the path above it until ``unpin``."""
        for on_path in _path(node):
            on_path.pins += 1

    def unpin(self, node: Node[P]) -> None:
        for on_path in _path(node):
            on_path.pins -= 1

    def evict(self) -> None:
        """Past the budget, drop the least recently used unpinned tokens, leaves' tails first, down to
        ``low_mark(budget)`` (or as far as pins allow)."""
        if self.size <= self.budget:
            return
        target = low_mark(self.budget)
        leaves = [(n.used, id(n), n) for n in self._nodes() if not n.children and not n.pins]
        heapq.heapify(leaves)
        while self.size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            excess = self.size - target
            if excess < len(leaf.tokens):
                leaf.payload = self.split(leaf.payload, len(leaf.tokens) - excess)[0]
                del leaf.tokens[len(leaf.tokens) - excess :]
                self.size -= excess
                break
            parent = cast(Node[P], leaf.parent)  # a leaf is below the root
            del parent.children[leaf.tokens[0]]
            self.size -= len(leaf.tokens)
            if parent is not self._root and not parent.children and not parent.pins:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def clear(self) -> None:
        """Drop everything, pinned nodes too (a payload lives on while a caller holds its node). Each node
        lets go of its children first: a parent and its children refer to each other, so a dropped tree
        would wait for Python's cyclic garbage collector, payloads and all (the engine's keys and values:
        +150 MB of a rollout server's memory over 20 weight updates, bench/results/run_memory-calculator-*)."""
        for node in [self._root, *self._nodes()]:
            node.children = {}
        self._root, self.size, self.epoch = _root(), 0, self.epoch + 1

    def _split(self, node: Node[P], k: int) -> Node[P]:
        """Cut ``node`` after its first k tokens: a new node holds those, above ``node`` (which keeps
        its identity, pins and children); the new one is returned."""
        head_payload, node.payload = self.split(node.payload, k)
        parent = cast(Node[P], node.parent)
        head = Node(node.tokens[:k], head_payload, node.start, parent, {node.tokens[k]: node}, node.used, node.pins)
        parent.children[node.tokens[0]] = head
        node.tokens, node.start, node.parent = node.tokens[k:], node.start + k, head
        return head

    def _use(self, node: Node[P]) -> None:
        tick = next(self._clock)
        for on_path in _path(node):
            on_path.used = tick

    def _nodes(self) -> Iterator[Node[P]]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node


def _root() -> Node:
    return Node([], None, 0)


def low_mark(budget: int) -> int:
    """What ``evict`` leaves of a tree past its budget."""
    return budget - budget // 8


def _path(node: Node) -> Iterator[Node]:
    """``node`` and its ancestors, the root excluded."""
    while node.parent is not None:
        yield node
        node = node.parent


def _common_length(run: list[int], tokens: list[int], at: int) -> int:
    """How many of ``run``'s tokens ``tokens`` repeats from position ``at``: slice comparisons, whole first
    (a conversation's earlier turns match whole), then by bisection."""
    if tokens[at : at + len(run)] == run:
        return len(run)
    low, high = 0, min(len(run), len(tokens) - at)  # run[:low] matches, run[:high + 1] does not
    while low < high:
        middle = (low + high + 1) // 2
        if tokens[at : at + middle] == run[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
