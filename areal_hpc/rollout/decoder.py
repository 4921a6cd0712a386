"""Batched decoding over a slot KV cache for Qwen2/Qwen2.5/Qwen3 models loaded with transformers.

The embedded engine needs what ``generate()`` cannot give: sequences of different lengths joining and
leaving one running batch at every step. Each running sequence owns a slot of a preallocated KV
cache and its own position; a decode step runs all active slots at once with a per-slot mask. The
layers' own modules (norms, projections, MLP, rotary embedding) do the maths, so logits match the
HF forward pass; only the attention over the cache is ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from areal_hpc.errors import UserError

SUPPORTED = ("qwen2", "qwen3")


class SlotDecoder:
    """Prefill one sequence into a slot, or advance many slots by one token, returning logits."""

    def __init__(self, model: torch.nn.Module, slots: int, context_length: int):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise UserError(f"the embedded engine decodes {', '.join(SUPPORTED)} models; "
                            f"{config.model_type!r} needs backend=sglang")
        self.model, self.slots, self.context_length = model, slots, context_length
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        shape = (slots, self.n_kv_heads, context_length, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Run a whole prompt into ``slot`` (positions 0..n-1); logits of its last position, shape [V]."""
        device = self.keys[0].device
        tokens = torch.tensor([token_ids], device=device)
        positions = torch.arange(len(token_ids), device=device)[None]
        slots = torch.tensor([slot], device=device)
        return self._forward(tokens, positions, slots, causal=True)[0, -1]

    @torch.no_grad()
    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Feed one token per slot at its position; next-token logits, shape [len(slots), V]."""
        device = self.keys[0].device
        return self._forward(torch.tensor(token_ids, device=device)[:, None],
                             torch.tensor(positions, device=device)[:, None],
                             torch.tensor(slots, device=device), causal=False)[:, -1]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 causal: bool) -> torch.Tensor:
        body = self.model.model
        hidden = body.embed_tokens(tokens)
        cos, sin = body.rotary_emb(hidden, positions)
        span = int(positions.max()) + 1  # cache columns any row attends to
        # A row attends to its cache up to its own position (earlier columns may hold a previous tenant).
        visible = torch.arange(span, device=tokens.device)[None, None, :] <= positions[:, :, None]
        mask = visible[:, None]  # [B, 1, T, span]
        for layer, keys, values in zip(body.layers, self.keys, self.values):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin,
                                              positions, slots, keys, values, span, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(body.norm(hidden)).float()

    def _attention(self, attn, x, cos, sin, positions, slots, keys, values, span, mask) -> torch.Tensor:
        batch, length, _ = x.shape
        q = attn.q_proj(x).view(batch, length, -1, self.head_dim)
        k = attn.k_proj(x).view(batch, length, -1, self.head_dim)
        v = attn.v_proj(x).view(batch, length, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        rows = slots[:, None].expand(batch, length)
        keys[rows, :, positions] = k.transpose(1, 2)  # [B, T, H, D] scattered into each slot's columns
        values[rows, :, positions] = v
        out = F.scaled_dot_product_attention(q, keys[slots, :, :span], values[slots, :, :span], attn_mask=mask,
                                             scale=attn.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
