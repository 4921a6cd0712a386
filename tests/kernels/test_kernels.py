"""The Triton kernels of kernels/ against their plain-torch references, values and gradients, on random
small shapes on the CPU under Triton's interpreter; the attention reference against dense-mask sdpa over
the whole sequence, the log-prob reference against the trainer's chunked code; bench/kernels_gpu.py's
dry run.

Tolerances (float32, |a - b| <= atol + rtol·|b|): attention values and gradients atol 2e-5, rtol 1e-4
(measured up to ~2e-6); log-probs and entropies atol 5e-5, their gradients atol 1e-4, rtol 1e-4 (measured
up to ~6e-6 and ~5e-5)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from areal_hpc._kernels import segment_attention as attention
from areal_hpc._kernels import target_logprobs as logprobs

REPO = Path(__file__).resolve().parents[2]
ATTENTION_TOLERANCE = dict(atol=2e-5, rtol=1e-4)
LOGPROB_TOLERANCE = dict(atol=5e-5, rtol=1e-4)
LOGPROB_GRAD_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def attention_inputs(seed: int, length: int, prefix: int, kv_heads: int, group: int, dim: int) -> list[torch.Tensor]:
    """q [S, H, D], k/v_prefix [P, H_kv, D], k/v_seg [S, H_kv, D], float32, requiring gradients."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (length, kv_heads * group, dim),
        (prefix, kv_heads, dim),
        (prefix, kv_heads, dim),
        (length, kv_heads, dim),
        (length, kv_heads, dim),
    ]
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]


def values_and_gradients(function, inputs: list[torch.Tensor], upstream) -> tuple[list, list]:
    """(outputs, input gradients) of sum(output · upstream) for fresh copies of ``inputs``."""
    copies = [x.detach().clone().requires_grad_() for x in inputs]
    outputs = function(*copies)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum((o * u).sum() for o, u in zip(outputs, upstream)).backward()
    return [o.detach() for o in outputs], [x.grad for x in copies]


shapes = dict(
    seed=st.integers(0, 2**16),
    length=st.integers(1, 48),
    prefix=st.integers(0, 48),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    dim=st.sampled_from([16, 32]),
)


@settings(max_examples=30, deadline=None)
@given(**shapes, blocks=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]), scale=st.sampled_from([None, 0.3]))
def segment_attention_matches_the_reference(seed, length, prefix, kv_heads, group, dim, blocks, scale):
    """Small blocks put several query and key blocks in play (the diagonal, the first query block a key
    block reaches), unequal ones a diagonal that cuts through a block."""
    inputs = attention_inputs(seed, length, prefix, kv_heads, group, dim)
    upstream = [torch.randn(length, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 1))]
    with mock.patch.multiple(attention, BLOCK_M=blocks[0], BLOCK_N=blocks[1]):
        got = values_and_gradients(lambda *x: attention.segment_attention(*x, scale=scale), inputs, upstream)
    expected = values_and_gradients(lambda *x: attention.segment_attention_reference(*x, scale=scale), inputs, upstream)
    for a, b in zip(got[0] + got[1], expected[0] + expected[1]):
        torch.testing.assert_close(a, b, **ATTENTION_TOLERANCE)


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_the_attention_reference_is_causal_attention_over_the_whole_sequence(
    seed, length, prefix, kv_heads, group, dim
):
    """The last S rows of causal attention over the P + S tokens, by sdpa with a dense boolean mask."""
    q_all = torch.randn(prefix + length, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed))
    _, k_prefix, v_prefix, k_seg, v_seg = attention_inputs(seed + 1, length, prefix, kv_heads, group, dim)
    upstream = [torch.randn(length, kv_heads * group, dim)]

    def dense(q, k_prefix, v_prefix, k_seg, v_seg):
        total = prefix + length
        mask = torch.ones(total, total, dtype=torch.bool).tril()
        keys, values = torch.cat([k_prefix, k_seg]).transpose(0, 1), torch.cat([v_prefix, v_seg]).transpose(0, 1)
        queries = torch.cat([q_all[:prefix], q]).transpose(0, 1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=group > 1)
        return out.transpose(0, 1)[prefix:]

    inputs = [q_all[prefix:], k_prefix, v_prefix, k_seg, v_seg]
    got = values_and_gradients(attention.segment_attention_reference, inputs, upstream)
    expected = values_and_gradients(dense, inputs, upstream)
    for a, b in zip(got[0] + got[1], expected[0] + expected[1]):
        torch.testing.assert_close(a, b, **ATTENTION_TOLERANCE)


