"""AReaL's decoupled PPO loss (behaviour weight π_prox/π_behav, ratio π_θ/π_prox under the policy loss of
``policy_losses.py``: PPO's clip, SAPO's soft gate, M2PO's unclipped ratio), GSPO's sequence-level ratio,
M2PO's second-moment trust region in place of the behaviour correction, the k3 KL penalty to a reference
model, the clipped value loss, and the per-token weights that make a sum over micro-batches equal the
whole-batch aggregation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal_hpc import builtins
from areal_hpc.algo.advantages import sequence_ids
from areal_hpc.algo.policy_losses import PolicyLoss

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BEHAV_CORRECTIONS = ("cap", "mask", "kpop", "none")
IMPORTANCE_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PPOLossConfig:
    """Loss knobs; see ``decoupled_ppo_loss`` for the formula each one enters."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # DAPO clip-higher; None -> eps_clip
    behav_correction: str = "cap"
    behav_imp_weight_cap: float = 5.0
    kpop_threshold: float = 2.0
    importance_level: str = "token"
    decoupled: bool = True  # False: PPO's own loss, the ratio and clip against the behaviour policy
    kl_coef: float = 0.0
    policy_loss: str = builtins.POINTS["policy_loss"].default  # a built-in's name or a spec: see ``objective``
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # ... and for A <= 0 (the paper: steeper, negative updates spread wider)
    m2_threshold: float = 0.04  # M2PO: bound on the mean of (log π_prox/π_behav)² over the kept tokens

    def __post_init__(self):
        if self.behav_correction not in BEHAV_CORRECTIONS:
            raise ValueError(f"behav_correction={self.behav_correction!r}; valid: {', '.join(BEHAV_CORRECTIONS)}")
        if self.importance_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance_level={self.importance_level!r}; valid: {', '.join(IMPORTANCE_LEVELS)}")
        if self.objective.trust_region and not self.decoupled:
            raise ValueError(f"policy_loss={self.policy_loss!r} bounds log π_prox/π_behav: it needs the decoupled loss")

    @property
    def objective(self) -> PolicyLoss:
        """The ``PolicyLoss`` ``policy_loss`` names (``builtins.load``: one ``UserError`` line when it names none)."""
        return builtins.load("policy_loss", self.policy_loss)


