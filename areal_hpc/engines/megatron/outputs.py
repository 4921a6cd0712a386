"""Per-position outputs of the last pipeline stage's packed micro-batch: the policy's "logprobs" and "entropy",
or the critic's "values" from its ``ValueHead``.

The policy's output layer is a ``LogprobHead``: it turns the hidden states into each position's logprob and
entropy itself, through ``algo.logprobs.token_logprobs`` with its vocabulary-parallel weight (a chunk of
positions at a time, the chunk's logits recomputed in the backward pass; the max and the sums over the TP
ranks per chunk), so the [tokens, V/tp] logits and their gradient never exist whole. Every position's row
goes through it, its target's or a stand-in's (token 0), and positions without a target are zeroed after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_hpc.algo.logprobs import VocabularyShard, token_logprobs
from areal_hpc.algo.packing import PackedBatch
from areal_hpc.engines.base import Outputs


@dataclass(frozen=True)
class PassTargets:
    """What the policy's head scores at each position of a pass: ``tokens`` [T], the next token where it is
    trained (0 elsewhere), and ``temperatures`` [T, 1], the sampler's at that position."""

    tokens: torch.Tensor
    temperatures: torch.Tensor

    @classmethod
    def of(cls, packed: PackedBatch, temperature: float) -> PassTargets:
        """The targets of ``packed`` (a context shard's too) at its per-position temperatures, else
        ``temperature``."""
        targets, tokens = packed.target_tokens()
        positions = torch.arange(packed.input_ids.shape[1], device=tokens.device)
        return cls(
            tokens.new_zeros(len(positions)).index_put((targets,), tokens),
            packed.target_temperatures(positions, temperature),
        )


class LogprobHead(torch.nn.Module):
    """The policy's output layer in GPTModel's ``output_layer`` slot, holding the layer's weight [V/tp, H] under
    the same name (None where this stage's embedding is tied to it: GPTModel hands that one in): hidden states
    [s, b, H] (a TP rank's slice of s under sequence parallelism) -> [s, b, 2], log p_T(target) and the entropy
    of p_T at each position over the whole vocabulary of ``tp_group``'s ranks, for the ``PassTargets`` that
    GPTModel's forward passes on as ``runtime_gather_output`` (which it hands its output layer untouched). The
    hidden states' gradient is summed over the TP ranks (reduce-scattered under sequence parallelism), as
    Megatron's ``ColumnParallelLinear`` sums it."""

    def __init__(self, weight: torch.nn.Parameter | None, tp_group, *, sequence_parallel: bool = False):
        super().__init__()
        self.register_parameter("weight", weight)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        targets = runtime_gather_output
        if not isinstance(targets, PassTargets):
            raise TypeError(f"the policy's output layer scores PassTargets, not {type(targets).__name__}")
        weight = self.weight if weight is None else weight
        group = self.tp_group
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
        shard = VocabularyShard(dist.get_rank(group) * len(weight), group) if dist.get_world_size(group) > 1 else None
        logprobs, entropy = token_logprobs(
            hidden.flatten(0, 1), targets.tokens, targets.temperatures, weight=weight, shard=shard
        )
        return torch.stack([logprobs, entropy], -1).view(*hidden.shape[:2], 2), None


def per_position_outputs(output: torch.Tensor, packed: PackedBatch, *, critic: bool) -> Outputs:
    """Per-position "logprobs" and "entropy" (0 off target positions) from a ``LogprobHead``'s [1, T, 2] output;
    a critic's "values" from its head's [1, T, 1]."""
    if critic:
        return {"values": output[0, :, 0].float()}
    logprobs, entropy = output[0].unbind(-1)
    trained = packed.target_mask
    return {"logprobs": logprobs.where(trained, 0.0), "entropy": entropy.detach().where(trained, 0.0)}
