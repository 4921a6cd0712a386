"""What Gemma 3's decoder has beyond Megatron-core's GPT layer, as layer-spec pieces and a hook:

- sandwich norms: Hugging Face normalises the attention output and the MLP output before each residual
  add. Here the row-parallel ``linear_proj`` and ``linear_fc2`` end in that norm (``post_layernorm``),
  applied to their output once reduced over the TP ranks (all-reduced: every rank normalises the whole
  hidden state; under sequence parallelism reduce-scattered: each its own tokens, the weight marked for
  the TP sum of its gradient as the other norms are).
- sliding-window layers rotate q and k at their own RoPE base (``rope_parameters["sliding_attention"]``),
  not at the global one GPTModel hands every layer; the window itself is the core attention's
  (``window_size``, ``window_attn_skip_freq`` in the ``TransformerConfig``).
- token embeddings are multiplied by sqrt(hidden) rounded to the model's dtype, as Hugging Face does.

The rest (the (1 + w) norms, gated GELU, attention scale, windows) is ``TransformerConfig``'s (``convert``).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention

from areal_hpc.engines.megatron.convert import ModelShape


@functools.cache
def with_output_norm(linear: type, norm: type) -> type:
    """``linear``, a row-parallel linear layer class, whose reduced output passes through ``norm``."""

    class OutputNormed(linear):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = norm(config, output_size, eps=config.layernorm_epsilon)

        def forward(self, x, *args, **kwargs):
            output, bias = super().forward(x, *args, **kwargs)
            return self.post_layernorm(output if bias is None else output + bias), None

    OutputNormed.__name__ = OutputNormed.__qualname__ = f"{linear.__name__}WithOutputNorm"
    return OutputNormed


class LocalRopeSelfAttention(SelfAttention):
    """Megatron's self-attention; in a sliding-window layer, with RoPE at ``local_rope_base`` in place of
    the model's (the same positions: packed sequences restart theirs, so both tables are as long)."""

    def __init__(self, *args, local_rope_base: float, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.local_rope = (
            RotaryEmbedding(
                config.kv_channels, rotary_percent=1.0, rotary_base=local_rope_base, use_cpu_initialization=True
            )
            if windowed
            else None
        )

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        if self.local_rope is not None and rotary_pos_emb is not None:
            rotary_pos_emb = self.local_rope(len(rotary_pos_emb), packed_seq=packed_seq_params is not None)
        return super().forward(
            hidden_states,
            attention_mask,
            *args,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )


def gemma3_layer(layer, shape: ModelShape, norm: type) -> None:
    """Megatron GPT layer spec ``layer`` made Gemma 3's in place: ``norm`` after attention and after the MLP,
    sliding-window layers' own RoPE base."""
    attention, mlp = layer.submodules.self_attention, layer.submodules.mlp.submodules
    attention.module = LocalRopeSelfAttention
    attention.params = {**attention.params, "local_rope_base": shape.local_rope_base}
    attention.submodules.linear_proj = with_output_norm(attention.submodules.linear_proj, norm)
    mlp.linear_fc2 = with_output_norm(mlp.linear_fc2, norm)


def scale_embeddings(model, hidden: int) -> None:
    """GPTModel ``model``'s token embeddings multiplied by sqrt(``hidden``), that factor first rounded to float32
    and then to the embeddings' dtype, as Hugging Face's Gemma 3 rounds it."""
    scale = torch.tensor(hidden**0.5, dtype=torch.float32)
    model.embedding.register_forward_hook(lambda _module, _inputs, out: out * scale.to(out.device, out.dtype))
