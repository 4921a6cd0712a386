"""Attention over packed sequences without a dense mask: what every trainer forward runs.

A packed micro-batch is one row of several sequences. Hugging Face's sdpa path turns restarting
position ids into a dense [T, T] block-diagonal mask, so attention costs T² whatever the sequences
are. Here each sequence attends only to itself: sequences of similar length are gathered into a
right-padded [n, L] block and run through causal ``scaled_dot_product_attention`` (right padding
never reaches a real query under a causal mask, so no mask is needed), and the outputs scattered
back into the packed row. Linear layers, norms and the LM head never see padding. A group's padded
attention costs at most ``PAD_TOLERANCE`` times its sequences' own Σ L². A sliding-window layer (Gemma 3's,
Qwen's with ``use_sliding_window``; the model passes its ``sliding_window``) attends to the last
``sliding_window`` positions only, as Hugging Face's masks make it: within a group under a boolean mask.

On CUDA with bf16/fp16 compute, torch's own flash-attention varlen kernel (``torch.nn.attention.varlen``)
takes the packed row as it is, no padding at all; with flash-attn installed, Hugging Face's
``flash_attention_2`` does the same from the restarting position ids. Neither runs on CPU CI: ``bench/
gpu_check.py`` checks them against dense-mask sdpa on a GPU.

On a CPU attention runs in float32 under a bfloat16 autocast (``attention_precision``): sdpa's bfloat16
backward is the slow part there. ``sdpa_float32`` applies that rule to Hugging Face's own sdpa, with its
masks and KV cache, for tree training's padded segments.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

VARLEN_SDPA = "varlen_sdpa"
VARLEN_FLASH = "varlen_flash"
SDPA_FLOAT32 = "sdpa_float32"
PAD_TOLERANCE = 1.5  # padded attention work of a group / the work of its sequences alone


@dataclass
class PaddedBlock:
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
            if (len(groups[-1]) + 1) * longest**2 <= tolerance * (exact + lengths[i] ** 2):
                groups[-1].append(i)
                exact += lengths[i] ** 2
                continue
        groups.append([i])
        exact = lengths[i] ** 2
    return groups


def padded_groups(cu_seqlens: torch.Tensor) -> list[PaddedBlock]:
    """The gather/scatter plan of a packed row with sequence boundaries ``cu_seqlens``."""
    starts, lengths = cu_seqlens[:-1].tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    plan = []
    for members in length_groups(lengths):
        length = lengths[members[0]]
        tokens = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in members])
        slots = torch.cat([torch.arange(row * length, row * length + lengths[i]) for row, i in enumerate(members)])
        device = cu_seqlens.device
        plan.append(PaddedBlock(tokens.to(device), slots.to(device), len(members), length))
    return plan


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    padded_groups: list[PaddedBlock],
    sliding_window: int | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: q [1, H, T, D], k/v [1, H_kv, T, D] of a packed row
    -> [1, T, H, D], each sequence attending causally to itself only (to its last ``sliding_window`` tokens)."""
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    out = query.new_zeros(heads, total, dim)
    gqa = key.shape[1] != heads
    for group in padded_groups:
        blocks = []
        for x in (query, key, value):
            block = x.new_zeros(x.shape[1], group.n * group.length, dim)
            block = block.index_copy(1, group.slots, x[0].index_select(1, group.tokens))
            blocks.append(block.view(x.shape[1], group.n, group.length, dim).transpose(0, 1))
        offsets = torch.arange(group.length, device=query.device)
        windowed = sliding_window is not None and group.length > sliding_window
        mask = attends(offsets, offsets, sliding_window) if windowed else None  # None: causal, no mask
        with torch.autocast(query.device.type, enabled=False):
            attended = F.scaled_dot_product_attention(
                *(b.to(attention_precision(query)) for b in blocks),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scaling,
                dropout_p=dropout if module.training else 0.0,
                enable_gqa=gqa,
            )
        attended = attended.to(query.dtype).transpose(0, 1).reshape(heads, group.n * group.length, dim)
        out = out.index_copy(1, group.tokens, attended.index_select(1, group.slots))
    return out.transpose(0, 1)[None], None


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa)


