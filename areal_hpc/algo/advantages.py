"""Advantage estimators: group/batch-normalised sequence rewards (GRPO family, RLOO, REINFORCE++) and GAE.

Token tensors are flat [T] over packed sequences (``cu_seqlens`` bounds); position t carries quantities
about predicting token t+1, so only ``loss_mask`` positions are actions. Every standard deviation here
is the population one (divide by n, ``unbiased=False``): it is defined for groups of one (0, so the
advantage is 0 rather than NaN) and is what "normalise this batch" means for a fixed batch.

The sequence estimators are ``actor.adv_estimator``'s built-ins (``builtins.POINTS``); a user's own is a
function of the same signature, named by its spec and called through ``sequence_advantages``.
"""

from __future__ import annotations

import torch

from areal_hpc import builtins


def _group_stats(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element: the sum and size of its group, and the population std of its group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    sums = x.new_zeros(n_groups).index_add_(0, inverse, x)
    counts = x.new_zeros(n_groups).index_add_(0, inverse, torch.ones_like(x))
    means = sums / counts
    sq = x.new_zeros(n_groups).index_add_(0, inverse, (x - means[inverse]) ** 2)
    return sums[inverse], counts[inverse], (sq / counts).sqrt()[inverse]


def _centred(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """r - group mean."""
    sums, counts, _ = _group_stats(rewards, group_ids)
    return rewards - sums / counts


def _batch_normalise(x: torch.Tensor, eps: float, centre: bool = True) -> torch.Tensor:
    mean = x.mean() if centre else 0.0
    return (x - mean) / (x.std(unbiased=False) + eps)


def sequence_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str, eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per sequence from its scalar reward; ``group_ids`` equal = answers to one prompt.

    ``estimator`` (``actor.adv_estimator``) is a built-in's name or the user's spec (``builtins.load``): a
    function ``(rewards: float64 [N], group_ids: [N], eps) -> [N]``, the built-ins below. It gets the
    rewards in float64; its advantages come back in the rewards' dtype.
    """
    estimate = builtins.load("advantage_estimator", estimator)
    return estimate(rewards.double(), group_ids, eps).to(rewards.dtype)


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - group mean) / (group std + eps)  [DeepSeekMath GRPO]"""
    sums, counts, group_std = _group_stats(rewards, group_ids)
    return (rewards - sums / counts) / (group_std + eps)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """r - group mean  [Dr.GRPO: no std]"""
    return _centred(rewards, group_ids)


def lite_ppo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - group mean) / (batch std of those + eps)  [LitePPO: group mean, batch std]"""
    return _batch_normalise(_centred(rewards, group_ids), eps, centre=False)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """r - mean of the other answers of the group (0 for a group of one)  [RLOO]"""
    sums, counts, _ = _group_stats(rewards, group_ids)
    others = counts - 1
    return torch.where(others > 0, rewards - (sums - rewards) / others.clamp(min=1), torch.zeros_like(rewards))


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - batch mean) / (batch std + eps)  [REINFORCE++]"""
    return _batch_normalise(rewards, eps)


def reinforce_pp_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """r - group mean, then batch-normalised  [REINFORCE++-baseline]"""
    return _batch_normalise(_centred(rewards, group_ids), eps)


def distillation_advantages(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, target_mask: torch.Tensor
) -> torch.Tensor:
    """On-policy distillation's per-token advantage [T]: log p_teacher(y) - log p_student(y) of each
    sampled token y on target positions, 0 elsewhere. Its mean under the student is minus the reverse
    KL(student || teacher) of that position, and as the advantage of a policy gradient it gives minus
    that KL's gradient (E[grad log p_student] = 0): each token is pulled towards the teacher where the
    student sampled it (on-policy distillation, Agarwal et al. 2024; no credit to earlier tokens)."""
    return torch.where(target_mask, teacher_logprobs - student_logprobs, torch.zeros_like(student_logprobs))


def expand_to_tokens(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] per-sequence values -> [T], each sequence's value on all of its positions."""
    return torch.repeat_interleave(values, cu_seqlens.diff(), dim=0)


def sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sequence each position belongs to."""
    return expand_to_tokens(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), cu_seqlens)


def outcome_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] zeros except each sequence's reward on its last loss position (dropped if it has none)."""
    positions = torch.where(loss_mask, torch.arange(len(loss_mask), device=loss_mask.device), -1)
    last = positions.new_full((len(cu_seqlens) - 1,), -1)
    last.scatter_reduce_(0, sequence_ids(cu_seqlens), positions, "amax")
    out = rewards.new_zeros(len(loss_mask))
    has_loss = last >= 0
    out[last[has_loss]] = rewards[has_loss]
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's loss positions, in order.

    With k indexing a sequence's loss positions: delta_k = r_k + gamma * V_{k+1} - V_k (V after the last
    action is 0), A_k = delta_k + gamma * lam * A_{k+1}, returns R_k = A_k + V_k [Schulman et al. 2016].
    Returns (advantages [T], returns [T]), both 0 off the mask. The recursion runs backwards over the
    action index, vectorised across sequences.
    """
    positions = loss_mask.nonzero()[:, 0]
    seq_ids = sequence_ids(cu_seqlens)[positions]
    n_actions = torch.bincount(seq_ids, minlength=len(cu_seqlens) - 1)
    starts = n_actions.cumsum(0) - n_actions
    step = torch.arange(len(positions), device=positions.device) - starts[seq_ids]  # action index within its sequence
    width = int(n_actions.max()) if len(positions) else 0
    # [N, width + 1] action-major grids; the extra column is the terminal V = 0, A = 0.
    r = values.new_zeros(len(n_actions), width + 1)
    v = torch.zeros_like(r)
    r[seq_ids, step] = token_rewards[positions].to(values.dtype)
    v[seq_ids, step] = values[positions].detach()
    adv = torch.zeros_like(r)
    for k in range(width - 1, -1, -1):
        delta = r[:, k] + gamma * v[:, k + 1] - v[:, k]
        adv[:, k] = delta + gamma * lam * adv[:, k + 1]
    advantages = values.new_zeros(len(loss_mask))
    advantages[positions] = adv[seq_ids, step]
    returns = torch.zeros_like(advantages)
    returns[positions] = advantages[positions] + values[positions].detach()
    return advantages, returns
