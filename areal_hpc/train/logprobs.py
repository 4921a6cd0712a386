"""The per-position forwards of a packed batch that every trainer shares: the policy's logprob of
the next token at the sampler's temperature, and a critic's value estimate.

Rollout servers (the embedded engine and SGLang) report the logprob of each sampled token under
``log_softmax(logits / T)``, T the request's temperature, before any top-p / top-k truncation. The
trainer computes the same quantity, so the behaviour weight π_prox/π_behav of decoupled PPO compares
like with like and the policy gradient is that of the distribution the sampler draws from. With
top-p < 1 or top-k > 0 a token is drawn from the truncated, renormalised distribution, whose
probability of it is p_T / (kept mass) ≥ p_T; both sides still use the untruncated p_T (as AReaL
does), which treats the truncated sampler as the full tempered policy.
"""

import torch

from areal_hpc.algo.packing import PackedBatch


def packed_token_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """[T] log p_T(token t+1 | tokens <= t) within each sequence, p_T = softmax(logits / temperature)
    (0 where nothing is predicted)."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    next_tokens = torch.roll(batch.input_ids[0], shifts=-1)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, next_tokens[:, None])[:, 0]
    return torch.where(batch.target_mask, logprobs, torch.zeros_like(logprobs))


def packed_values(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T] the critic's value of the state after token t (the state in which token t+1 is chosen)."""
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0, :, 0].float()
