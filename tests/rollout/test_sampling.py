"""The vectorised sampler: top-k/top-p keep what a plain per-row filter keeps, draws follow the truncated
distribution, logprobs are those of the whole tempered distribution, rows do not disturb each other, a
request's draws depend on its seed and positions only (checked against SplitMix64 written from its
definition in plain Python integers), and the largest parameters the engine admits fit the sampler's tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from areal_hpc.rollout.sampling import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, SlotSampler, seeded_uniform, truncate


def kept_by_reference(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row, the obvious way: zero below the k-th largest, then cut the sorted tail past top_p."""
    probs = probs.clone()
    if top_k > 0:
        probs[probs < torch.topk(probs, min(top_k, len(probs))).values[-1]] = 0
    if top_p < 1:
        ordered, order = probs.sort(descending=True, stable=True)
        probs[order[ordered.cumsum(0) - ordered > top_p]] = 0
    return probs > 0


# rows of unnormalised weights from a small set of values, so ties and zeros are common
rows = st.integers(1, 12).flatmap(
    lambda vocab: st.lists(
        st.lists(
            st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.2, 1 / 3, 0.5, 1.0, 2.0]), min_size=vocab, max_size=vocab
        ).filter(any),
        min_size=1,
        max_size=6,
    )
)


@settings(deadline=None, max_examples=300)
@given(rows=rows, data=st.data())
def test_vectorised_top_k_top_p_keeps_the_same_tokens_as_a_per_row_filter(rows, data):
    probs = torch.tensor(rows)
    probs /= probs.sum(dim=-1, keepdim=True)
    top_k = data.draw(st.lists(st.sampled_from([-1, 1, 2, 3, 5, 20]), min_size=len(rows), max_size=len(rows)))
    drawn_p = data.draw(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 1.0)), min_size=len(rows), max_size=len(rows)))
    for top_p in (drawn_p, [1.0] * len(rows)):  # the second: top-k alone, which takes no sort
        kept = truncate(probs, torch.tensor([max(k, 0) for k in top_k]), torch.tensor(top_p)) > 0
        expected = torch.stack([kept_by_reference(p, k, q) for p, k, q in zip(probs, top_k, top_p)])
        assert torch.equal(kept, expected)


def sampler_with(rows: list[tuple[float, int, float]], seed: int = 0) -> SlotSampler:
    sampler = SlotSampler(len(rows), torch.device("cpu"), seed)
    for row, (temperature, top_k, top_p) in enumerate(rows):
        sampler.set(row, temperature, top_k, top_p)
    return sampler


def test_draws_follow_the_truncated_tempered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
    temperature, top_k, top_p, n = 0.8, 5, 0.9, 40_000
    tempered = torch.softmax(logits / temperature, dim=-1)
    kept = kept_by_reference(tempered, top_k, top_p)
    assert 1 < int(kept.sum()) < top_k  # both filters matter here
    expected = tempered * kept / (tempered * kept).sum()
    tokens, logprobs, finite = sampler_with([(temperature, top_k, top_p)] * n).sample(logits.expand(n, -1), 0)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert finite.all() and counts[~kept].sum() == 0
    statistic = ((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum()
    assert statistic < chi2.ppf(1 - 1e-6, int(kept.sum()) - 1)
    # reported logprobs: the whole tempered distribution, not the truncated one
    assert torch.allclose(logprobs, torch.log(tempered)[tokens], atol=1e-6)


def test_rows_with_different_parameters_in_one_batch_do_not_disturb_each_other():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[3] = float("nan")
    sampler = sampler_with([(0.0, -1, 1.0), (1.0, 1, 1.0), (0.7, -1, 1e-6), (1.3, 10, 0.5), (1.0, -1, 1.0)])
    tokens, logprobs, finite = sampler.sample(logits, 0)
    assert finite.tolist() == [True, True, True, False, True]
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()  # greedy, and top-k 1
    assert tokens[2] == logits[2].argmax()  # top-p below the largest probability keeps only it
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1).max())  # greedy: logprobs at T = 1
    assert torch.allclose(logprobs[2], torch.log_softmax(logits[2] / 0.7, -1).max())
    # the rows' parameters follow a row that moves (as the engine moves a request into a freed row)
    sampler.move_rows([1], [4])
    assert sampler.sample(logits[[0, 1, 2, 0, 4]], 0)[0][4] == logits[4].argmax()


