"""Per-position outputs of the last pipeline stage's packed micro-batch: the policy's "logprobs" and
"entropy" from the vocabulary-parallel logits (``algo.logprobs``: a chunk of positions at a time, the max
and the sums over the TP ranks per chunk), or the critic's "values" from its ``ValueHead``.

Every position's row goes through the log-softmax, its target's or a stand-in's, and positions without a
target are zeroed after: the logits of all positions exist anyway (the model's output layer computes them),
and whole rows are views of them, where picking the targets' rows would copy them all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_hpc.algo.logprobs import VocabularyShard, token_logprobs
from areal_hpc.algo.packing import PackedBatch
from areal_hpc.engines.base import Outputs


def vocab_parallel_outputs(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(token), entropy of p_T) per row of this TP rank's vocabulary slice ``logits`` [N, V/tp],
    T the row's of ``temperatures`` [N, 1], over the whole vocabulary of ``group``'s ranks."""
    width = logits.shape[-1]
    shard = VocabularyShard(dist.get_rank(group) * width, group) if dist.get_world_size(group) > 1 else None
    return token_logprobs(logits, tokens, temperatures, shard=shard)


def per_position_outputs(
    logits: torch.Tensor, packed: PackedBatch, *, critic: bool, temperature: float, tp_group
) -> Outputs:
    """Per-position "logprobs" and "entropy" (0 off target positions) from [1, T, V/tp] logits at the
    batch's per-position temperatures, else ``temperature``; a critic's "values" from its head's [1, T, 1]."""
    if critic:
        return {"values": logits[0, :, 0].float()}
    targets, tokens = packed.target_tokens()
    positions = torch.arange(logits.shape[1], device=logits.device)
    tokens = tokens.new_zeros(len(positions)).index_put((targets,), tokens)  # token 0 where none is trained
    logprobs, entropy = vocab_parallel_outputs(  # a view (logits[0]'s gradient would be a new [1, T, V/tp] tensor)
        logits.flatten(0, 1), tokens, packed.target_temperatures(positions, temperature), tp_group
    )
    trained = packed.target_mask
    return {"logprobs": logprobs.where(trained, 0.0), "entropy": entropy.where(trained, 0.0)}
