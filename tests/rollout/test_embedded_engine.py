"""The embedded engine in-process: a forward pass that raises because of one row fails that row only.

A fault cannot be caused through the HTTP contract on a healthy model (requests are checked first),
so this test injects one into the decoder: the pass raises whenever a given token or position is in it.
"""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_model
from areal_hpc.rollout.decoder import FIRST_CAPACITY, SlotDecoder
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, SamplingParams, compacted, row_moves
from tests.conftest import small_gemma3, small_llama
from tests.rollout.test_server import PROMPT, teacher_forced_logprobs


def test_a_family_the_decoder_does_not_take_is_refused_by_name():
    config = MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    with pytest.raises(
        UserError, match=r"the embedded decoder takes qwen2, .*gemma3_text models, not 'mistral': serve"
    ):
        EmbeddedGenerator(MistralForCausalLM(config), slots=2, context_length=64)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("attn_logit_softcapping", "attn_logit_softcapping=50.0: transformers' forward, which the trainer runs,"),
        ("use_bidirectional_attention", "use_bidirectional_attention=True: it generates left to right"),
    ],
)
def test_a_gemma3_setting_the_decoder_does_not_apply_is_refused_by_name(setting, message):
    model = small_gemma3(97)
    setattr(model.config, setting, 50.0 if setting == "attn_logit_softcapping" else True)
    with pytest.raises(UserError, match=f"^the embedded decoder does not apply {message}"):
        EmbeddedGenerator(model, slots=2, context_length=64)


def test_a_forward_pass_that_raises_because_of_one_row_fails_that_request_only(tiny_model_dir):
    engine = EmbeddedGenerator(load_model(tiny_model_dir), slots=8, context_length=256)
    forward = engine.decoder._forward

    def faulty(tokens, positions, first_row):
        if (tokens == 400).any() or (positions == 30).any():
            raise RuntimeError("injected fault")
        return forward(tokens, positions, first_row)

    engine.decoder._forward = faulty
    prompts = {
        "fine-1": PROMPT,
        "fine-2": PROMPT[:3],
        "fine-3": PROMPT * 2,
        "prefill-culprit": PROMPT + [400],
        "decode-culprit": PROMPT * 5,
    }  # reaches position 30 decoding
    results, all_done = {}, threading.Event()

    def on_done(result):
        results[result.rid] = result
        if len(results) == len(prompts):
            all_done.set()

    for rid, prompt in prompts.items():  # queued together: one prefill over all five
        engine.submit(Request(rid, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True), on_done))
    try:
        assert all_done.wait(timeout=120)
    finally:
        engine.stop()
    for rid in ("prefill-culprit", "decode-culprit"):
        assert results[rid].error == f"RuntimeError: injected fault (output token {len(results[rid].output_ids)})"
    assert len(results["decode-culprit"].output_ids) == 6  # one from the prefill, five fed at positions 25..29
    for rid in ("fine-1", "fine-2", "fine-3"):
        result = results[rid]
        assert result.error is None and result.finish_reason == "length" and len(result.output_ids) == 20
        expected = teacher_forced_logprobs(tiny_model_dir, prompts[rid], result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


def small_qwen3(moe: bool = False) -> torch.nn.Module:
    shape = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_class(
        **shape, **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {})
    )
    torch.manual_seed(0)
    return model_class(config).eval()


