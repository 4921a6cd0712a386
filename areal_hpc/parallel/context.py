"""Context parallelism for both training engines: every packed micro-batch's tokens are dealt over the
``mesh["cp"]`` ranks, and attention gathers keys and values from all of them.

Each sequence is cut into 2 x cp chunks and cp rank r keeps chunks r and 2cp-1-r (the zig-zag
split Megatron and torchtitan use: causal attention work is then even over the ranks). Chunks may
differ by a token (``tensor_split``), so the torch engine pads nothing; the Megatron engine pads each
sequence at its end to a multiple of 2 x cp tokens (no targets; x tp under sequence parallelism), as
Megatron's rotary embedding for packed sequences takes equal chunks. Everything but attention is per
token: embeddings, MLPs, norms and the LM head run on a rank's own tokens only. Attention is
``context_sdpa``: a rank's queries attend to the whole sequence's keys and values, all-gathered over
the cp group (differentiable: the backward sums every rank's gradient for the rank's own keys and
values), under a causal mask by position within the sequence (and a sliding-window layer's window).

What is exact and what is not built:
- Token-level losses are sums over tokens, so the cp ranks' local losses sum to the whole one and
  their gradients are summed with the data-parallel ones (the engine reduces over ``dp_cp``).
- The next token a position is trained to predict may live on another rank: shards carry it
  (``ContextShard.next_ids``).
- Sequence-level quantities (GSPO's sequence ratio) would need sums across ranks: refused.
- Keys and values are all-gathered per layer (memory of one whole micro-batch's K/V per layer), not
  passed around a ring; fine for the sequence lengths RL trains on, not for 1M-token contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from areal_hpc.algo.packing import PackedBatch
from areal_hpc.models.varlen import attends

CONTEXT_SDPA = "context_sdpa"


@dataclass
class ContextSplit:
    """Where a packed micro-batch's tokens went: ``local`` are this rank's positions in the (padded)
    micro-batch (by sequence, in order); ``counts`` how many each cp rank holds; ``gathered_order``
    the padded position of each token of all ranks' shards concatenated in rank order; ``kept`` the
    padded position of each token of the micro-batch as packed (all of them when nothing is padded)."""

    local: torch.Tensor
    counts: list[int]
    gathered_order: torch.Tensor
    kept: torch.Tensor
    group: dist.ProcessGroup | None
    starts: list[int]  # per padded sequence: start, length, and its queries' range in the local row
    lengths: list[int]
    query_ranges: list[tuple[int, int]]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[T] of the whole micro-batch as packed from each rank's [t] (not differentiable)."""
        longest = max(self.counts)
        padded = F.pad(values, (0, longest - len(values)))
        parts = [torch.empty_like(padded) for _ in self.counts]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        gathered = torch.cat([part[:count] for part, count in zip(parts, self.counts)])
        whole = gathered.new_empty(len(gathered)).index_copy_(0, self.gathered_order.to(gathered.device), gathered)
        return whole[self.kept.to(whole.device)]

    def local_values(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's share of a per-position field [T] of the micro-batch as packed (0 at padding)."""
        total = sum(self.counts)
        padded = values.new_zeros(total, *values.shape[1:]).index_copy_(0, self.kept.to(values.device), values)
        return padded[self.local.to(values.device)]


@dataclass
class ContextShard(PackedBatch):
    """A cp rank's share of a packed micro-batch: its tokens as a packed batch of its own (positions
    within each sequence kept, ``cu_seqlens`` over its own tokens), the token each position predicts,
    and how the shares fit together."""

    next_ids: torch.Tensor = None  # [t] the token after each local position (0 past a sequence's end)
    split: ContextSplit = None

    def target_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        targets = self.target_mask.nonzero()[:, 0]
        return targets, self.next_ids[targets]


def zigzag_chunks(start: int, length: int, cp: int, rank: int) -> torch.Tensor:
    """Packed positions of a sequence that cp rank ``rank`` keeps: chunks rank and 2cp-1-rank of 2cp."""
    chunks = torch.arange(start, start + length).tensor_split(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def pad_sequences(packed: PackedBatch, multiple: int) -> tuple[PackedBatch, torch.Tensor]:
    """``packed`` with each sequence padded at its end to a multiple of ``multiple`` tokens (token 0,
    no target), and the padded position of each of its tokens."""
    lengths = packed.cu_seqlens.diff().cpu()
    padded_lengths = (lengths + multiple - 1) // multiple * multiple
    cu_seqlens = torch.cat([padded_lengths.new_zeros(1), padded_lengths.cumsum(0)])
    kept = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_seqlens[:-1].tolist(), lengths.tolist())])
    total, device = int(cu_seqlens[-1]), packed.input_ids.device
    on = kept.to(device)
    ids = packed.input_ids.new_zeros(1, total).index_copy_(1, on, packed.input_ids)
    positions = torch.cat([torch.arange(n) for n in padded_lengths.tolist()])[None].to(device)
    targets = packed.target_mask.new_zeros(total).index_copy_(0, on, packed.target_mask)
    temperatures = (
        None
        if packed.temperatures is None
        else packed.temperatures.new_ones(total).index_copy_(0, on, packed.temperatures)
    )
    return PackedBatch(ids, positions, targets, cu_seqlens.to(device), temperatures), kept


