"""What every training engine shares: the ``TrainEngine`` protocol that the PPO actor, SFT, checkpoints
and the weight push use (nothing else of an engine), the roles an engine is built for (``ROLES``) and
what each reads of the config (``role_training``), the types of its loss and weight buckets, and the
helpers both engines call (statistics merged over micro-batches and ranks, weight bucketing).
``engines.factory.build_engine`` builds every engine through its class's ``build``.

Losses are weighted sums whose weights already carry the normaliser of the whole minibatch (see
``algo.ppo.token_weights``), so summing gradients over micro-batches and ranks is exact.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from areal_hpc.algo.packing import PackedBatch
from areal_hpc.algo.temperature import logprob_temperature, run_temperature
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import TrainMesh

Outputs = dict[str, torch.Tensor]  # per-position outputs of a packed micro-batch, e.g. {"logprobs", "entropy"}
ForwardFn = Callable[[torch.nn.Module, PackedBatch], Outputs]
LossFn = Callable[[Outputs, PackedBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
WeightBucket = list[tuple[str, torch.Tensor]]
TRAINING_STATE = "training_state.pt"
OPTIMIZER_SHARDS = "optimizer"  # a sharded engine's optimizer state: one torch.distributed.checkpoint

ROLES = {  # what an engine is built to train: role -> its name in an error line
    "policy": "the RL policy",
    "reference": "the RL policy's frozen reference (actor.kl_coef > 0)",
    "critic": "the PPO critic",
    "sft": "the SFT policy",
    "dpo": "the DPO policy (it scores its own reference log-likelihoods before the first step)",
    "rm": "the reward model",
}
RL_ROLES = ("policy", "reference", "critic")  # the ones actor.lora and actor.tree_training apply to


@dataclass(frozen=True)
class RoleTraining:
    """What an engine of one role trains with, read from the config; ``lr`` None: frozen."""

    critic: bool  # a value head ("values") instead of the policy's "logprobs" and "entropy"
    lr: float | None
    total_steps: int
    max_tokens_per_mb: int
    temperature: float  # of the policy's logprobs: the sampler's for RL, 1 (the data's likelihood) otherwise


def sampler_temperature(cfg) -> float:
    """The temperature of the rollout logprobs the trainer must match: ``generation.temperature``, or 1
    for greedy rollouts (temperature 0, whose logprobs servers report untempered)."""
    return logprob_temperature(run_temperature(cfg.generation))


def role_training(role: str, cfg) -> RoleTraining:
    """``role``'s ``RoleTraining`` in the run ``cfg`` (a ``RunConfig``)."""
    if role in RL_ROLES:
        actor = cfg.actor
        steps = cfg.rl.total_train_steps * min(actor.ppo_n_minibatches, cfg.rollout.consumer_batch_size)
        lr = {"policy": actor.lr, "reference": None, "critic": actor.critic_lr}[role]
        return RoleTraining(role == "critic", lr, steps, actor.max_tokens_per_mb, sampler_temperature(cfg))
    if role == "sft":
        return RoleTraining(False, cfg.sft.lr, cfg.sft.total_train_steps, cfg.sft.max_tokens_per_mb, 1.0)
    if role in ("dpo", "rm"):
        pcfg = cfg.preference
        return RoleTraining(role == "rm", pcfg.lr, pcfg.total_train_steps, pcfg.max_tokens_per_mb, 1.0)
    raise ValueError(f"role={role!r}; valid: {', '.join(ROLES)}")


def engine_options(training: RoleTraining, cfg, mesh: TrainMesh | None, tokenizer) -> dict:
    """The keyword arguments every engine's constructor takes for a role: its mesh, optimizer (none when
    frozen), schedule, micro-batch budget, tokenizer, compute dtype and recomputation."""
    return dict(
        mesh=mesh,
        optimizer=cfg.optimizer if training.lr else None,
        lr=training.lr or 0.0,
        total_steps=training.total_steps,
        max_tokens_per_mb=training.max_tokens_per_mb,
        tokenizer=tokenizer,
        compute_dtype=cfg.model.compute_dtype,
        recompute=cfg.actor.recompute,
    )


