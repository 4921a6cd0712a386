"""Policy losses: the per-token objective the decoupled PPO loss (``algo/ppo.py``) ascends.

``actor.policy_loss`` names one: a built-in (``builtins.POINTS["policy_loss"]``) or your own
``'path/to/file.py:Name'`` / ``'package.module:Name'``, resolved by ``builtins.load``. The contract is a
``PolicyLoss``:

- ``surrogate(ratio, advantages, cfg) -> (objective, clipped)``: ``ratio`` is u_t = π_θ/π_prox per token
  (GSPO: its sequence's ratio), with gradient; ``advantages`` A_t; ``cfg`` the ``PPOLossConfig`` (its
  knobs: eps_clip, sapo_tau_pos, ...). ``objective`` [T] is what the gradient ascends (the loss is
  −w_t·objective_t), ``clipped`` [T] bool the tokens the clip made inactive (counted as clipped_tokens).
- ``trust_region``: False, the behaviour weight w_t is ``behav_correction``'s; True (M2PO), w_t is the raw
  π_prox/π_behav on the tokens within the batch's second-moment trust region (``ppo.second_moment_cut``)
  and the loss must be decoupled.

Your own, in ``my_loss.py`` and named by ``actor.policy_loss=my_loss.py:LINEAR``::

    from areal_hpc.algo.policy_losses import PolicyLoss

    def linear(ratio, advantages, cfg):
        return ratio * advantages, ratio.new_zeros(ratio.shape).bool()

    LINEAR = PolicyLoss(linear)

No torch import here: the config's validation reads ``trust_region`` on login nodes without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing torch here would cost a login node's config check seconds
    from torch import Tensor

PPOLossConfig = Any  # algo.ppo.PPOLossConfig, which imports this module's table through builtins
Surrogate = Callable[["Tensor", "Tensor", PPOLossConfig], tuple["Tensor", "Tensor"]]


@dataclass(frozen=True)
class PolicyLoss:
    """A surrogate ``(ratio, advantages, cfg) -> (objective, clipped)`` and whether it takes M2PO's trust region."""

    surrogate: Surrogate
    trust_region: bool = False

    def __call__(self, ratio: Tensor, advantages: Tensor, cfg: PPOLossConfig) -> tuple[Tensor, Tensor]:
        """The surrogate (a config key names callables only: ``builtins.load_object``)."""
        return self.surrogate(ratio, advantages, cfg)


def clipped(ratio: Tensor, advantages: Tensor, cfg: PPOLossConfig) -> tuple[Tensor, Tensor]:
    """PPO's min(u·A, clip(u, 1−ε, 1+ε_high)·A), ε_high = ``eps_clip_high`` or ``eps_clip`` (DAPO's clip-higher);
    clipped where the clipped term is the smaller (its gradient is 0 there)."""
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    unclipped_term = ratio * advantages
    clipped_term = ratio.clamp(1 - cfg.eps_clip, 1 + eps_high) * advantages
    return unclipped_term.minimum(clipped_term), clipped_term < unclipped_term


def soft_gate(ratio: Tensor, advantages: Tensor, cfg: PPOLossConfig) -> tuple[Tensor, Tensor]:
    """SAPO's (4/τ)·σ(τ·(u − 1))·A with τ = ``sapo_tau_pos`` where A > 0 and ``sapo_tau_neg`` elsewhere
    [Gao et al. 2025]: slope 1 at u = 1 like the plain ratio, decaying smoothly off policy; nothing clipped."""
    tau = ratio.new_tensor(cfg.sapo_tau_pos).where(advantages > 0, ratio.new_tensor(cfg.sapo_tau_neg))
    gate = (tau * (ratio - 1)).sigmoid() * (4 / tau)
    return gate * advantages, ratio.new_zeros(ratio.shape).bool()


def unclipped(ratio: Tensor, advantages: Tensor, cfg: PPOLossConfig) -> tuple[Tensor, Tensor]:
    """u·A: the plain importance-weighted policy gradient; nothing clipped."""
    return ratio * advantages, ratio.new_zeros(ratio.shape).bool()


CLIPPED = PolicyLoss(clipped)
SAPO = PolicyLoss(soft_gate)
# M2PO [Zheng et al. 2025, "Prosperity before Collapse"]: unclipped, the staleness bounded by the trust region
M2PO = PolicyLoss(unclipped, trust_region=True)
