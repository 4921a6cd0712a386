"""One PPO update on a trainer rank: recompute the proximal policy's logprobs, (PPO) value estimates
and GAE, (M2PO) the batch's second-moment trust region, then one optimizer step per minibatch with the
decoupled PPO loss (and the value loss).

Every rank runs ``update`` on its own part of each minibatch; gradients are summed across ranks by
the engine, and whole-batch statistics (GAE whitening) by an all-reduce here. The actor uses only the
``TrainEngine`` protocol, so any engine (torch-native, Megatron) stands behind it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from areal_hpc.algo.advantages import distillation_advantages, gae, outcome_token_rewards
from areal_hpc.algo.ppo import PPOLossConfig, decoupled_ppo_loss, second_moment_cut, value_loss
from areal_hpc.config import ActorConfig
from areal_hpc.engines.base import TrainEngine, merge_stats
from areal_hpc.engines.sequence_batch import SequenceBatch


def loss_config(cfg: ActorConfig) -> PPOLossConfig:
    return PPOLossConfig(
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high or None,
        behav_correction=cfg.behav_correction,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
        kpop_threshold=cfg.kpop_threshold,
        importance_level=cfg.importance_level,
        decoupled=cfg.decoupled_loss,
        kl_coef=cfg.kl_coef,
        policy_loss=cfg.policy_loss,
        sapo_tau_pos=cfg.sapo_tau_pos,
        sapo_tau_neg=cfg.sapo_tau_neg,
        m2_threshold=cfg.m2_threshold,
    )


class PPOActor:
    def __init__(
        self,
        actor: TrainEngine,
        cfg: ActorConfig,
        reference: TrainEngine | None = None,
        critic: TrainEngine | None = None,
        dp_group: dist.ProcessGroup | None = None,
        distill_weight: float = 0.0,
    ):
        """``distill_weight``: ``distill.kl_weight``, the weight of the teacher's pull on batches that
        carry a ``teacher_logprobs`` field (on-policy distillation)."""
        self.actor, self.reference, self.critic, self.cfg = actor, reference, critic, cfg
        self.loss_cfg, self.dp_group, self.distill_weight = loss_config(cfg), dp_group, distill_weight

    def update(self, minibatches: list[SequenceBatch]) -> dict[str, float]:
        started = time.perf_counter()
        # The proximal policy is the one before this step's first update. With one minibatch it is the
        # policy the update's own forward runs, so its logprobs come from that pass (detached), unless a
        # policy loss with a trust region (M2PO) needs them before the update. PPO's own loss (not
        # decoupled) takes its ratio against the sampler and needs no proximal policy.
        recompute = self.loss_cfg.decoupled and (len(minibatches) > 1 or self.loss_cfg.objective.trust_region)
        for mb in minibatches:
            if len(mb) and recompute:
                mb.fields["prox_logprobs"] = self.actor.forward(mb)["logprobs"]
            if len(mb) and self.reference is not None:
                mb.fields["ref_logprobs"] = self.reference.forward(mb)["logprobs"]
        if self.critic is not None:
            self._estimate_advantages(minibatches)
        if self.loss_cfg.objective.trust_region:
            self._second_moment_trust_region(minibatches)
        recomputed = time.perf_counter()
        steps = []
        for mb in minibatches:
            steps.append({f"actor/{k}": v for k, v in self.actor.train_step(mb, self._policy_loss).items()})
            if self.critic is not None:
                steps.append({f"critic/{k}": v for k, v in self.critic.train_step(mb, self._value_loss).items()})
        return {
            **merge_stats(steps),
            "time/logprob": recomputed - started,
            "time/update": time.perf_counter() - recomputed,
        }

    def _policy_loss(self, outputs, packed, f):
        logprobs = outputs["logprobs"]
        proximal = f["prox_logprobs"] if "prox_logprobs" in f else logprobs.detach()
        advantages = f["advantages"]
        if "teacher_logprobs" in f:  # distillation pulls the policy of this step's start, not the sampler
            advantages = advantages + self.distill_weight * distillation_advantages(
                f["teacher_logprobs"], proximal, packed.target_mask
            )
        loss, stats = decoupled_ppo_loss(
            logprobs,
            proximal,
            f["behav_logprobs"],
            advantages,
            packed.target_mask,
            packed.cu_seqlens,
            f["weights"],
            self.loss_cfg,
            f.get("ref_logprobs"),
            f.get("trust_keep"),
        )
        return loss, {**stats, "entropy_sum": float(outputs["entropy"].sum())}

    def _value_loss(self, outputs, packed, f):
        loss = value_loss(
            outputs["values"], f["old_values"], f["returns"], packed.target_mask, f["weights"], self.cfg.value_clip
        )
        return loss, {}

    def _second_moment_trust_region(self, minibatches: list[SequenceBatch]) -> None:
        """M2PO: the ``trust_keep`` field, 1 on the tokens within the whole batch's (all minibatches, all
        ranks) second-moment bound on log π_prox/π_behav."""
        log_ratios = []
        for mb in minibatches:
            if len(mb):
                packed, f = mb.packed()
                log_ratios.append((f["prox_logprobs"] - f["behav_logprobs"])[packed.target_mask].double().cpu())
        local = torch.cat(log_ratios) if log_ratios else torch.zeros(0, dtype=torch.float64)
        if self.dp_group is not None:
            gathered: list = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, local, group=self.dp_group)
            local = torch.cat(gathered)
        cut = second_moment_cut(local, self.loss_cfg.m2_threshold)
        for mb in minibatches:
            if len(mb):
                mb.fields["trust_keep"] = [
                    ((p - b).double() ** 2 < cut).float()
                    for p, b in zip(mb.fields["prox_logprobs"], mb.fields["behav_logprobs"])
                ]

    def _estimate_advantages(self, minibatches: list[SequenceBatch]) -> None:
        """PPO: GAE from the critic's values with the outcome reward on the last output token, then
        whitened over every loss token of the batch (all minibatches, all ranks)."""
        moments = torch.zeros(3, dtype=torch.float64, device=self.critic.device)  # NCCL reduces device tensors
        for mb in minibatches:
            if not len(mb):
                continue
            mb.fields["old_values"] = self.critic.forward(mb)["values"]
            packed, f = mb.packed()
            rewards = f["rewards"][packed.cu_seqlens[:-1]]
            token_rewards = outcome_token_rewards(rewards, packed.target_mask, packed.cu_seqlens)
            advantages, returns = gae(
                token_rewards, f["old_values"], packed.target_mask, packed.cu_seqlens, self.cfg.gamma, self.cfg.lam
            )
            mb.set_packed("advantages", advantages)
            mb.set_packed("returns", returns)
            trained = advantages[packed.target_mask].double()
            count = torch.tensor(float(trained.numel()), dtype=torch.float64, device=trained.device)
            moments += torch.stack([trained.sum(), (trained**2).sum(), count]).to(moments.device)
        if self.dp_group is not None:
            dist.all_reduce(moments, group=self.dp_group)
        total, squares, count = moments.tolist()
        mean = total / max(count, 1.0)
        std = max(squares / max(count, 1.0) - mean**2, 0.0) ** 0.5
        for mb in minibatches:
            if len(mb):
                mb.fields["advantages"] = [(a - mean) / (std + 1e-6) for a in mb.fields["advantages"]]
