"""Batched decoding over a slot KV cache for the families ``builtins.FAMILY_PATHS`` lists for it (Qwen2/2.5/3,
Qwen3-MoE, Llama 3.x, Gemma 3) loaded with transformers.

The embedded engine needs what ``generate()`` cannot give: sequences of different lengths joining and
leaving one running batch at every step. Each running sequence owns a row (slot) of a preallocated
KV cache, and the decoder keeps each row's length and last token, so a decode step needs nothing from
the caller. Running sequences are kept in rows 0..n-1 (the engine moves the last one into a finished
one's row), so a decode step attends over a view of the cache, never a copy. The model's weights do
the maths with the same operations as the HF forward pass (logits match it within float rounding);
on a small model a step is bound by memory traffic and dispatch, so on CPU the projections run
through oneDNN with weights prepacked at each update (MKL, which ``F.linear`` uses, takes a path about
half as fast on AMD CPUs), the attention is a grouped-query ``baddbmm`` over cache views (no
key/value expansion), norms are fused and rotary tables are precomputed. A Mixture-of-Experts layer's
MLP is the model's own module (router and expert loop).

Attention kinds (Gemma 3's ``layer_types``, Qwen's ``use_sliding_window``): each kind has its own rotary
table (Gemma 3: RoPE base 1e4 local, 1e6 global) and a sliding-window layer's mask hides keys more than
``sliding_window - 1`` positions back; the cache keeps them all. Gemma 3 also scales the embeddings by
sqrt(hidden) in the weights' dtype, normalises each block's output as well as its input, scales its RMSNorms
by (1 + weight), and may softcap the final logits, as its HF forward does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_hpc.builtins import check_family
from areal_hpc.errors import UserError

FIRST_CAPACITY = 64  # cache columns per row before the first growth
OFFSET_NORMS = {"gemma3_text"}  # families whose RMSNorms scale by (1 + weight)
REFUSED_SETTINGS = {  # config settings the decoder does not apply: why, and what to do
    "attn_logit_softcapping": "transformers' forward, which the trainer runs, ignores it too: set it to null",
    "use_bidirectional_attention": "it generates left to right: use a causal checkpoint",
}


class SlotDecoder:
    """Prefill new sequences into rows, advance rows by one token, move a row: logits out.

    Row state: ``lengths[row]`` tokens of the sequence so far, all in the cache except the last
    sampled one (``last[row]``, fed by the next decode step). ``prefill`` and ``decode`` do not change
    it (a failed pass can be rerun row by row); ``push`` appends the sampled tokens.
    """

    def __init__(self, model: torch.nn.Module, slots: int, context_length: int):
        config = model.config
        check_family(config.model_type, "embedded decoder", "serve it with rollout.backend=sglang")
        for name, why in REFUSED_SETTINGS.items():
            if getattr(config, name, None):
                raise UserError(f"the embedded decoder does not apply {name}={getattr(config, name)!r}: {why}")
        self.model, self.slots, self.context_length = model, slots, context_length
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        self.device = param.device
        # Cache columns per row: as many as the longest sequence so far needs (doubling), not the context
        # length: 64 rows x 1024 columns of a 4-layer model held 134 MB for 20-token sequences.
        self.capacity = min(context_length, FIRST_CAPACITY)
        shape = (slots, self.kv_heads, self.capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.last = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._rotary = {kind: self._rotary_table(kind) for kind in {_kind(layer) for layer in model.model.layers}}
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self.refresh_weights()

    @torch.no_grad()
    def _rotary_table(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [context, D] of every position for layers of attention ``kind``, as the model's rotary
        embedding computes them (Gemma 3's has a base per kind)."""
        rotary, param = self.model.model.rotary_emb, next(self.model.parameters())
        positions = torch.arange(self.context_length, device=self.device)[None]
        cos, sin = rotary(param, positions, kind) if hasattr(rotary, "layer_types") else rotary(param, positions)
        half = self.head_dim // 2  # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated)
        return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Gather (and on CPU prepack) each layer's weights, q|k|v and gate|up fused: one larger matmul
        each instead of several small ones. Call after every weight update."""
        body = self.model.model
        offset = 1.0 if self.model.config.model_type in OFFSET_NORMS else 0.0

        def norm(module):
            return _Norm(module, offset)

        def linear(modules):
            bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
            return _Linear(torch.cat([m.weight for m in modules]), bias, self.slots)

        self._layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: each block's output normalised too
            self._layers.append(
                _Layer(
                    _kind(layer),
                    getattr(attn, "sliding_window", None),
                    norm(layer.input_layernorm),
                    linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                    linear([attn.o_proj]),
                    attn.scaling,
                    norm(attn.q_norm) if hasattr(attn, "q_norm") else None,  # Qwen3, Gemma 3: q and k per head
                    norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
                    norm(layer.post_attention_layernorm) if sandwich else None,
                    norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                    norm(layer.post_feedforward_layernorm) if sandwich else None,
                    _DenseMLP(linear([mlp.gate_proj, mlp.up_proj]), linear([mlp.down_proj]), mlp.act_fn)
                    if hasattr(mlp, "gate_proj")
                    else mlp,
                )
            )
        self._embedding, self._embed_scale, self._norm, self._head = (
            body.embed_tokens.weight,
            getattr(body.embed_tokens, "embed_scale", None),  # Gemma: sqrt(hidden), applied in the weights' dtype
            norm(body.norm),
            linear([self.model.lm_head]),
        )

    @torch.no_grad()
    def prefill(
        self, first_row: int, prompts: list[list[int]], prefixes: list[list[tuple[int, torch.Tensor]]] | None = None
    ) -> torch.Tensor:
        """Run prompts into rows first_row.. (right-padded, one forward); logits at each prompt's end.

        ``prefixes[i]``: the keys and values (``read``'s blocks, with their start columns, from column 0 on)
        of a first part of prompt i, written into its row; only the rest of the prompt runs. Padding writes
        keys past a prompt's end (at most one column past the longest); they are overwritten before anything
        attends to them, since decoding writes a position before reading it. A prompt that comes several
        times (a GRPO group's samples) runs once: its keys and values are copied into the rows of its repeats.
        """
        prefixes = prefixes or [[] for _ in prompts]
        first_seen: dict[tuple[int, ...], int] = {}
        which = [first_seen.setdefault(tuple(p), len(first_seen)) for p in prompts]  # its distinct prompt
        distinct = [list(p) for p in first_seen]
        starts = [0] * len(distinct)
        firsts: dict[int, int] = {}  # distinct prompt -> its first request
        for i, d in enumerate(which):
            firsts.setdefault(d, i)
        for d, i in firsts.items():  # distinct prompt d runs in row first_row + d: its prefix goes there
            for start, block in prefixes[i]:
                self.write(first_row + d, start, block)
                starts[d] = start + block.shape[2]
        width = max(len(p) - s for p, s in zip(distinct, starts))
        padded = [p[s:] + [0] * (width - len(p) + s) for p, s in zip(distinct, starts)]
        tokens = torch.tensor(padded, device=self.device)
        offsets, ends = (torch.tensor(x, device=self.device) for x in (starts, [len(p) for p in distinct]))
        positions = (offsets[:, None] + torch.arange(width, device=self.device)).clamp(max=int(ends.max()))
        hidden = self._forward(tokens, positions, first_row)  # into rows first_row.. (all being filled)
        if len(distinct) < len(prompts):
            sources, columns = torch.tensor(which, device=self.device) + first_row, int(ends.max())
            for cache in (*self.keys, *self.values):
                cache[first_row : first_row + len(prompts), :, :columns] = cache[sources, :, :columns]
        self.lengths[first_row : first_row + len(prompts)] = ends[which]
        return self._logits(hidden[torch.arange(len(distinct)), ends - offsets - 1])[which]

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of the keys and values of row ``row``'s positions start..end-1, every layer's:
        [2 x layers, kv heads, end - start, head dim] (``write`` puts it back, in any row)."""
        return torch.stack([cache[row, :, start:end] for cache in (*self.keys, *self.values)])

    def write(self, row: int, start: int, block: torch.Tensor) -> None:
        """Put a block of keys and values (``read``'s form) into row ``row`` from column ``start``."""
        end = start + block.shape[2]
        self._reserve(end)
        for cache, part in zip((*self.keys, *self.values), block):
            cache[row, :, start:end] = part

    @property
    def bytes_per_token(self) -> int:
        """Memory the keys and values of one position take, every layer's."""
        return 2 * len(self.keys) * self.kv_heads * self.head_dim * self.keys[0].element_size()

    @torch.no_grad()
    def decode(self, first_row: int, n: int) -> torch.Tensor:
        """Feed rows first_row..first_row+n-1 their last token; next-token logits, shape [n, V]."""
        rows = slice(first_row, first_row + n)
        return self._logits(self._forward(self.last[rows, None], self.lengths[rows, None] - 1, first_row)[:, -1])

    def push(self, first_row: int, tokens: torch.Tensor) -> None:
        """Append one sampled token to each of rows first_row.. (the next decode step feeds it)."""
        rows = slice(first_row, first_row + len(tokens))
        self.last[rows] = tokens
        self.lengths[rows] += 1

    def move_rows(self, sources: list[int], targets: list[int]) -> None:
        """Move sequences (cache, length and last token) from rows ``sources`` to rows ``targets``, all
        at once: one copy per cache tensor, every source read before any target is written."""
        if not sources:
            return
        source, target = (torch.tensor(rows, device=self.device) for rows in (sources, targets))
        for cache in (*self.keys, *self.values):
            cache[target] = cache[source]
        self.lengths[target], self.last[target] = self.lengths[source], self.last[source]

    def clear(self, row: int) -> None:
        """Zero a row's cache. Masked columns still enter attention as 0 x value, so a NaN left by a
        failed sequence would otherwise reach every later tenant of the row."""
        for cache in (*self.keys, *self.values):
            cache[row].zero_()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, first_row: int) -> torch.Tensor:
        """Hidden states of ``tokens`` [B, T] at ``positions`` in rows first_row.., their keys and
        values written to the cache first."""
        batch, length = tokens.shape
        hidden = F.embedding(tokens, self._embedding)
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale.to(hidden.dtype)
        rotary = {  # [B, T, 1, D] per attention kind
            kind: (cos[positions][:, :, None], sin[positions][:, :, None]) for kind, (cos, sin) in self._rotary.items()
        }
        span = int(positions.max()) + 1  # cache columns any row attends to
        self._reserve(span)
        masks = {
            window: self._mask(positions, span, window, hidden.dtype) for window in {x.window for x in self._layers}
        }
        # Where each new key/value goes in the cache viewed as [slots * kv heads * context, head dim].
        row_heads = torch.arange(first_row, first_row + batch, device=self.device)[
            :, None, None
        ] * self.kv_heads + torch.arange(self.kv_heads, device=self.device)  # [B, 1, kv]
        slots = (row_heads * self.capacity + positions[:, :, None]).flatten()  # [B * T * kv]
        rows, qk_width = slice(first_row, first_row + batch), (self.heads + self.kv_heads) * self.head_dim
        for layer, keys, values in zip(self._layers, self.keys, self.values):
            qkv = layer.qkv(layer.input_norm(hidden))
            qk, v = qkv[..., :qk_width].view(batch, length, -1, self.head_dim), qkv[..., qk_width:]
            if layer.q_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :, : self.heads]), layer.k_norm(qk[:, :, self.heads :])], dim=2)
            qk = _rotate(qk, *rotary[layer.kind])  # queries and keys in one pass
            q, k = qk[:, :, : self.heads], qk[:, :, self.heads :]
            keys.view(-1, self.head_dim).index_copy_(0, slots, k.reshape(-1, self.head_dim))
            values.view(-1, self.head_dim).index_copy_(0, slots, v.reshape(-1, self.head_dim))
            out = layer.o_proj(
                self._attention(layer, q, keys[rows, :, :span], values[rows, :, :span], masks[layer.window])
            )
            hidden += out if layer.attn_out_norm is None else layer.attn_out_norm(out)
            out = layer.mlp(layer.mlp_norm(hidden))
            hidden += out if layer.mlp_out_norm is None else layer.mlp_out_norm(out)
        return hidden

    def _mask(self, positions: torch.Tensor, span: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """A row attends to its cache up to its own position (later columns may hold a previous tenant), and
        under a sliding ``window`` to its last ``window`` positions only: an additive mask shared by the layers
        of that window, laid out like the scores [B * kv heads, group * T, span]."""
        batch, length = positions.shape
        columns = torch.arange(span, device=self.device)
        allowed = columns <= positions[:, :, None]
        if window is not None:
            allowed &= columns > positions[:, :, None] - window
        bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, -torch.inf)
        group = self.heads // self.kv_heads
        return bias[:, None, None].expand(batch, self.kv_heads, group, length, span).reshape(-1, group * length, span)

    def _reserve(self, columns: int) -> None:
        """Grow every row's cache to at least ``columns`` (doubling, at most the context length)."""
        if columns <= self.capacity:
            return
        capacity = min(self.context_length, max(columns, 2 * self.capacity))
        for caches in (self.keys, self.values):
            for i, cache in enumerate(caches):
                grown = cache.new_zeros(self.slots, self.kv_heads, capacity, self.head_dim)
                grown[:, :, : self.capacity] = cache
                caches[i] = grown
        self.capacity = capacity

    def _attention(
        self, layer: _Layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Grouped-query attention of q [B, T, H, D] over cache views [B, kv, span, D]: the query heads
        sharing a kv head are one matrix (rows = group x T), so keys and values are read in place."""
        batch, length = q.shape[:2]
        group, span = self.heads // self.kv_heads, keys.shape[2]
        q = q.view(batch, length, self.kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch * self.kv_heads, group * length, self.head_dim)  # a view when T == 1
        keys, values = (t.view(batch * self.kv_heads, span, self.head_dim) for t in (keys, values))
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=layer.scaling).softmax(dim=-1)
        out = torch.bmm(scores, values).view(batch, self.kv_heads, group, length, self.head_dim)
        return out.permute(0, 3, 1, 2, 4).reshape(batch, length, self.heads * self.head_dim)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (and the final softcap), only where logits are needed (not at every prompt
        position)."""
        logits = self._head(self._norm(hidden))
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()


class _Norm:
    """A model's RMSNorm as torch's fused op (computed in float32 like HF's): one op instead of seven.
    ``offset``: 1 where the norm scales by (1 + weight) (Gemma's)."""

    def __init__(self, norm: torch.nn.Module, offset: float = 0.0):
        self.weight = norm.weight.float() + offset if offset else norm.weight
        self.eps = getattr(norm, "variance_epsilon", None) or norm.eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class _Linear:
    """``x @ weight.T + bias``; on CPU through oneDNN with the weight prepacked for ``batch`` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch: int):
        self.weight, self.bias = weight, bias
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, batch)
            if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, read from its modules once per weight update."""

    kind: str  # its attention kind: which rotary table
    window: int | None  # a sliding window's length, or None
    input_norm: _Norm
    qkv: _Linear
    o_proj: _Linear
    scaling: float
    q_norm: _Norm | None
    k_norm: _Norm | None
    attn_out_norm: _Norm | None  # Gemma's norms of the attention's and the MLP's outputs
    mlp_norm: _Norm
    mlp_out_norm: _Norm | None
    mlp: Callable[[torch.Tensor], torch.Tensor]  # a dense gated MLP, or the model's Mixture-of-Experts block


@dataclass(frozen=True)
class _DenseMLP:
    """A gated MLP (SwiGLU; Gemma's GELU) with gate and up fused into one matmul."""

    gate_up: _Linear
    down: _Linear
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def _kind(layer: torch.nn.Module) -> str:
    """A decoder layer's attention kind (``config.layer_types``), "full_attention" where a model has one kind."""
    return getattr(layer.self_attn, "layer_type", None) or "full_attention"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, T, heads, D]: HF's ``x * cos + rotate_half(x) * sin``, with
    ``sin``'s first half negated beforehand, so no concatenation."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
