"""Objectives on preference pairs (a prompt, a chosen and a rejected completion): DPO's sigmoid loss with
label smoothing (cDPO), IPO's squared loss, and the Bradley-Terry loss of a scalar reward model.

Each is a function of one number per pair, the margin: for DPO and IPO h = (log π(y_c) − log π_ref(y_c))
− (log π(y_r) − log π_ref(y_r)) with log π(y) the summed log-likelihood of the completion; for
Bradley-Terry h = r(x, y_c) − r(x, y_r). The trainer (``train.preference``) differentiates the loss by
the margin and hands the engine a per-token weight on the log-likelihoods (or on the last value), whose
gradient is the objective's: pairs need not share a micro-batch, so any engine and any data-parallel
split trains them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "bradley_terry")


@dataclass(frozen=True)
class PairLossConfig:
    loss: str = "sigmoid"
    beta: float = 0.1  # DPO/IPO: strength of the KL constraint to the reference
    label_smoothing: float = 0.0  # cDPO: the probability that a pair's labels are flipped

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r}; valid: {', '.join(LOSSES)}")
        if not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing}; valid: 0 <= label_smoothing <= 0.5")


def pair_losses(margin: torch.Tensor, cfg: PairLossConfig) -> torch.Tensor:
    """[n] loss of each pair from its margin h [DPO: Rafailov et al. 2023; cDPO; IPO: Azar et al. 2023]:
    sigmoid: −(1−ε)·log σ(β·h) − ε·log σ(−β·h); ipo: (h − 1/(2β))²; bradley_terry: −log σ(h)."""
    if cfg.loss == "ipo":
        return (margin - 1 / (2 * cfg.beta)) ** 2
    if cfg.loss == "bradley_terry":
        return -F.logsigmoid(margin)
    scaled = cfg.beta * margin
    return -(1 - cfg.label_smoothing) * F.logsigmoid(scaled) - cfg.label_smoothing * F.logsigmoid(-scaled)


def margin_gradients(margin: torch.Tensor, cfg: PairLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean loss over the pairs, d(mean loss)/d(margin) per pair), in float64."""
    with torch.enable_grad():  # also inside an evaluation's no_grad
        margin = margin.detach().double().requires_grad_()
        loss = pair_losses(margin, cfg).mean()
        (gradient,) = torch.autograd.grad(loss, margin)
    return loss.detach(), gradient


def sequence_coefficients(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    cfg: PairLossConfig,
    nll_weight: float = 0.0,
    chosen_log_likelihood: torch.Tensor | None = None,
    chosen_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(the objective, [2n] its derivative by each sequence's score, [2n] its derivative by each sequence's
    log-likelihood, extra statistics), sequences in pair order (chosen, rejected, ...). The objective is
    the mean pair loss of h = chosen − rejected, plus with ``nll_weight`` α α · mean_i(−log π(y_c,i) / |y_c,i|)
    from the chosen log-likelihoods and lengths: RPO for DPO (whose score is itself a log-likelihood, so
    the two derivatives add up), a language-model regulariser for a reward model."""
    loss, gradient = margin_gradients(chosen - rejected, cfg)
    likelihood, extra = torch.zeros(len(gradient), 2, dtype=torch.float64), {}
    if nll_weight:
        tokens = chosen_tokens.double()
        nll = -(chosen_log_likelihood.double() / tokens).mean()
        loss = loss + nll_weight * nll
        likelihood[:, 0] = -nll_weight / (len(tokens) * tokens)
        extra["chosen_nll"] = float(nll)
    return loss, torch.stack([gradient, -gradient], dim=1).reshape(-1), likelihood.reshape(-1), extra


def pair_statistics(margin: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, scale: float) -> dict:
    """Pairwise accuracy (margin > 0; a tie counts one half) and the mean rewards of each side and of their
    difference: for DPO the implicit rewards β·(log π − log π_ref) (``scale`` β), for a reward model its scores
    (``scale`` 1)."""
    ranked = (margin > 0).double() + 0.5 * (margin == 0).double()
    return {
        "accuracy": float(ranked.mean()),
        "reward_chosen": scale * float(chosen.double().mean()),
        "reward_rejected": scale * float(rejected.double().mean()),
        "reward_margin": scale * float(margin.double().mean()),
    }