def teacher_forced(model: torch.nn.Module, prompt: list[int], output_ids: list[int]) -> torch.Tensor:
    """log p(output token) at each position, from one forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


@pytest.mark.parametrize(
    "build",
    [
        lambda: small_qwen3(False),
        lambda: small_qwen3(True),
        lambda: small_llama(97, 128, 32, tied=True),
        lambda: small_llama(97, 128, 32, tied=False),
        lambda: small_gemma3(97),
    ],
    ids=["qwen3", "qwen3_moe", "llama3-tied", "llama3-untied", "gemma3"],
)
def test_each_familys_logprobs_equal_a_teacher_forced_pass(build):
    """Qwen3 normalises queries and keys per head; Qwen3-MoE's layers run their router and experts; Llama 3
    scales its rotary frequencies by band and may tie its head; Gemma 3 mixes sliding-window layers (6 tokens
    here) with a global one, each kind with its own RoPE base: the decoder's path for each, prompts of several
    lengths prefilled together (one longer than the window) and decoding side by side past the original context
    of 32. The first request is greedy: its tokens are the teacher-forced pass's argmax, its logprobs at T = 1."""
    model = build()
    engine = EmbeddedGenerator(model, slots=4, context_length=128, eos_token_ids=[])
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [3]]
    results, all_done = [], threading.Event()

    def on_done(result):
        results.append(result)
        if len(results) == len(prompts):
            all_done.set()

    for i, prompt in enumerate(prompts):
        engine.submit(
            Request(str(i), prompt, SamplingParams(max_new_tokens=6 + 14 * i, temperature=float(i > 0)), on_done)
        )
    try:
        assert all_done.wait(timeout=60)
    finally:
        engine.stop()
    for result in results:
        prompt = prompts[int(result.rid)]
        expected = teacher_forced(model, prompt, result.output_ids)
        assert result.error is None and torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)
        if result.rid == "0":
            with torch.no_grad():
                logits = model(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1 : -1]
            assert result.output_ids == logits.argmax(-1).tolist()


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.sampled_from([(3, 1, 4, 1, 5), (9, 2), (6, 5, 3, 5, 8, 9, 7, 9), (3,), (3, 1)]), min_size=1, max_size=8)
)
def test_a_prompt_that_comes_several_times_is_prefilled_once_and_each_row_samples_its_own(prompts):
    """A GRPO group's samples share their prompt: one prefill forward runs each distinct prompt once
    (its rows copy the keys and values), and every row then samples its own tokens, each token's
    logprob that of a teacher-forced pass over its own sequence."""
    model = small_qwen3()
    engine = EmbeddedGenerator(model, slots=8, context_length=128, eos_token_ids=[])
    forward, prefilled = engine.decoder._forward, []

    def counting(tokens, positions, first_row):
        if tokens.shape[1] > 1:  # a prefill (decode steps feed one token a row)
            prefilled.append(len(tokens))
        return forward(tokens, positions, first_row)

    engine.decoder._forward = counting
    results, all_done = {}, threading.Event()

    def on_done(result):
        results[result.rid] = result
        if len(results) == len(prompts):
            all_done.set()

    requests = [
        Request(str(i), list(p), SamplingParams(max_new_tokens=6, sampling_seed=i), on_done)
        for i, p in enumerate(prompts)
    ]
    try:
        engine.call(lambda: [engine.submit(r) for r in requests]).result(timeout=60)  # admitted in one prefill
        assert all_done.wait(timeout=60)
    finally:
        engine.stop()
    if max(map(len, prompts)) > 1:
        assert prefilled == [len(set(prompts))]
    for i, prompt in enumerate(prompts):
        result = results[str(i)]
        expected = teacher_forced(model, list(prompt), result.output_ids)
        assert result.error is None and torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)
    samples = [tuple(results[str(i)].output_ids) for i in range(len(prompts))]
    assert len(set(samples)) > 1 or len(prompts) == 1  # different seeds: not copies of one row


def test_the_kv_cache_grows_under_running_sequences_without_changing_what_they_decode(tiny_model_dir):
    """The cache starts at FIRST_CAPACITY columns per row and doubles when a sequence needs more:
    sequences already decoding keep their keys and values through each growth (to 128, then to the
    context length 256 here), checked against a teacher-forced pass of the Hugging Face model."""
    engine = EmbeddedGenerator(load_model(tiny_model_dir), slots=4, context_length=256, eos_token_ids=[])
    assert engine.decoder.capacity == FIRST_CAPACITY < 256
    requests = {
        "short": (PROMPT, 10),
        "past-64": (PROMPT * 2, 70),
        "past-128": (PROMPT, 150),
        "to-the-end": (PROMPT * 3, 256 - len(PROMPT) * 3),
    }
    results, all_done = {}, threading.Event()

    def on_done(result):
        results[result.rid] = result
        if len(results) == len(requests):
            all_done.set()

    for rid, (prompt, new_tokens) in requests.items():
        engine.submit(Request(rid, prompt, SamplingParams(max_new_tokens=new_tokens), on_done))
    try:
        assert all_done.wait(timeout=300)
    finally:
        engine.stop()
    assert engine.decoder.capacity == 256
    for rid, (prompt, new_tokens) in requests.items():
        result = results[rid]
        assert result.error is None and len(result.output_ids) == new_tokens
        expected = teacher_forced_logprobs(tiny_model_dir, prompt, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_compacting_keeps_each_running_row_once_and_moves_only_rows_beyond_the_new_count(case):
    count, finished = case
    kept = compacted(count, finished)
    assert sorted(kept) == sorted(set(range(count)) - finished)
    assert all(kept[row] == row for row in range(len(kept)) if row not in finished)


_MOVES_MODEL = small_qwen3()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda n: st.tuples(
            st.lists(st.lists(st.integers(1, 96), min_size=1, max_size=9), min_size=n, max_size=n),
            st.sets(st.integers(0, n - 1), max_size=n - 1),
        )
    )
)
def test_rows_moved_by_a_retirement_decode_as_they_did_in_their_old_rows(case):
    """Sequences of different lengths in rows 0..n-1, some finished: after ``move_rows`` each kept
    sequence's next-token logits in its new row equal those in its old row (its cache, length and last
    token moved with it)."""
    prompts, finished = case
    decoder = SlotDecoder(_MOVES_MODEL, slots=8, context_length=64)
    decoder.prefill(0, prompts)
    decoder.push(0, torch.tensor([(7 * i + 3) % 97 for i in range(len(prompts))]))
    before = decoder.decode(0, len(prompts))
    kept = compacted(len(prompts), finished)
    decoder.move_rows(*row_moves(kept))
    assert torch.allclose(decoder.decode(0, len(kept)), before[kept], atol=1e-5)