def attends(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[q, k] whether each query attends to each key of its sequence: causally, and under a sliding window to
    keys fewer than ``sliding_window`` positions back (Hugging Face's ``sliding_window_overlay``)."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    return allowed & (distance < sliding_window) if sliding_window else allowed


def attention_precision(query: torch.Tensor) -> torch.dtype:
    """float32 on a CPU, where sdpa's bfloat16 backward is several times slower than float32's (the
    matmuls around it keep the compute dtype); the inputs' own dtype elsewhere."""
    return torch.float32 if query.device.type == "cpu" else query.dtype


def sdpa_float32(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs
) -> tuple[torch.Tensor, None]:
    """Hugging Face's sdpa (its masks and KV cache, as tree training uses them) in
    ``attention_precision``, the output back in the query's dtype."""
    with torch.autocast(query.device.type, enabled=False):
        out, _ = sdpa_attention_forward(
            module, *(x.to(attention_precision(query)) for x in (query, key, value)), attention_mask, **kwargs
        )
    return out.to(query.dtype), None


AttentionInterface.register(SDPA_FLOAT32, sdpa_float32)
AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)  # the masks Hugging Face builds for its sdpa


@functools.cache
def _torch_varlen_attn():
    """torch's flash-attention kernel over packed sequences (``torch.nn.attention.varlen``, CUDA) and the
    names of its parameters (torch 2.9-2.11 name causality and GQA differently), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_flash(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    scaling: float | None = None,
    cu_seqlens: torch.Tensor,
    max_length: int,
    sliding_window: int | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function on torch's varlen flash kernel: q [1, H, T, D], k/v
    [1, H_kv, T, D] of a packed row -> [1, T, H, D], each sequence attending causally to itself only (to its
    last ``sliding_window`` tokens: the kernel's window counts the keys before the query). Takes bf16/fp16
    inputs and no dropout, and a sliding window where the kernel has one (``packed_attention_inputs`` chooses
    it only then)."""
    varlen_attn, options = _torch_varlen_attn()
    left = sliding_window - 1 if sliding_window else -1
    causal = {"window_size": (left, 0)} if "window_size" in options else {"is_causal": True}
    autocast = torch.is_autocast_enabled(query.device.type)  # rotary embeddings leave q, k in float32 there
    dtype = torch.get_autocast_dtype(query.device.type) if autocast else query.dtype
    q, k, v = (x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value))  # [T, heads, D]
    if "enable_gqa" in options:
        causal["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scaling, **causal)
    return out[None], None


AttentionInterface.register(VARLEN_FLASH, varlen_flash)


def packed_attention_inputs(model: torch.nn.Module, cu_seqlens: torch.Tensor) -> tuple[str, dict]:
    """The attention implementation for a packed row of ``model`` and the keyword arguments it takes:
    flash-attn's varlen kernels on CUDA when installed (they read the restarting position ids); else
    torch's varlen flash kernel on CUDA for bf16/fp16 compute (autocast or half weights) without
    dropout (and, for a model with sliding windows, a kernel that takes one); else per-sequence sdpa."""
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", {}
    half = dtype in (torch.bfloat16, torch.float16) or (
        torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) != torch.float32
    )
    no_dropout = not model.training or getattr(model.config, "attention_dropout", 0.0) == 0.0
    kernel = _torch_varlen_attn()
    windows = kernel is not None and (
        "window_size" in kernel[1] or getattr(model.config, "sliding_window", None) is None
    )
    if device.type == "cuda" and half and no_dropout and windows:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return VARLEN_FLASH, {"cu_seqlens": cu_seqlens.to(torch.int32), "max_length": int(lengths.max())}
    return VARLEN_SDPA, {"padded_groups": padded_groups(cu_seqlens)}


@contextmanager
def packed_attention(model: torch.nn.Module, implementation: str):
    """Within the block, ``model`` attends with ``implementation`` (one of ``packed_attention_inputs``, or
    context parallelism's). The model keeps its own implementation outside (the in-process evaluation
    decodes with it and a KV cache)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before
