"""The decoder forward of tree training's segments, written out for dense Qwen2/Qwen3 models.

Tree training (``engines/torch/tree.py``) runs padded segments [B, T] that continue cached prefixes
(each row its own parent's keys and values, some padded), causal or under a tree mask (a flattened
subtree), several times a step. On the quickstart's
tiny model such a forward is bound by dispatch as much as by arithmetic, and the update shares trainer
rank 0's interpreter with its rollout side, so every Python-level operation counts twice. Here the
norms are torch's fused ``rms_norm``, q|k|v and gate|up one matmul each (their weights concatenated
per call, so the gradients reach the model's own parameters; 705 matrix products in 5 quickstart
updates instead of 1,125), the rotary tables and their application are the model's own (``rotary_emb``,
``apply_rotary_pos_emb``), one boolean mask
serves every layer, and there is no cache object or mask builder. It makes the quickstart's update alone
~3% faster than the model's own forward (one thread). Results match the model's forward within float
rounding (``tests/models/test_segment_forward.py`` checks outputs and gradients against it in float64).

``supports_segment_forward`` says where it applies: a dense Qwen2/Qwen3 decoder whose projections
are plain ``nn.Linear`` modules with plain tensors (no LoRA wrapper, no FSDP or tensor-parallel
sharding), none of whose modules has forward hooks (FSDP2 and ``replicate`` manage parameters in them:
data-parallel replicas run the model's own forward), no sliding window and no attention dropout. Tree
training uses it on a CPU (on a GPU the model's own attention kernels are the better choice, and it is
unchecked there) and elsewhere runs the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb  # Qwen3's is the same

from areal_hpc.builtins import family_supports

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]


def supports_segment_forward(model: torch.nn.Module) -> bool:
    config = model.config
    if (
        not family_supports(config.model_type, "segment forward")
        or getattr(config, "use_sliding_window", False)
        or getattr(config, "attention_dropout", 0.0)
    ):
        return False
    layers = model.base_model.layers
    projections = [
        m
        for layer in layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            getattr(layer.mlp, "gate_proj", None),
            getattr(layer.mlp, "up_proj", None),
            getattr(layer.mlp, "down_proj", None),
        )
    ]
    hooked = any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # e.g. FSDP2, replicate
    return (
        not hooked
        and all(type(m) is torch.nn.Linear for m in projections)
        and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())
    )


# Matrix products on a CPU run through oneDNN, which builds a kernel for every new shape (~1 ms each, 5x
# a cached product of the quickstart's): the rows a call computes are padded to a multiple of this, so
# shapes repeat from step to step (a varying count of real positions otherwise makes every step new).
ROWS_MULTIPLE = 64


def padded_rows(n: int) -> int:
    return -(-n // ROWS_MULTIPLE) * ROWS_MULTIPLE


def computed_positions(own: torch.Tensor | None) -> torch.Tensor | None:
    """Which of the flattened [B * T] positions a forward computes: those ``own`` [B, T] marks real, then
    padding ones up to ``padded_rows`` (or every position where that is all of them: None)."""
    if own is None:
        return None
    own = own.flatten()
    real = own.nonzero()[:, 0]
    count = padded_rows(len(real))
    if count >= len(own):
        return None
    return torch.cat([real, (~own).nonzero()[: count - len(real), 0]])


def segment_forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    prefix: KeyValues | None,
    prefix_valid: torch.Tensor | None,
    attention_dtype: torch.dtype,
    segment_mask: torch.Tensor | None = None,
    own: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KeyValues]:
    """Hidden states [B, T, hidden] of ``tokens`` [B, T] at ``positions`` [B, T], each row continuing
    its ``prefix`` (per layer keys and values [B, kv heads, P, head dim], rotated) of which
    ``prefix_valid`` [B, P] marks the real positions; and per layer the keys and values of prefix and
    segment together [B, kv heads, P + T, head dim]. Within its segment a position attends to those
    ``segment_mask`` [B, T, T] allows (a flattened subtree: its own branch), or to all before it (None).
    ``own`` [B, T]: the real positions (None: all); the projections, norms and MLPs run on those only
    (``computed_positions``), attention on the rows; the other positions' outputs are zeros and no real
    position attends to them. Attention runs in ``attention_dtype``."""
    body, config = model.base_model, model.config
    batch, length = tokens.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    computed = computed_positions(own)
    tokens, positions = tokens.flatten(), positions.flatten()
    if computed is not None:
        tokens, positions = tokens[computed], positions[computed]
    hidden = F.embedding(tokens, body.embed_tokens.weight)  # [N, hidden]: the computed positions
    cos, sin = (x[0] for x in body.rotary_emb(hidden, positions[None]))  # [N, head dim]

    def rows(x: torch.Tensor) -> torch.Tensor:
        """[N, ...] of the computed positions -> [B * T, ...], zeros elsewhere."""
        return x if computed is None else x.new_zeros(batch * length, *x.shape[1:]).index_copy(0, computed, x)

    mask = None  # no prefix, no tree: plain causal attention
    if prefix is not None or segment_mask is not None:  # every prefix position a row owns, then its segment
        if segment_mask is None:
            segment_mask = (
                torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril().expand(batch, -1, -1)
            )
        mask = (
            segment_mask
            if prefix is None
            else torch.cat([prefix_valid[:, None, :].expand(batch, length, -1), segment_mask], dim=-1)
        )
        mask = mask[:, None]
    states = []
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        qkv = _linear(_norm(layer.input_layernorm, hidden), (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k, v = (
            x.view(len(hidden), -1, head_dim)
            for x in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        )
        if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        q, k, v = (rows(x).view(batch, length, -1, head_dim).transpose(1, 2) for x in (q, k, v))
        if prefix is not None:
            k, v = torch.cat([prefix[i][0], k], dim=2), torch.cat([prefix[i][1], v], dim=2)
        states.append((k, v))
        out = _attention(q, k, v, mask, attn.scaling, attention_dtype).transpose(1, 2).reshape(batch * length, -1)
        hidden = hidden + attn.o_proj(out if computed is None else out[computed])
        mlp = layer.mlp
        gate, up = _linear(_norm(layer.post_attention_layernorm, hidden), (mlp.gate_proj, mlp.up_proj)).chunk(2, dim=-1)
        hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
    return rows(_norm(body.norm, hidden)).view(batch, length, -1), states


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (in float32, scaled after the cast back, as Hugging Face computes it)."""
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)


def _linear(x: torch.Tensor, modules: tuple[torch.nn.Linear, ...]) -> torch.Tensor:
    """Several projections of the same input as one matmul."""
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    return F.linear(x, torch.cat([m.weight for m in modules]), bias)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """Grouped-query attention, the key/value heads repeated for their query heads (as Hugging Face's
    sdpa does on a CPU); causal without a mask. Output in the queries' dtype, [B, heads, T, head dim]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (x[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2) for x in (k, v))
    with torch.autocast(q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, is_causal=mask is None, scale=scale
        )
    return out.to(q.dtype)
