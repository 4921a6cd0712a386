"""The vectorised sampler: top-k/top-p keep what a plain per-row filter keeps, draws follow the truncated
distribution, logprobs are those of the whole tempered distribution, rows do not disturb each other, and
the largest parameters the engine admits fit the sampler's tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from areal_hpc.rollout.sampling import MAX_TEMPERATURE, MAX_TOP_K, SlotSampler, truncate


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
rows = st.integers(1, 12).flatmap(lambda vocab: st.lists(st.lists(
    st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.2, 1 / 3, 0.5, 1.0, 2.0]), min_size=vocab, max_size=vocab).filter(any),
    min_size=1, max_size=6))


@settings(deadline=None, max_examples=300)
@given(rows=rows, data=st.data())
def test_vectorised_top_k_top_p_keeps_the_same_tokens_as_a_per_row_filter(rows, data):
    probs = torch.tensor(rows)
    probs /= probs.sum(dim=-1, keepdim=True)
    top_k = data.draw(st.lists(st.sampled_from([-1, 1, 2, 3, 5, 20]), min_size=len(rows), max_size=len(rows)))
    top_p = data.draw(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 1.0)), min_size=len(rows), max_size=len(rows)))
    for top_p in (top_p, [1.0] * len(rows)):  # the second: top-k alone, which takes no sort
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
    sampler.move(1, 4)
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