def token_weights(
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    aggregation: str,
    n_tokens: int,
    n_seqs: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[T] weight per position so that Σ weights·loss over every micro-batch and rank is the batch aggregate.

    ``n_tokens``, ``n_seqs`` are totals over the whole batch (all micro-batches, all ranks), ``max_len`` the
    Dr.GRPO normaliser (e.g. the generation budget). token-mean: 1/n_tokens; seq-mean-token-mean:
    1/(n_seqs·len_i) with len_i the loss tokens of sequence i; seq-mean-token-sum-norm: 1/(n_seqs·max_len).
    0 off the mask.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    mask = loss_mask.to(dtype)
    if aggregation == "token-mean":
        return mask / max(n_tokens, 1)
    if aggregation == "seq-mean-token-sum-norm":
        return mask / (max(n_seqs, 1) * max_len)
    seq_ids = sequence_ids(cu_seqlens)
    seq_len = torch.zeros(len(cu_seqlens) - 1, dtype=dtype, device=mask.device).index_add_(0, seq_ids, mask)
    return mask / (max(n_seqs, 1) * seq_len[seq_ids].clamp(min=1))


def _binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(Bern(p) ‖ Bern(q)) = p·log(p/q) + (1−p)·log((1−p)/(1−q)) from log-probabilities (1−p by expm1)."""
    one_minus_p, one_minus_q = -torch.expm1(log_p), -torch.expm1(log_q)
    # xlogy: 0·log 0 = 0, so p = 1 is exact rather than NaN
    tail = torch.xlogy(one_minus_p, one_minus_p) - torch.xlogy(one_minus_p, one_minus_q)
    return log_p.exp() * (log_p - log_q) + tail


def _behaviour_weight(raw_w, proximal_logprobs, behaviour_logprobs, mask, cfg: PPOLossConfig):
    """(w, keep): the behaviour importance weight π_prox/π_behav after the correction, and the tokens it keeps."""
    if cfg.behav_correction == "none":
        return torch.ones_like(raw_w), mask
    if cfg.behav_correction == "cap":
        return raw_w.clamp(max=cfg.behav_imp_weight_cap), mask
    if cfg.behav_correction == "mask":
        return raw_w, mask & (raw_w <= cfg.behav_imp_weight_cap)
    p, q = proximal_logprobs.detach().double(), behaviour_logprobs.detach().double()
    return raw_w, mask & (torch.maximum(_binary_kl(p, q), _binary_kl(q, p)) <= cfg.kpop_threshold)


def second_moment_cut(log_ratio: torch.Tensor, threshold: float) -> float:
    """M2PO's trust region [Zheng et al. 2025, "Prosperity before Collapse"]: mask the largest
    M2_i = (log π_prox/π_behav)_i² one by one until the mean over the tokens left is ≤ ``threshold``; the
    tokens kept are those with M2 below the returned cut (inf: none masked).

    ``log_ratio`` holds every loss token of the batch (all minibatches and ranks: the bound is on the batch).
    Tokens tied with the last one masked go too (the mean only falls further), so the result does not
    depend on their order.
    """
    m2 = log_ratio.detach().double() ** 2
    if not len(m2) or m2.mean() <= threshold:
        return math.inf
    descending = m2.sort(descending=True).values
    kept_sum = descending.sum() - descending.cumsum(0)  # Σ of the tokens left after masking the first k+1
    kept_count = torch.arange(len(m2) - 1, -1, -1, dtype=m2.dtype, device=m2.device)
    within = kept_sum <= threshold * kept_count
    within[-1] = True  # masking every token leaves an empty mean: within any bound
    return float(descending[int(within.nonzero()[0])])


def decoupled_ppo_loss(
    logprobs,
    proximal_logprobs,
    behaviour_logprobs,
    advantages,
    loss_mask,
    cu_seqlens,
    weights,
    cfg: PPOLossConfig,
    reference_logprobs=None,
    trust_keep=None,
) -> tuple[torch.Tensor, dict]:
    """Σ_t weights_t · ℓ_t over this micro-batch, and additive statistics.

    ℓ_t = −w_t · min(u_t·A_t, clip(u_t, 1−ε, 1+ε_high)·A_t) + kl_coef · k3_t   [AReaL eq. decoupled PPO]
    (the min(...) term is ``cfg.objective``'s surrogate, PPO's clip by default: ``policy_losses.py``)
    u_t = exp(logp_t − logp_prox_t) (token level) or, for GSPO, s_i = exp(mean_{t∈i}(logp_t − logp_prox_t))
    on every token of sequence i, with the gradient flowing through the mean. w_t = exp(logp_prox − logp_behav)
    without gradient, capped at ``behav_imp_weight_cap`` ("cap"), or the token dropped when w_t exceeds the cap
    ("mask") or when max(KL_bin(p‖q), KL_bin(q‖p)) > ``kpop_threshold`` with p, q the proximal and behaviour
    probabilities of the token ("kpop"); "none" sets w_t = 1.
    k3_t = exp(logp_ref − logp) − (logp_ref − logp) − 1 estimates KL(π_θ ‖ π_ref) (Schulman's k3).
    Dropped and off-mask tokens contribute exactly 0; the weights keep counting dropped tokens, so the loss
    stays normalised by the original token count.

    ``decoupled=False`` is PPO's own loss: the behaviour policy stands in for the proximal one, so u_t is
    π_θ/π_behav, its clip bounds how far a token moves from the policy that sampled it (over all the steps
    since, with stale data), and w_t = 1 whatever ``behav_correction`` says.

    A policy loss with a ``trust_region`` (M2PO) takes the raw w_t (π_prox/π_behav) on the tokens ``trust_keep``
    holds, the batch's second-moment trust region (M2 below ``second_moment_cut``), in place of the
    behaviour correction.

    Statistics are this micro-batch's sums and counts over its loss tokens, to be added across micro-batches
    and ranks (``*_max`` keys: take the max): loss_tokens, kept_tokens (not dropped by the behaviour
    correction or the trust region), clipped_tokens (kept tokens whose clipped term is the active one),
    capped_tokens (w above the cap), behav_weight_sum (Σw before correction; its mean is 1 when the
    behaviour logprobs are those of the sampler), behav_weight_dev_sum (Σ|w−1| before correction), behav_weight_max,
    ratio_max (max u), approx_kl_sum (Σ ½(logp − logp_prox)², KL(prox ‖ new) to second order), ref_kl_sum
    (Σ k3, with a reference).
    """
    mask = loss_mask.bool()
    if not cfg.decoupled:  # the sampler stands in for the proximal policy
        proximal_logprobs = behaviour_logprobs
    token_log_ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0)
    log_ratio = token_log_ratio
    if cfg.importance_level == "sequence":
        seq_ids = sequence_ids(cu_seqlens)
        sums = token_log_ratio.new_zeros(len(cu_seqlens) - 1).index_add(0, seq_ids, token_log_ratio)
        counts = sums.new_zeros(len(sums)).index_add_(0, seq_ids, mask.to(sums.dtype)).clamp(min=1)
        log_ratio = torch.where(mask, (sums / counts)[seq_ids], 0.0)
    ratio = log_ratio.exp()
    objective = cfg.objective
    surrogate, clipped = objective.surrogate(ratio, advantages, cfg)
    raw_w = torch.where(mask, proximal_logprobs - behaviour_logprobs, 0.0).detach().exp()
    if objective.trust_region:
        if trust_keep is None:
            raise ValueError(
                f"policy_loss={cfg.policy_loss!r} needs trust_keep, the tokens within the batch's second_moment_cut"
            )
        w, keep = raw_w, mask & trust_keep.bool()
    elif not cfg.decoupled:
        w, keep = torch.ones_like(raw_w), mask
    else:
        w, keep = _behaviour_weight(raw_w, proximal_logprobs, behaviour_logprobs, mask, cfg)
    per_token = -w * surrogate
    ref_kl = None
    if reference_logprobs is not None:
        log_ref_ratio = torch.where(mask, reference_logprobs - logprobs, 0.0)
        ref_kl = log_ref_ratio.exp() - log_ref_ratio - 1
        per_token = per_token + cfg.kl_coef * ref_kl
    loss = (weights * torch.where(keep, per_token, 0.0)).sum()

    with torch.no_grad():
        totals = {
            "loss_tokens": mask.sum(),
            "kept_tokens": keep.sum(),
            "clipped_tokens": (keep & clipped).sum(),
            "capped_tokens": (mask & (raw_w > cfg.behav_imp_weight_cap)).sum(),
            "behav_weight_sum": torch.where(mask, raw_w, 0.0).sum(),
            "behav_weight_dev_sum": torch.where(mask, (raw_w - 1).abs(), 0.0).sum(),
            "behav_weight_max": torch.where(mask, raw_w, 0.0).max(),
            "ratio_max": torch.where(mask, ratio, 0.0).max(),
            "approx_kl_sum": (0.5 * token_log_ratio**2).sum(),
        }
        if ref_kl is not None:
            totals["ref_kl_sum"] = torch.where(mask, ref_kl, 0.0).sum()
        values = torch.stack([v.double() for v in totals.values()]).tolist()  # one device sync, not one per stat
        stats = dict(zip(totals, values))
    return loss, stats


def value_loss(values, old_values, returns, loss_mask, weights, value_clip: float = 0.2) -> torch.Tensor:
    """Σ weights · ½·max((v − R)², (clip(v, v_old ± c) − R)²) over loss positions (PPO clipped value loss)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (weights * torch.where(loss_mask.bool(), per_token, 0.0)).sum()
