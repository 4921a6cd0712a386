"""``models.segment_forward`` (tree training's written-out decoder forward on a CPU) against the model's own
Hugging Face forward over a cache, in float64: hidden states, every layer's keys and values, and the
gradients of every parameter and of the prefix's keys and values, for Qwen2 (q/k/v biases) and Qwen3
(per-head q/k norms, head_dim not hidden/heads), with no prefix, a whole prefix and prefixes padded per
row; and where it does not apply (LoRA, experts, a sliding window, attention dropout)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    DynamicCache,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from areal_hpc.config import LoRAConfig
from areal_hpc.engines.torch.lora import add_adapters
from areal_hpc.models.segment_forward import segment_forward, supports_segment_forward

SHAPE = dict(
    vocab_size=50,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
)


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    else:  # head_dim 16: not hidden_size / heads (8)
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))
    for p in model.parameters():  # norms away from 1, biases away from 0: each term of the maths shows
        p.data.normal_(0.0, 0.3)
    return model.double()


def reference(model, tokens, positions, prefix, valid):
    """The model's own forward over a Hugging Face cache holding ``prefix``, with a padding mask."""
    cache, mask = DynamicCache(config=model.config), None
    if prefix is not None:
        for layer, (keys, values) in enumerate(prefix):
            cache.update(keys, values, layer)
        mask = torch.cat([valid, torch.ones_like(tokens, dtype=torch.bool)], 1).long()
    hidden = model.base_model(
        input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True
    ).last_hidden_state
    return hidden, [(layer.keys, layer.values) for layer in cache.layers]


def prefix_of(model, rows: int, length: int, generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, config.num_key_value_heads, length, head_dim)
    return [
        tuple(torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(2))
        for _ in range(config.num_hidden_layers)
    ]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 6),
    prefix_length=st.integers(0, 5),
    padded=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_equals_the_models_own_forward_and_gradients(kind, rows, length, prefix_length, padded, seed):
    model = model_of(kind)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHAPE["vocab_size"], (rows, length), generator=generator)
    prefix = valid = None
    if prefix_length:
        prefix = prefix_of(model, rows, prefix_length, generator)
        owned = (
            torch.randint(1, prefix_length + 1, (rows,), generator=generator)
            if padded
            else torch.full((rows,), prefix_length)
        )
        valid = torch.arange(prefix_length) < owned[:, None]
    else:
        owned = torch.zeros(rows, dtype=torch.long)
    positions = owned[:, None] + torch.arange(length)
    weights = torch.randn(rows, length, SHAPE["hidden_size"], generator=generator, dtype=torch.float64)

    results = []
    for forward in (reference, lambda *args: segment_forward(*args, torch.float64)):
        model.zero_grad()
        leaves = [t for kv in prefix or [] for t in kv]
        for t in leaves:
            t.grad = None
        hidden, states = forward(model, tokens, positions, prefix, valid)
        key_weights = [
            torch.randn(k.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            for i, (k, _) in enumerate(states)
        ]
        loss = (hidden * weights).sum() + sum((k * w).sum() + (v * w).sum() for (k, v), w in zip(states, key_weights))
        loss.backward()
        results.append(
            (
                hidden.detach(),
                [(k.detach(), v.detach()) for k, v in states],
                {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
                [t.grad.clone() for t in leaves],
            )
        )
    (h0, s0, g0, l0), (h1, s1, g1, l1) = results
    torch.testing.assert_close(h1, h0, rtol=1e-10, atol=1e-10)
    for (k0, v0), (k1, v1) in zip(s0, s1):
        torch.testing.assert_close(k1, k0, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-10)
    assert g1.keys() == g0.keys() and len(g0) == len(list(model.parameters())) - 1  # all but the unused LM head
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-9, msg=name)
    for a, b in zip(l1, l0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_applies_to_plain_dense_models_only():
    assert supports_segment_forward(model_of("qwen2")) and supports_segment_forward(model_of("qwen3"))
    assert not supports_segment_forward(Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True)))
    assert not supports_segment_forward(Qwen2ForCausalLM(Qwen2Config(**SHAPE, attention_dropout=0.1)))
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
    assert not supports_segment_forward(moe)
    lora = model_of("qwen2")
    add_adapters(lora, LoRAConfig(rank=2, target_modules=["v_proj"]))  # the engine's own LoRA (peft, in place)
    assert not supports_segment_forward(lora)


def test_a_module_with_forward_hooks_runs_its_own_forward():
    """FSDP2 and ``replicate`` gather and free parameters in their modules' forward hooks."""
    model = model_of("qwen2")
    model.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: None)
    assert not supports_segment_forward(model)
