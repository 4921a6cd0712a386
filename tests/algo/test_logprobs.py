"""``algo.logprobs.token_logprobs``, the chunked log-softmax every path shares, against the whole log-softmax
in float64: logprobs, entropies and the gradients of every input, on logits already computed (the Megatron
engine's) or through an LM head (hidden states, weight, bias; softcapped as Gemma's), for chunk sizes that
divide the rows or not, one row, none, and logits far apart. The vocabulary-parallel sums run on tp2 in
tests/engines/test_megatron.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.logprobs import token_logprobs

SOFTCAP = 30.0


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 30),
    vocab=st.integers(2, 150),
    chunk_rows=st.integers(1, 40),
    scale=st.sampled_from([1.0, 1e3]),  # 1e3: logits thousands apart, one token takes all the mass
    per_row=st.booleans(),
    form=st.sampled_from(["logits", "head", "softcapped head"]),
    with_entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_logprobs_and_gradients_equal_the_whole_log_softmax(
    rows, vocab, chunk_rows, scale, per_row, form, with_entropy, seed
):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    leaves = randn(rows, 8), randn(vocab, 8), randn(vocab)
    hidden, weight, bias = leaves[0] * scale, *leaves[1:]
    temperatures = 0.3 + torch.rand(rows, 1, generator=generator, dtype=torch.float64) if per_row else 0.7
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    upstream = torch.randn(rows, generator=generator, dtype=torch.float64)
    softcap = SOFTCAP if form == "softcapped head" else None
    logits = F.linear(hidden, weight, bias)
    logits = torch.tanh(logits / softcap) * softcap if softcap else logits
    options = dict(chunk_bytes=4 * vocab * chunk_rows, entropy=with_entropy)
    if form == "logits":  # their gradient passes on to the head's tensors by autograd
        logprobs, entropy = token_logprobs(logits, tokens, temperatures, **options)
    else:
        logprobs, entropy = token_logprobs(
            hidden, tokens, temperatures, weight=weight, bias=bias, softcap=softcap, **options
        )
    chunked = torch.autograd.grad((logprobs * upstream).sum(), leaves, retain_graph=True)
    whole = torch.log_softmax(logits / temperatures, -1)
    expected = whole.gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected.detach())
    expected_entropy = -(whole.exp() * whole).sum(-1).detach()
    torch.testing.assert_close(entropy, expected_entropy if with_entropy else expected_entropy[:0])
    assert not entropy.requires_grad
    for got, want in zip(chunked, torch.autograd.grad((expected * upstream).sum(), leaves)):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # the same values without the graph
        again, _ = token_logprobs(logits, tokens, temperatures, **options)
    torch.testing.assert_close(again, logprobs.detach())


def test_logits_of_a_narrower_dtype_are_computed_in_float32():
    """bf16 logits (Megatron's in bf16, or a head's under autocast): the log-softmax in float32, the gradient
    back in the logits' dtype."""
    logits = (torch.randn(5, 300, dtype=torch.float64) * 4).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 300, (5,))
    logprobs, _ = token_logprobs(logits, tokens, chunk_bytes=4 * 300 * 2)
    logprobs.sum().backward()
    whole = torch.log_softmax(logits.detach().float(), -1)
    assert logprobs.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs, whole.gather(-1, tokens[:, None])[:, 0])
    expected = F.one_hot(tokens, 300) - whole.exp()
    torch.testing.assert_close(logits.grad.float(), expected, atol=1e-2, rtol=1e-2)


def test_a_head_under_autocast_takes_the_gradients_autograd_takes_through_it():
    """A float32 head under bf16 autocast (the torch engine's mixed precision): the products in bf16 forward and
    backward as autocast runs them, the gradients back in float32, as autograd gives them through the whole
    log-softmax (to bf16 rounding of the products)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(70, 32, generator=generator, requires_grad=True)
    weight = torch.randn(500, 32, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 500, (70,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = token_logprobs(hidden, tokens, 0.7, weight=weight, chunk_bytes=4 * 500 * 16)
        chunked = torch.autograd.grad(logprobs.sum(), (hidden, weight))
        whole = torch.log_softmax(F.linear(hidden, weight).float() / 0.7, -1).gather(-1, tokens[:, None])
        expected = torch.autograd.grad(whole.sum(), (hidden, weight))
    torch.testing.assert_close(logprobs, whole[:, 0].detach())
    for got, want in zip(chunked, expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
