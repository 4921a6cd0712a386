"""The prefix tree of a training batch (``algo.prefix_tree``): every sequence comes back from its path,
every position lies in exactly one node, shared prefixes are stored once (hypothesis over batches with
shared prefixes, sequences that are prefixes of others, duplicates and one-token sequences)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.errors import UserError


@st.composite
def shared_prefix_batches(draw, vocab: int = 4, max_sequences: int = 8) -> list[list[int]]:
    """Sequences each grown from a prefix of an earlier one (cut anywhere, whole included) plus new
    tokens (possibly none: a prefix of another, or a duplicate); a small vocabulary adds chance sharing."""
    token = st.integers(0, vocab - 1)
    sequences = [draw(st.lists(token, min_size=1, max_size=6))]
    for _ in range(draw(st.integers(0, max_sequences - 1))):
        base = draw(st.sampled_from(sequences))
        prefix = base[: draw(st.integers(0, len(base)))]
        sequences.append(prefix + draw(st.lists(token, min_size=0 if prefix else 1, max_size=5)))
    return sequences


@settings(max_examples=300, deadline=None)
@given(shared_prefix_batches(), st.sampled_from([0, 0, 1, 2, 3, 5, 8, 64]))
def test_paths_give_back_every_sequence_and_each_position_lies_in_one_node(sequences, min_saved_tokens):
    tree = build_prefix_tree(sequences, min_saved_tokens)
    assert [tree.sequence(i) for i in range(len(sequences))] == sequences
    assert tree.n_sequence_tokens == sum(map(len, sequences))
    assert tree.n_tokens <= tree.n_sequence_tokens and tree.compression >= 1.0
    covered = set()
    for n, node in enumerate(tree.nodes):
        assert node.parent < n  # pre-order: parents first
        assert node.start == (tree.nodes[node.parent].stop if node.parent >= 0 else 0)
        for s in node.sequences:  # a field of s sliced [start, stop) is this node's tokens' field
            assert sequences[s][node.start : node.stop] == node.tokens
            covered |= {(s, t) for t in range(node.start, node.stop)}
    assert covered == {(i, t) for i, s in enumerate(sequences) for t in range(len(s))}
    for i, s in enumerate(sequences):
        for t, token in enumerate(s):
            node, offset = tree.locate(i, t)
            assert tree.nodes[node].tokens[offset] == token and i in tree.nodes[node].sequences


@settings(max_examples=200, deadline=None)
@given(shared_prefix_batches())
def test_the_trie_is_compressed(sequences):
    """Siblings start with different tokens, and a node with one child is where some sequence ends
    (else the two would be one segment): each distinct prefix is stored once."""
    tree = build_prefix_tree(sequences)
    distinct = {tuple(s[:t]) for s in sequences for t in range(1, len(s) + 1)}
    assert tree.n_tokens == len(distinct)
    ends = {tree.paths[i][-1] for i in range(len(sequences))}
    for parents in [tree.roots, *(node.children for node in tree.nodes)]:
        firsts = [tree.nodes[c].tokens[0] for c in parents]
        assert len(firsts) == len(set(firsts))
    for n, node in enumerate(tree.nodes):
        assert len(node.children) != 1 or n in ends
        assert node.children or n in ends


def exact_trie_tokens(sequences: list[list[int]], depth: int) -> int:
    """Tokens of the exact trie of ``sequences`` from ``depth`` on (0 where nothing is left)."""
    rest = [s[depth:] for s in sequences if len(s) > depth]
    return build_prefix_tree(rest).n_tokens if rest else 0


@settings(max_examples=300, deadline=None)
@given(shared_prefix_batches(), st.integers(0, 12), st.sampled_from([0, 0, 4, 12, 1000]))
def test_a_node_is_shared_only_where_it_saves_min_saved_tokens_or_fits_a_row(
    sequences, min_saved_tokens, shared_within
):
    """Every node with two or more branches (children, and the sequences that end at it) saves its
    length x (branches - 1) >= min_saved_tokens, or its subtree (the exact trie of its sequences from
    its start) holds at most ``shared_within`` tokens and it saves at least what it widens a row (the
    branches' exact tries but the largest); the tree holds at least the exact trie's tokens (what it
    does not share is recomputed), and with min_saved_tokens <= 1 it is the exact trie."""
    tree = build_prefix_tree(sequences, min_saved_tokens, shared_within)
    ends = {path[-1] for path in tree.paths}
    for n, node in enumerate(tree.nodes):
        branches = len(node.children) + (n in ends)
        saved = len(node.tokens) * (branches - 1)
        if branches >= 2 and saved < min_saved_tokens:  # then it fits a row: its branches as it was made
            through = [sequences[s] for s in node.sequences]  # (a branch not made later splits into children)
            by_next: dict[int, list[list[int]]] = {}
            for sequence in (q for q in through if len(q) > node.stop):
                by_next.setdefault(sequence[node.stop], []).append(sequence)
            below = [exact_trie_tokens(group, node.stop) for group in by_next.values()] + [0] * (n in ends)
            assert exact_trie_tokens(through, node.start) <= shared_within
            assert len(node.tokens) * (len(below) - 1) >= sum(below) - max(below)
    exact = build_prefix_tree(sequences)
    assert tree.n_tokens >= exact.n_tokens
    if min_saved_tokens <= 1:  # any node saves at least one token computation: the exact trie
        assert [(node.tokens, node.start) for node in tree.nodes] == [(node.tokens, node.start) for node in exact.nodes]


def test_a_groups_prompt_is_shared_within_a_row_and_two_groups_over_a_shared_token_are_not():
    """With sharing free within a 512-token row: a group's 17-token prompt over its two distinct answers
    (5 and 3 samples) is a node although it saves fewer than 64 token computations; the 2 tokens two
    groups' prompts begin with are not (a row of both groups would be twice as wide for 2 tokens)."""
    groups = [[1, 2, *range(10, 25)], [1, 2, *range(30, 45)]]
    sequences = [prompt + answer for prompt in groups for answer in [[7, 0]] * 5 + [[8, 0]] * 3]
    tree = build_prefix_tree(sequences, min_saved_tokens=64, shared_within=512)
    assert [node.tokens for node in tree.nodes] == [groups[0], [7, 0], [8, 0], groups[1], [7, 0], [8, 0]]
    assert len(build_prefix_tree(sequences, min_saved_tokens=64).nodes) == 4  # each prompt + answer a root


def test_short_answer_branches_of_a_group_are_recomputed_and_its_prompt_shared():
    """A GRPO group's answers that share one or two tokens ("1" of "12" and "17") would be a level
    each; with min_saved_tokens 8 only the 20-token prompt is a node of its own."""
    prompt = list(range(100, 120))
    answers = [[1, 2, 0], [1, 7, 0], [1, 7, 0], [3, 0]]
    tree = build_prefix_tree([prompt + a for a in answers], min_saved_tokens=8)
    assert [node.tokens for node in tree.nodes] == [prompt, [1, 2, 0], [1, 7, 0], [3, 0]]
    assert [node.sequences for node in tree.nodes] == [[0, 1, 2, 3], [0], [1, 2], [3]]
    assert len(build_prefix_tree([prompt + a for a in answers]).nodes) == 5  # [1] is a level of its own


def test_grpo_groups_compress_by_their_shared_prompt():
    prompt = list(range(100, 140))
    group = [prompt + [1000 + 20 * k + t for t in range(20)] for k in range(8)]  # 8 samples, 40-token prompt
    tree = build_prefix_tree(group)
    assert tree.n_tokens == 40 + 8 * 20
    assert tree.compression == pytest.approx(8 * 60 / 200)  # 2.4


def test_a_sequence_that_is_a_prefix_of_another_ends_at_an_internal_node():
    tree = build_prefix_tree([[1, 2, 3, 4], [1, 2], [1, 2, 5]])
    assert [node.tokens for node in tree.nodes] == [[1, 2], [3, 4], [5]]
    assert tree.paths == [[0, 1], [0], [0, 2]]


@pytest.mark.parametrize("sequences, message", [([], "empty batch"), ([[1, 2], []], "sequence 1 with no tokens")])
def test_bad_batches_are_one_user_error(sequences, message):
    with pytest.raises(UserError, match=message):
        build_prefix_tree(sequences)