def logprob_inputs(seed: int, rows: int, hidden: int, vocabulary: int, per_row: bool):
    generator = torch.Generator().manual_seed(seed)
    temperatures = torch.rand(rows, generator=generator) + 0.5 if per_row else 0.7
    return (
        torch.randn(rows, hidden, generator=generator),
        torch.randn(vocabulary, hidden, generator=generator) * 0.5,
        torch.randint(0, vocabulary, (rows,), generator=generator),
        temperatures,
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 40),
    hidden=st.sampled_from([16, 32]),
    vocabulary=st.integers(2, 300),
    per_row=st.booleans(),
    chunk_rows=st.integers(1, 40),
    block_v=st.sampled_from([64, 2048]),
)
def target_logprobs_entropy_matches_the_reference(seed, rows, hidden, vocabulary, per_row, chunk_rows, block_v):
    """Any number of row chunks, vocabulary tiles shorter and longer than the vocabulary; gradients of both
    outputs."""
    hidden_states, weight, tokens, temperatures = logprob_inputs(seed, rows, hidden, vocabulary, per_row)
    upstream = [torch.randn(rows), torch.randn(rows)]
    with mock.patch.object(logprobs, "BLOCK_V", block_v):
        got = values_and_gradients(
            lambda h, w: logprobs.target_logprobs_entropy(
                h, w, tokens, temperatures, chunk_bytes=chunk_rows * 4 * vocabulary
            ),
            [hidden_states, weight],
            upstream,
        )
    expected = values_and_gradients(
        lambda h, w: logprobs.target_logprobs_entropy_reference(h, w, tokens, temperatures),
        [hidden_states, weight],
        upstream,
    )
    for a, b in zip(got[0], expected[0]):
        torch.testing.assert_close(a, b, **LOGPROB_TOLERANCE)
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, **LOGPROB_GRAD_TOLERANCE)


@pytest.mark.parametrize(
    "check", [segment_attention_matches_the_reference, target_logprobs_entropy_matches_the_reference]
)
def test_kernel_matches_its_reference_under_the_interpreter(check):
    """In a fresh Python with TRITON_INTERPRET=1: triton reads it when first imported (its own library
    functions are defined then), and the rest of the suite imports triton long before this module."""
    call = f"from tests.kernels.test_kernels import {check.__name__}; {check.__name__}()"
    done = subprocess.run(
        [sys.executable, "-c", call],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-6000:]


def test_the_logprob_reference_is_the_trainers_math():
    from areal_hpc.engines.torch.outputs import target_logprobs

    hidden, weight, tokens, temperatures = logprob_inputs(0, 33, 16, 257, per_row=True)
    head = torch.nn.Linear(16, 257, bias=False)
    head.weight.data = weight
    expected = target_logprobs(hidden, head, tokens, temperatures[:, None], chunk_bytes=4 * 257 * 10)
    got = logprobs.target_logprobs_entropy_reference(hidden, weight, tokens, temperatures)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 2, 16), (3, 2, 16), (3, 2, 16), (5, 2, 16), (5, 2, 16)), "needs k/v_seg [4, H_kv, 16]"),
        (((4, 3, 16), (3, 2, 16), (3, 2, 16), (4, 2, 16), (4, 2, 16)), "H = 3 a multiple of H_kv"),
        (((4, 2, 16), (3, 2, 16), (2, 2, 16), (4, 2, 16), (4, 2, 16)), "keys and values differ in shape"),
    ],
)
def test_segment_attention_names_a_shape_mistake(shapes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        attention.segment_attention(*(torch.zeros(shape) for shape in shapes))


def test_bench_dry_run(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/kernels_gpu.py", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "kernels_gpu.json").read_text())["rows"]
    assert {(r["kernel"], r["implementation"]) for r in rows} >= {
        ("segment_attention", "triton"),
        ("target_logprobs", "triton"),
    }
    assert all("error" not in r and r["max_abs_error"] < 1e-4 and r["max_abs_grad_error"] < 1e-4 for r in rows), rows
    assert "| segment_attention |" in (tmp_path / "kernels_gpu.md").read_text()
