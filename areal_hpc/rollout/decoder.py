"""Batched decoding over a slot KV cache for Qwen2/Qwen2.5/Qwen3 models loaded with transformers.

The embedded engine needs what ``generate()`` cannot give: sequences of different lengths joining and
leaving one running batch at every step. Each running sequence owns a row (slot) of a preallocated
KV cache and its own position. Running sequences are kept in rows 0..n-1 (the engine moves the last
one into a finished one's row), so a decode step attends over a view of the cache, never a copy.
The layers' own modules (norms, projections, MLP, rotary embedding) do the maths, so logits match
the HF forward pass; only the attention over the cache is ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from areal_hpc.errors import UserError

SUPPORTED = ("qwen2", "qwen3")


class SlotDecoder:
    """Prefill new sequences into rows, advance rows 0..n-1 by one token, move a row: logits out."""

    def __init__(self, model: torch.nn.Module, slots: int, context_length: int):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise UserError(f"the embedded engine decodes {', '.join(SUPPORTED)} models; "
                            f"{config.model_type!r} needs backend=sglang")
        self.model, self.slots, self.context_length = model, slots, context_length
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        shape = (slots, config.num_key_value_heads, context_length, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.device = param.device
        self.refresh_weights()

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuild the fused projections (q|k|v and gate|up: one larger matmul each instead of
        several small ones) from the model's weights; call after every weight update."""
        self._qkv, self._gate_up = [], []
        for layer in self.model.model.layers:
            projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            biases = [p.bias for p in projections]
            self._qkv.append((torch.cat([p.weight for p in projections]),
                              None if biases[0] is None else torch.cat(biases),
                              [p.out_features for p in projections]))
            self._gate_up.append(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))

    @torch.no_grad()
    def prefill(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts into rows first_row.. (right-padded, one forward); logits at each prompt's end.

        Padding writes keys past a prompt's end; they are overwritten before anything attends to them,
        since decoding writes a position before reading it.
        """
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        hidden = self._forward(tokens, positions, first_row)
        return self._logits(hidden[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])])

    @torch.no_grad()
    def decode(self, token_ids: list[int], positions: list[int], first_row: int = 0) -> torch.Tensor:
        """Feed one token to each of rows first_row.. at its position; next-token logits, shape [n, V]."""
        return self._logits(self._forward(torch.tensor(token_ids, device=self.device)[:, None],
                                          torch.tensor(positions, device=self.device)[:, None], first_row)[:, -1])

    def move(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's cache (its first ``length`` positions) to another row."""
        for cache in (*self.keys, *self.values):
            cache[target, :, :length] = cache[source, :, :length]

    def clear(self, row: int) -> None:
        """Zero a row's cache. Masked columns still enter attention as 0 x value, so a NaN left by a
        failed sequence would otherwise reach every later tenant of the row."""
        for cache in (*self.keys, *self.values):
            cache[row].zero_()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, first_row: int) -> torch.Tensor:
        body = self.model.model
        hidden = body.embed_tokens(tokens)
        cos, sin = body.rotary_emb(hidden, positions)
        span = int(positions.max()) + 1  # cache columns any row attends to
        # A row attends to its cache up to its own position (later columns may hold a previous tenant).
        mask = (torch.arange(span, device=self.device)[None, None, :] <= positions[:, :, None])[:, None]
        rows = slice(first_row, first_row + len(tokens))
        index = torch.arange(len(tokens), device=self.device)[:, None].expand_as(positions)
        for i, (layer, keys, values) in enumerate(zip(body.layers, self.keys, self.values)):
            hidden = hidden + self._attention(layer.self_attn, self._qkv[i], _rms_norm(layer.input_layernorm, hidden),
                                              cos, sin, index, positions, keys[rows], values[rows], span, mask)
            gate, up = F.linear(_rms_norm(layer.post_attention_layernorm, hidden), self._gate_up[i]).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, only where logits are needed (not at every prompt position)."""
        return self.model.lm_head(_rms_norm(self.model.model.norm, hidden)).float()

    def _attention(self, attn, qkv, x, cos, sin, index, positions, keys, values, span, mask) -> torch.Tensor:
        batch, length, _ = x.shape
        weight, bias, sizes = qkv
        q, k, v = (t.view(batch, length, -1, self.head_dim) for t in F.linear(x, weight, bias).split(sizes, dim=-1))
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys[index, :, positions] = k.transpose(1, 2)  # [B, T, H, D] scattered into each row's columns
        values[index, :, positions] = v
        out = F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=mask,
                                             scale=attn.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as torch's fused op (computed in float32 like HF's): one op instead of seven."""
    return F.rms_norm(x.float(), norm.weight.shape, norm.weight.float(), norm.variance_epsilon).to(x.dtype)
