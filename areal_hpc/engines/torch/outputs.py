"""The per-position forwards of a packed batch that every trainer shares: the policy's logprob of
the next token at the sampler's temperature (with the policy's entropy there), and a critic's value.
The temperature is the batch's per position where it carries them (each record's own: a proxy
turn's, ``algo.temperature``), else the engine's (``generation``'s).

Rollout servers (the embedded engine and SGLang) report the logprob of each sampled token under
``log_softmax(logits / T)``, T the request's temperature, before any top-p / top-k truncation. The
trainer computes the same quantity, so the behaviour weight π_prox/π_behav of decoupled PPO compares
like with like and the policy gradient is that of the distribution the sampler draws from. With
top-p < 1 or top-k > 0 a token is drawn from the truncated, renormalised distribution, whose
probability of it is p_T / (kept mass) ≥ p_T; both sides still use the untruncated p_T (as AReaL
does), which treats the truncated sampler as the full tempered policy.

Only target positions reach the LM head, a chunk of rows at a time, each recomputed in the backward
pass rather than kept (``algo.logprobs``, which every path shares): for a 152k vocabulary and 4,096
targets the full logits would take 2.5 GB (and their log-softmax as much again); a chunk takes 128 MiB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_hpc.algo.logprobs import token_logprobs
from areal_hpc.algo.packing import PackedBatch
from areal_hpc.models.segment_forward import padded_rows
from areal_hpc.models.varlen import packed_attention, packed_attention_inputs
from areal_hpc.parallel.context import CONTEXT_SDPA, ContextShard


def decoder_hidden(model: torch.nn.Module, batch: PackedBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: the decoder's last hidden state over a packed batch. A pipeline stage starts from
    ``hidden`` [T, H], the previous stage's output, instead of the token embeddings (and a stage
    before the last has no final norm: it returns its last layer's output)."""
    inputs = {"input_ids": batch.input_ids} if hidden is None else {"inputs_embeds": hidden[None]}
    if isinstance(batch, ContextShard):  # a context-parallel rank's tokens: attention over every rank's
        implementation, attention = CONTEXT_SDPA, {"context_split": batch.split}
    else:
        implementation, attention = packed_attention_inputs(model, batch.cu_seqlens)
    with packed_attention(model, implementation):
        return model.base_model(
            **inputs, position_ids=batch.position_ids, use_cache=False, **attention
        ).last_hidden_state[0]


def target_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    tokens: torch.Tensor,
    temperatures: torch.Tensor | float = 1.0,
    chunk_bytes: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``tokens`` [N] under softmax(head(hidden) / T) for ``hidden`` [N, H], and the entropies,
    a chunk of rows at a time (``algo.logprobs.token_logprobs``). T: one for all rows, or each row's
    (``temperatures`` [N, 1]). ``softcap``: the logits are ``softcap * tanh(logits / softcap)`` first (Gemma's
    ``final_logit_softcapping``). The rows are padded to ``padded_rows`` first: the chunks' products then
    have shapes that repeat from step to step."""
    n = len(hidden)
    extra = padded_rows(n) - n
    if torch.is_tensor(temperatures) and temperatures.numel() > 1:
        temperatures = F.pad(temperatures, (0, 0, 0, extra), value=1.0)
    logprobs, entropy = token_logprobs(
        F.pad(hidden, (0, 0, 0, extra)),
        F.pad(tokens, (0, extra)),
        temperatures,
        weight=head.weight,
        bias=head.bias,
        softcap=softcap,
        chunk_bytes=chunk_bytes,
    )
    return logprobs[:n], entropy[:n]


class StageOutputs:
    """Per-position outputs of a packed batch: the decoder, then ``head``. An engine's
    ``forward_fn(model, batch)``; a pipeline stage passes the previous stage's ``hidden`` and whether
    it is the ``last`` (the others return their hidden state)."""

    def __call__(
        self, model: torch.nn.Module, batch: PackedBatch, hidden: torch.Tensor | None = None, last: bool = True
    ):
        hidden = decoder_hidden(model, batch, hidden)
        return self.head(model, hidden, batch) if last else hidden

    def head(self, model: torch.nn.Module, hidden: torch.Tensor, batch: PackedBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class PolicyOutputs(StageOutputs):
    """The policy's outputs at the sampler's temperature: the batch's per position, else ``temperature``."""

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def head(self, model: torch.nn.Module, hidden: torch.Tensor, batch: PackedBatch) -> dict[str, torch.Tensor]:
        return next_token_outputs(model.get_output_embeddings(), hidden, batch, self.temperature, final_softcap(model))


def final_softcap(model: torch.nn.Module) -> float | None:
    """The softcap a model applies to its output logits (Gemma's ``final_logit_softcapping``), or None."""
    return getattr(model.config, "final_logit_softcapping", None)


def next_token_outputs(
    output_layer: torch.nn.Linear,
    hidden: torch.Tensor,
    batch: PackedBatch,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> dict[str, torch.Tensor]:
    """{"logprobs", "entropy"}: [T] log p_T(token t+1 | tokens <= t) within each sequence, p_T =
    softmax(output_layer(hidden) / T) (its logits softcapped where ``softcap``), and the entropy of p_T there;
    0 where nothing is predicted."""
    targets, tokens = batch.target_tokens()
    logprobs, entropy = target_logprobs(
        hidden[targets], output_layer, tokens, batch.target_temperatures(targets, temperature), softcap=softcap
    )
    total = batch.input_ids.shape[1]
    return {
        "logprobs": logprobs.new_zeros(total).index_put((targets,), logprobs),
        "entropy": entropy.new_zeros(total).index_put((targets,), entropy),
    }


class ValueOutputs(StageOutputs):
    """A critic's outputs (its token classifier's)."""

    def head(self, model: torch.nn.Module, hidden: torch.Tensor, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """{"values"}: [T] the critic's value of the state after token t (where token t+1 is chosen)."""
        return {"values": model.score(model.dropout(hidden))[:, 0].float()}


class RegularisedRewardOutputs(ValueOutputs):
    """A reward model's values and, through the language head it holds for its regulariser
    (``models.hf.attach_language_head``), the logprobs of the next tokens at temperature 1."""

    def head(self, model: torch.nn.Module, hidden: torch.Tensor, batch: PackedBatch) -> dict[str, torch.Tensor]:
        language = next_token_outputs(model.language_head, hidden, batch, softcap=final_softcap(model))
        return super().head(model, hidden, batch) | language


def packed_policy_outputs(
    model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """``PolicyOutputs(temperature)`` of a packed batch: {"logprobs", "entropy"} per position."""
    return PolicyOutputs(temperature)(model, batch)


def packed_values(model: torch.nn.Module, batch: PackedBatch) -> dict[str, torch.Tensor]:
    """``ValueOutputs`` of a packed batch: {"values"} per position."""
    return ValueOutputs()(model, batch)