def shard(
    packed: PackedBatch, cp: int, rank: int, group: dist.ProcessGroup | None, *, pad_multiple: int = 1
) -> ContextShard:
    """This cp rank's ``ContextShard`` of ``packed`` (every rank of the group computes the same plan);
    sequences padded first to a multiple of ``pad_multiple`` tokens (2 x cp: equal chunks)."""
    kept = torch.arange(packed.input_ids.shape[1])
    if pad_multiple > 1:
        packed, kept = pad_sequences(packed, pad_multiple)
    starts = packed.cu_seqlens[:-1].tolist()
    lengths = packed.cu_seqlens.diff().tolist()
    per_rank = [[zigzag_chunks(s, n, cp, r) for s, n in zip(starts, lengths)] for r in range(cp)]
    local = torch.cat(per_rank[rank]) if starts else torch.zeros(0, dtype=torch.long)
    ids = packed.input_ids[0]
    next_ids = torch.cat([ids[1:], ids.new_zeros(1)])
    own = [len(part) for part in per_rank[rank]]
    bounds = torch.tensor([0, *own]).cumsum(0)
    split = ContextSplit(
        local=local,
        counts=[sum(len(p) for p in parts) for parts in per_rank],
        gathered_order=torch.cat([torch.cat(parts) for parts in per_rank]) if starts else local,
        kept=kept,
        group=group,
        starts=starts,
        lengths=lengths,
        query_ranges=list(zip(bounds[:-1].tolist(), bounds[1:].tolist())),
    )
    device = packed.input_ids.device
    local_on = local.to(device)
    return ContextShard(
        input_ids=packed.input_ids[:, local_on],
        position_ids=packed.position_ids[:, local_on],
        target_mask=packed.target_mask[local_on],
        cu_seqlens=bounds.to(device),
        temperatures=None if packed.temperatures is None else packed.temperatures[local_on],
        next_ids=next_ids[local_on],
        split=split,
    )


def context_passes(passes: list, cp: int, rank: int, group: dist.ProcessGroup | None, *, pad_multiple: int = 1) -> list:
    """Each (sequence indices, packed micro-batch, per-position fields) pass as this cp rank's share:
    its ``ContextShard`` and its positions of every field."""
    shares = []
    for indices, packed, fields in passes:
        part = shard(packed, cp, rank, group, pad_multiple=pad_multiple)
        shares.append((indices, part, {name: part.split.local_values(v) for name, v in fields.items()}))
    return shares


class _GatherTokens(torch.autograd.Function):
    """[1, H, t, D] per rank -> [1, H, T, D] of the whole micro-batch in packed order; the backward
    sums every rank's gradient and returns this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
        ctx.split = split
        longest = max(split.counts)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[2])).contiguous()
        parts = [torch.empty_like(padded) for _ in split.counts]
        dist.all_gather(parts, padded, group=split.group)
        gathered = torch.cat([part[:, :, :count] for part, count in zip(parts, split.counts)], dim=2)
        order = split.gathered_order.to(x.device)
        return gathered.new_empty(gathered.shape).index_copy_(2, order, gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split = ctx.split
        grad = grad.contiguous()
        dist.all_reduce(grad, group=split.group)
        return grad.index_select(2, split.local.to(grad.device)), None


def context_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    context_split: ContextSplit,
    sliding_window: int | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: this rank's q [1, H, t, D] against the whole
    micro-batch's k/v (gathered) -> [1, t, H, D], each sequence attending causally to itself only (to its
    last ``sliding_window`` tokens)."""
    keys, values = _GatherTokens.apply(key, context_split), _GatherTokens.apply(value, context_split)
    local = context_split.local.to(query.device)
    gqa = key.shape[1] != query.shape[1]
    out = []
    for start, length, (first, last) in zip(context_split.starts, context_split.lengths, context_split.query_ranges):
        q = query[0, :, first:last]
        k, v = keys[0, :, start : start + length], values[0, :, start : start + length]
        q_positions = local[first:last] - start
        allowed = attends(q_positions, torch.arange(length, device=query.device), sliding_window)
        with torch.autocast(query.device.type, enabled=False):
            attended = F.scaled_dot_product_attention(
                q.float(),
                k.float(),
                v.float(),
                attn_mask=allowed,
                scale=scaling,
                enable_gqa=gqa,
                dropout_p=dropout if module.training else 0.0,
            )
        out.append(attended.to(query.dtype))
    return torch.cat(out, dim=1).transpose(0, 1)[None], None


AttentionInterface.register(CONTEXT_SDPA, context_sdpa)
