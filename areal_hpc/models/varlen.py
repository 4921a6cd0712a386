"""Attention over packed sequences without a dense mask: what every trainer forward runs.

A packed micro-batch is one row of several sequences. Hugging Face's sdpa path turns restarting
position ids into a dense [T, T] block-diagonal mask, so attention costs T² whatever the sequences
are. Here each sequence attends only to itself: sequences of similar length are gathered into a
right-padded [n, L] block and run through causal ``scaled_dot_product_attention`` (right padding
never reaches a real query under a causal mask, so no mask is needed), and the outputs scattered
back into the packed row. Linear layers, norms and the LM head never see padding. A group's padded
attention costs at most ``PAD_TOLERANCE`` times its sequences' own Σ L².

On CUDA with flash-attn installed, Hugging Face's ``flash_attention_2`` does the same from the
restarting position ids (varlen kernels); that path has not run on this project's CI.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN_SDPA = "varlen_sdpa"
PAD_TOLERANCE = 1.5  # padded attention work of a group / the work of its sequences alone


@dataclass
class PaddedGroup:
    tokens: torch.Tensor  # [m] packed positions of this group's tokens
    slots: torch.Tensor  # [m] their places in the group's flattened [n, L] block
    n: int
    length: int


def length_groups(lengths: list[int], tolerance: float = PAD_TOLERANCE) -> list[list[int]]:
    """Sequence indices, longest first, cut into groups whose padded attention work n·L_max² stays within
    ``tolerance`` times Σ L² of their members."""
    groups: list[list[int]] = []
    exact = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            longest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * longest ** 2 <= tolerance * (exact + lengths[i] ** 2):
                groups[-1].append(i)
                exact += lengths[i] ** 2
                continue
        groups.append([i])
        exact = lengths[i] ** 2
    return groups


def padded_groups(cu_seqlens: torch.Tensor) -> list[PaddedGroup]:
    """The gather/scatter plan of a packed row with sequence boundaries ``cu_seqlens``."""
    starts, lengths = cu_seqlens[:-1].tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    plan = []
    for members in length_groups(lengths):
        length = lengths[members[0]]
        tokens = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in members])
        slots = torch.cat([torch.arange(row * length, row * length + lengths[i]) for row, i in enumerate(members)])
        device = cu_seqlens.device
        plan.append(PaddedGroup(tokens.to(device), slots.to(device), len(members), length))
    return plan


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask, *, scaling: float | None = None, dropout: float = 0.0,
                padded_groups: list[PaddedGroup], **_) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: q [1, H, T, D], k/v [1, H_kv, T, D] of a packed row
    -> [1, T, H, D], each sequence attending causally to itself only."""
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    out = query.new_zeros(heads, total, dim)
    gqa = key.shape[1] != heads
    for group in padded_groups:
        blocks = []
        for x in (query, key, value):
            block = x.new_zeros(x.shape[1], group.n * group.length, dim)
            block = block.index_copy(1, group.slots, x[0].index_select(1, group.tokens))
            blocks.append(block.view(x.shape[1], group.n, group.length, dim).transpose(0, 1))
        with torch.autocast(query.device.type, enabled=False):  # CPU's bfloat16 attention backward is slow
            attended = F.scaled_dot_product_attention(*(b.float() for b in blocks), is_causal=True, scale=scaling,
                                                      dropout_p=dropout if module.training else 0.0, enable_gqa=gqa)
        attended = attended.to(query.dtype).transpose(0, 1).reshape(heads, group.n * group.length, dim)
        out = out.index_copy(1, group.tokens, attended.index_select(1, group.slots))
    return out.transpose(0, 1)[None], None


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa)


def packed_attention_implementation(device: torch.device) -> str:
    """flash-attn's varlen kernels on CUDA when installed, else per-sequence sdpa."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_SDPA


@contextmanager
def packed_attention(model: torch.nn.Module, implementation: str | None = None):
    """Within the block, ``model`` attends over packed rows sequence by sequence (with ``implementation``
    when given, e.g. context parallelism's). The model keeps its own implementation outside (the
    in-process evaluation decodes with it and a KV cache)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = implementation or packed_attention_implementation(next(model.parameters()).device)
    try:
        yield
    finally:
        config._attn_implementation = before