def test_the_same_seed_draws_the_same_tokens():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    draws = [sampler_with([(1.0, -1, 0.95)] * 8, seed=3).sample(logits, 0)[0] for _ in range(2)]
    assert torch.equal(*draws)


def test_the_largest_parameters_the_engine_admits_fit_the_sampler_and_larger_ones_do_not():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 3
    # top_p 5e-324 is 0 in float32: the most probable token only, as top_p -> 0 would keep
    sampler = sampler_with([(MAX_TEMPERATURE, MAX_TOP_K, 1.0), (1.0, MAX_TOP_K, 0.5), (1.0, -1, 5e-324)])
    tokens, logprobs, finite = sampler.sample(logits, 0)
    assert finite.all() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logprobs[0], torch.tensor(-math.log(50)))  # T = float32's max: uniform
    for temperature, top_k in [(math.nextafter(MAX_TEMPERATURE, math.inf), -1), (1.0, MAX_TOP_K + 1)]:
        with pytest.raises((RuntimeError, ValueError), match="(?i)overflow"):  # torch's words for "does not fit"
            sampler.set(0, temperature, top_k, 1.0)


def splitmix64_uniform(seed: int, position: int) -> float:
    """SplitMix64 (Steele, Lea and Flood 2014) in Python integers modulo 2**64: the output for state
    seed + (position + 1)·0x9E3779B97F4A7C15, its top 53 bits as a number in (0, 1]."""
    mask = (1 << 64) - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 11) + 1) / 2.0**53


@settings(deadline=None, max_examples=300)
@given(
    pairs=st.lists(
        st.tuples(
            st.one_of(st.integers(0, MAX_SEED), st.sampled_from([0, 1, MAX_SEED])),
            st.one_of(st.integers(0, 1 << 40), st.sampled_from([0, 1, (1 << 62)])),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_seeded_uniforms_are_splitmix64_at_any_seed_and_position(pairs):
    seeds, positions = torch.tensor([s for s, _ in pairs]), torch.tensor([p for _, p in pairs])
    got = seeded_uniform(seeds, positions).tolist()
    assert got == [splitmix64_uniform(s, p) for s, p in pairs]
    assert all(0 < u <= 1 for u in got)


def test_seeded_uniforms_are_uniform():
    n, bins = 200_000, 64
    u = seeded_uniform(torch.arange(n) * 7919 % 1013, torch.arange(n) // 1013)
    counts = torch.bincount(((u * bins).ceil().long() - 1).clamp(0, bins - 1), minlength=bins).double()
    statistic = ((counts - n / bins) ** 2 / (n / bins)).sum()
    assert statistic < chi2.ppf(1 - 1e-6, bins - 1)


@settings(deadline=None, max_examples=100)
@given(data=st.data(), seed=st.integers(0, MAX_SEED), start=st.integers(0, 500), steps=st.integers(1, 6))
def test_a_seeded_requests_tokens_do_not_depend_on_its_row_or_its_neighbours(data, seed, start, steps):
    """The same request alone in row 0, or in any row among other requests (seeded or not), or resumed
    part-way (its earlier tokens in the prompt, as after an interruption), draws the same tokens."""
    vocab = 30
    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(seed % 1000)) * 2
    params = (1.0, data.draw(st.sampled_from([-1, 5])), data.draw(st.sampled_from([1.0, 0.9])))
    alone = SlotSampler(1, torch.device("cpu"))
    alone.set(0, *params, seed, start)
    expected = [int(alone.sample(logits[i : i + 1], 0)[0]) for i in range(steps)]
    others = data.draw(st.integers(0, 5))
    row = data.draw(st.integers(0, others))
    crowd = SlotSampler(others + 1, torch.device("cpu"), seed=data.draw(st.integers(0, 9)))
    for r in range(others + 1):
        if r == row:
            crowd.set(r, *params, seed, start)
        else:
            crowd.set(r, 1.0, -1, 1.0, data.draw(st.one_of(st.none(), st.integers(0, MAX_SEED))), 0)
    noise = torch.randn(others + 1, vocab)
    got = []
    for i in range(steps):
        batch = noise.clone()
        batch[row] = logits[i]
        got.append(int(crowd.sample(batch, 0)[0][row]))
    assert got == expected
    cut = data.draw(st.integers(0, steps - 1))  # resumed after ``cut`` tokens: a new request, a longer prompt
    resumed = SlotSampler(1, torch.device("cpu"))
    resumed.set(0, *params, seed, start + cut)
    assert [int(resumed.sample(logits[i : i + 1], 0)[0]) for i in range(cut, steps)] == expected[cut:]
