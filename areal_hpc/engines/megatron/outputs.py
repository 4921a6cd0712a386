"""Per-position outputs of the last pipeline stage's packed micro-batch: the policy's "logprobs" and
"entropy" from the vocabulary-parallel logits (a logsumexp over the TP ranks), or the critic's "values"
from its ``ValueHead``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_hpc.algo.packing import PackedBatch
from areal_hpc.engines.base import Outputs


def vocab_parallel_outputs(
    logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(token), entropy of p_T) per row of this TP rank's vocabulary slice ``logits`` [N, V/tp],
    T the row's of ``temperatures`` [N, 1]: the logsumexp and the target's logit are all-reduced over
    ``group`` (backward: identity)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    logits = logits.float() / temperatures
    peak = logits.detach().amax(-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak[:, None]
    normaliser = reduce(shifted.exp().sum(-1), group).log()
    width = logits.shape[-1]
    local = tokens - dist.get_rank(group) * width
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1)[:, None])[:, 0] * inside
    logprobs = reduce(picked, group) - normaliser
    with torch.no_grad():  # logged, not trained
        expected = reduce((shifted - normaliser[:, None]).exp().mul(shifted).sum(-1), group)
        entropy = normaliser - expected
    return logprobs, entropy


def per_position_outputs(
    logits: torch.Tensor, packed: PackedBatch, *, critic: bool, temperature: float, tp_group
) -> Outputs:
    """Per-position "logprobs" and "entropy" (0 off target positions) from [1, T, V/tp] logits at the
    batch's per-position temperatures, else ``temperature``; a critic's "values" from its head's [1, T, 1]."""
    if critic:
        return {"values": logits[0, :, 0].float()}
    targets, tokens = packed.target_tokens()
    logprobs, entropy = vocab_parallel_outputs(
        logits[0, targets], tokens, packed.target_temperatures(targets, temperature), tp_group
    )
    total = packed.input_ids.shape[1]
    return {
        "logprobs": logprobs.new_zeros(total).index_put((targets,), logprobs),
        "entropy": entropy.new_zeros(total).index_put((targets,), entropy),
    }