def unsupported_role(cfg, role: str) -> UserError:
    """The one line an engine class raises for a role its ``build`` does not build."""
    return UserError(
        f"actor.engine={cfg.actor.engine} does not train {ROLES[role]} ({role}) yet; use actor.engine=torch"
    )


class TrainEngine(Protocol):
    """What the actor, SFT, checkpoints and the weight push may use of an engine; nothing else.

    ``forward`` and ``train_step`` take a ``SequenceBatch`` (whole sequences, per-position fields) and
    cut it into packed micro-batches themselves. A policy engine's per-position output is
    "logprobs", log π_T(token t+1 | tokens ≤ t) at the sampler's temperature T (rollout logprobs are
    those of ``log_softmax(logits / T)``): the batch's ``temperatures`` per position where it carries
    them (each record's own), else the engine's (``generation.temperature``); and "entropy", on target
    positions only (0 elsewhere); a critic's is "values".

    An engine class subclasses it: ``build`` is how ``engines.factory.build_engine`` makes one, and the
    capabilities below (False unless the class says otherwise) are what the run's rules ask of
    ``actor.engine``, so a subclass of an engine inherits its answers.
    """

    supports_tree_training: ClassVar[bool] = False  # actor.tree_training=dta: trains a batch's prefix tree
    supports_lora: ClassVar[bool] = False  # actor.lora.rank > 0
    supports_training_groups: ClassVar[bool] = False  # actor.parallel.groups: sums gradients across the groups

    device: torch.device  # where this rank's tensors live (NCCL reduces device tensors only)
    tokenizer: object  # saved with the weights, so a saved folder is a complete Hugging Face model

    @classmethod
    def build(cls, role: str, cfg, mesh: TrainMesh | None, path: Path, tokenizer) -> TrainEngine:
        """An engine of ``role`` (one of ``ROLES``) for the run ``cfg``, from the Hugging Face folder
        ``path``, on ``mesh`` (None: one process on ``cluster.device``); ``unsupported_role`` for a role
        the class does not build (here: every role)."""
        raise unsupported_role(cfg, role)

    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        """Each output as per-sequence [len] tensors, without gradient, in the model's evaluation mode.
        Collective: every rank calls it with its data-parallel replica's share and gets all of its outputs."""

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's share: ``loss_fn(outputs, packed, fields)`` per micro-batch,
        gradients summed over micro-batches and data-parallel ranks, clipped, applied. Collective; the
        statistics are the replica's own, the same on each of its ranks."""

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The weights rollout servers load, as (Hugging Face name, full tensor) buckets of at most
        ``bucket_bytes`` each (a larger tensor gets a bucket of its own). Collective: every rank iterates
        to the end; the buckets are complete on global rank 0 (other ranks may get empty ones)."""

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        """The model in Hugging Face format (what servers and ``areal-hpc eval`` load), plus optimizer
        and schedule state unless ``optimizer=False``. Collective: every rank of the mesh calls it."""

    def load(self, folder: Path) -> None:
        """Restore what ``save`` wrote (optimizer state when present). Collective; every rank calls it."""


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine statistics of micro-batches or ranks: ``*_max`` keys by max, everything else summed."""
    merged: dict[str, float] = defaultdict(float)
    for part in parts:
        for key, value in part.items():
            merged[key] = max(merged.get(key, value), value) if key.endswith("_max") else merged[key] + value
    return dict(merged)


def merge_over_context(stats: dict[str, float], mesh: TrainMesh) -> dict[str, float]:
    """A replica's statistics from its context-parallel ranks' (each saw part of every sequence, and
    counted the same micro-batches)."""
    if mesh is None or mesh.dims.cp == 1:
        return stats
    every = [None] * mesh.dims.cp
    dist.all_gather_object(every, stats, group=mesh.group("cp"))
    merged = merge_stats(every)
    if "microbatches" in stats:
        merged["microbatches"] = stats["microbatches"]
    return merged


def weight_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Consecutive (name, tensor) pairs grouped into buckets of at most ``bucket_bytes``."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
