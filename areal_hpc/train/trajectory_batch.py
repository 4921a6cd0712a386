"""From trajectory records to the RL training batch: token sequences, behaviour logprobs and the
temperature they were sampled at in the packed layout, shaped rewards, advantages, loss weights, split
into PPO minibatches and data-parallel parts.

Everything here runs on trainer rank 0, which sees the whole batch (group statistics and the loss
normaliser need it); the parts it hands to ranks are self-contained.
"""

from __future__ import annotations

import numpy as np
import torch

from areal_hpc import builtins
from areal_hpc.algo.advantages import expand_to_tokens, sequence_advantages
from areal_hpc.algo.filters import overlong_penalty
from areal_hpc.algo.ppo import token_weights
from areal_hpc.algo.temperature import logprob_temperature
from areal_hpc.algo.tree_balance import tree_parts
from areal_hpc.config import ActorConfig
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.engines.sequence_batch import SequenceBatch, balanced_parts


def next_token_values(values: list[float], last: float = 0.0) -> torch.Tensor:
    """Per-token values (entry i about token i) in the packed layout: position t holds token t+1's, the
    last position ``last``."""
    return torch.tensor([*values[1:], last][: len(values)], dtype=torch.float32)


def trajectory_sequence(
    traj: Trajectory, run_temperature: float
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """All segments back to back: tokens, per-token loss mask, and at position t-1 the behaviour logprob
    of token t and the temperature to recompute it at: the ``logprob_temperature`` of the one its segment
    was sampled at (recorded, else the run's ``run_temperature``)."""
    tokens, mask, logprobs, temperatures = [], [], [], []
    for seg in traj.segments:
        tokens += seg.input_ids.tolist() + seg.output_ids.tolist()
        mask += [0] * len(seg.input_ids) + seg.loss_mask.tolist()
        logprobs += [0.0] * len(seg.input_ids) + seg.output_logprobs.tolist()
        sampled_at = run_temperature if seg.temperature is None else seg.temperature
        temperatures += [logprob_temperature(sampled_at)] * (len(seg.input_ids) + len(seg.output_ids))
    return tokens, mask, next_token_values(logprobs), next_token_values(temperatures, last=1.0)


def shaped_reward(traj: Trajectory, cfg: ActorConfig, max_new_tokens: int) -> float:
    """The recorded reward (a missing or failed one counts 0) plus DAPO's overlong penalty when enabled."""
    reward = traj.reward or 0.0
    if cfg.overlong_cache_tokens:
        reward += overlong_penalty(
            traj.n_output_tokens, max_new_tokens, cfg.overlong_cache_tokens, cfg.overlong_penalty
        )
    return reward


def build_batch(
    trajectories: list[Trajectory],
    cfg: ActorConfig,
    max_new_tokens: int,
    run_temperature: float,
    teacher_logprobs: list[list[float]] | None = None,
    reward_weight: float = 1.0,
) -> SequenceBatch:
    """Sequences with their logprob temperatures, ``behav_logprobs``, ``rewards`` and (sequence
    estimators) ``advantages`` fields. ``run_temperature``: the run's sampling temperature
    (``algo.temperature.run_temperature``), that of records that recorded none. With
    ``teacher_logprobs`` (per trajectory, entry i the teacher's logprob of token i) they become a
    ``teacher_logprobs`` field and the reward's advantages are scaled by ``reward_weight``; the
    policy loss adds the teacher's pull on the proximal policy (``PPOActor``)."""
    sequences, masks, behaviour, temperatures = zip(*(trajectory_sequence(t, run_temperature) for t in trajectories))
    rewards = torch.tensor([shaped_reward(t, cfg, max_new_tokens) for t in trajectories])
    batch = SequenceBatch(list(sequences), list(masks), {"behav_logprobs": list(behaviour)}, list(temperatures))
    batch.fields["rewards"] = [torch.full((len(s),), float(r)) for s, r in zip(sequences, rewards)]
    if not builtins.uses_critic(cfg.adv_estimator):
        _, group_ids = np.unique([t.group_id for t in trajectories], return_inverse=True)
        advantages = sequence_advantages(rewards, torch.as_tensor(group_ids), cfg.adv_estimator)
        if teacher_logprobs is not None:
            advantages = reward_weight * advantages
            # (positions before a sequence's first target were not scored: NaN there, read as 0)
            batch.fields["teacher_logprobs"] = [next_token_values(scores).nan_to_num() for scores in teacher_logprobs]
        packed, _ = batch.packed()
        batch.set_packed("advantages", expand_to_tokens(advantages, packed.cu_seqlens))
    return batch


def split_minibatches(
    batch: SequenceBatch, trajectories: list[Trajectory], cfg: ActorConfig, max_new_tokens: int
) -> list[SequenceBatch]:
    """PPO minibatches of whole groups, each with its own ``weights`` field (the loss normaliser of
    that minibatch: each one is a separate optimizer step)."""
    groups: dict[str, list[int]] = {}
    for i, traj in enumerate(trajectories):
        groups.setdefault(traj.group_id, []).append(i)
    members = list(groups.values())
    n = min(cfg.ppo_n_minibatches, len(members))
    minibatches = []
    for k in range(n):
        mb = batch.select([i for group in members[k::n] for i in group])
        packed, _ = mb.packed()
        mb.set_packed(
            "weights",
            token_weights(
                packed.target_mask,
                packed.cu_seqlens,
                cfg.aggregation,
                n_tokens=packed.n_targets,
                n_seqs=len(mb),
                max_len=max_new_tokens,
            ),
        )
        minibatches.append(mb)
    return minibatches


def data_parallel_parts(
    minibatches: list[SequenceBatch],
    world_size: int,
    weights: list[float] | None = None,
    tree_cost: list[float] | None = None,
) -> list[list[SequenceBatch]]:
    """Rank r's share of every minibatch, in proportion to ``weights``: ``parts[r][k]``. By tokens, or
    with ``tree_cost`` (tree training) contiguous runs of the minibatch's prefix tree balanced by that
    cost model (``algo.tree_balance``)."""
    parts: list[list[SequenceBatch]] = [[] for _ in range(world_size)]
    for mb in minibatches:
        if tree_cost is not None:
            shares = tree_parts(mb.sequences, world_size, tree_cost, weights)
        else:
            shares = balanced_parts([len(s) for s in mb.sequences], world_size, weights)
        for rank, indices in enumerate(shares):
            parts[rank].append(mb.select(indices))
    return parts
