"""Core attention for Megatron's local layer spec over packed (THD) sequences, on CPU.

Megatron's own ``DotProductAttention`` refuses ``packed_seq_params`` (only Transformer Engine's takes
them). This module takes its place in the layer spec: Megatron's ``Attention`` hands it q [t, heads, d]
and k, v [t, groups, d] of this rank's heads with RoPE already applied per sequence (positions restart
at each ``cu_seqlens`` boundary), and each sequence attends causally to itself only, through the same
per-sequence SDPA the Hugging Face trainer path runs (``models.varlen``; GQA without repeating k/v).
Under context parallelism a rank holds its zig-zag chunks of every (padded) sequence and attends over
keys and values gathered from the cp ranks (``parallel.context.context_sdpa``, as the torch engine).
A sliding-window layer (Megatron's ``window_size`` and ``window_attn_skip_freq``: Gemma 3's) attends
within each sequence to its last ``sliding_window`` positions only, the query's own included, as Hugging
Face's ``sliding_window`` does (Megatron's window counts the keys before the query's own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from areal_hpc.algo.packing import PackedBatch
from areal_hpc.models.varlen import PaddedBlock, padded_groups, varlen_sdpa
from areal_hpc.parallel.context import ContextShard, ContextSplit, context_sdpa


@dataclass
class PackedSequences(PackedSeqParams):
    """THD ``PackedSeqParams`` with the gather/scatter plan of its sequences (or, for a context-
    parallel rank's share, its ``ContextSplit``), made once per micro-batch."""

    groups: list[PaddedBlock] | None = None
    context_split: ContextSplit | None = None

    @classmethod
    def of(cls, packed: PackedBatch) -> PackedSequences:
        """The parameters of a packed micro-batch; for a ``ContextShard``, those of the whole padded
        micro-batch (Megatron's rotary embedding cuts each sequence's share out of them)."""
        if isinstance(packed, ContextShard):
            split = packed.split
            cu = torch.tensor([0, *split.lengths]).cumsum(0).to(packed.input_ids.device)
            return cls._thd(cu, context_split=split)
        return cls._thd(packed.cu_seqlens, groups=padded_groups(packed.cu_seqlens))

    @classmethod
    def _thd(cls, cu_seqlens: torch.Tensor, **plan) -> PackedSequences:
        cu = cu_seqlens.to(torch.int32)
        longest = int(cu_seqlens.diff().max())
        return cls(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest, **plan
        )


class PackedCoreAttention(MegatronModule):
    """Causal attention within each packed sequence; the constructor is ``DotProductAttention``'s."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.sliding_window = config.window_size[0] + 1 if windowed else None

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSequences | None = None,
    ) -> torch.Tensor:
        """q [t, heads, d], k/v [t, groups, d] -> [t, heads * d]."""
        if packed_seq_params is None or attention_bias is not None:
            raise ValueError("PackedCoreAttention takes packed (THD) sequences and no attention bias")
        q, k, v = (x.permute(1, 0, 2)[None] for x in (query, key, value))  # [1, heads, t, d]
        split = packed_seq_params.context_split
        scale, dropout, window = self.softmax_scale, self.dropout, self.sliding_window
        if split is not None:
            out, _ = context_sdpa(
                self, q, k, v, None, scaling=scale, dropout=dropout, sliding_window=window, context_split=split
            )
        else:
            groups = packed_seq_params.groups or padded_groups(packed_seq_params.cu_seqlens_q.long())
            out, _ = varlen_sdpa(
                self, q, k, v, None, scaling=scale, dropout=dropout, sliding_window=window, padded_groups=groups
            )
        return out[0].reshape(out.shape[1], -1)
