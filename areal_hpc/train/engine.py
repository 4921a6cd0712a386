"""Training engines: the ``TrainEngine`` protocol (DESIGN.md section 5) that the PPO actor, SFT,
checkpoints and the weight push use, and its torch-native implementation (one model replica per
data-parallel rank, gloo on CPU, NCCL on GPU). A Megatron engine implements the same protocol.

Losses are weighted sums whose weights already carry the normaliser of the whole minibatch (see
``algo.ppo.token_weights``), so summing gradients over micro-batches and ranks is exact.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches
from areal_hpc.config import OptimizerConfig
from areal_hpc.models.hf import DTYPES, save_model
from areal_hpc.train.optim import build_optimizer, build_scheduler
from areal_hpc.train.sequence_batch import SequenceBatch

Outputs = dict[str, torch.Tensor]  # per-position outputs of a packed micro-batch, e.g. {"logprobs", "entropy"}
ForwardFn = Callable[[torch.nn.Module, PackedBatch], Outputs]
LossFn = Callable[[Outputs, PackedBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
WeightBucket = list[tuple[str, torch.Tensor]]
TRAINING_STATE = "training_state.pt"


class TrainEngine(Protocol):
    """What the actor, SFT, checkpoints and the weight push may use of an engine; nothing else.

    ``forward`` and ``train_step`` take a ``SequenceBatch`` (whole sequences, per-position fields) and
    cut it into packed micro-batches themselves. A policy engine's per-position output is
    "logprobs", log π_T(token t+1 | tokens ≤ t) at the sampler's temperature T (``gconfig.temperature``:
    rollout logprobs are those of ``log_softmax(logits / T)``), and "entropy", on target positions only
    (0 elsewhere); a critic's is "values".
    """

    device: torch.device  # where this rank's tensors live (NCCL reduces device tensors only)
    tokenizer: object  # saved with the weights, so a saved folder is a complete Hugging Face model

    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        """Each output as per-sequence [len] tensors, without gradient, in the model's evaluation mode."""

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's share: ``loss_fn(outputs, packed, fields)`` per micro-batch,
        gradients summed over micro-batches and data-parallel ranks, clipped, applied."""

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The weights rollout servers load, as (Hugging Face name, tensor) buckets of at most
        ``bucket_bytes`` each (a larger tensor gets a bucket of its own)."""

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        """The model in Hugging Face format (what servers and ``areal-hpc eval`` load), plus optimizer
        and schedule state unless ``optimizer=False``. Collective over the data-parallel group."""

    def load(self, folder: Path) -> None:
        """Restore what ``save`` wrote (optimizer state when present). Collective; every rank calls it."""


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine statistics of micro-batches or ranks: ``*_max`` keys by max, everything else summed."""
    merged: dict[str, float] = defaultdict(float)
    for part in parts:
        for key, value in part.items():
            merged[key] = max(merged.get(key, value), value) if key.endswith("_max") else merged[key] + value
    return dict(merged)


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


class TorchTrainEngine:
    """``TrainEngine`` on a plain ``torch.nn.Module`` replicated over the data-parallel group.

    ``forward_fn`` turns the model and a packed micro-batch into per-position outputs (e.g.
    ``logprobs.packed_policy_outputs`` at the sampler's temperature, or ``packed_values``).
    Save writes from data-parallel rank 0 only (replicas are identical), so the driver may call it
    on rank 0 alone.
    """

    def __init__(self, model: torch.nn.Module, forward_fn: ForwardFn, *, optimizer: OptimizerConfig | None = None,
                 lr: float = 0.0, total_steps: int = 1, max_tokens_per_mb: int = 4096,
                 dp_group: dist.ProcessGroup | None = None, tokenizer=None, compute_dtype: str = "float32"):
        self.model, self.forward_fn, self.tokenizer = model, forward_fn, tokenizer
        self.device = next(model.parameters()).device
        self.compute_dtype = DTYPES[compute_dtype]
        self.max_tokens_per_mb, self.dp_group = max_tokens_per_mb, dp_group
        self.clip = optimizer.gradient_clipping if optimizer else 0.0
        self.optimizer = build_optimizer(model, optimizer, lr) if optimizer else None
        self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps) if optimizer else None
        self._broadcast_from_rank0()

    def _data_parallel(self) -> bool:
        return self.dp_group is not None and dist.get_world_size(self.dp_group) > 1

    def _broadcast_from_rank0(self) -> None:
        """Start every data-parallel replica from rank 0's weights (a freshly initialised head, e.g. a
        critic's, would otherwise differ between ranks)."""
        if not self._data_parallel():
            return
        root = dist.get_global_rank(self.dp_group, 0)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            dist.broadcast(tensor.data, src=root, group=self.dp_group)

    def _compute(self):
        """Autocast to ``compute_dtype`` (matrix multiplies in bfloat16, master weights kept)."""
        lower = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=lower)

    def _microbatches(self, batch: SequenceBatch):
        for indices in dynamic_microbatches([len(s) for s in batch.sequences], self.max_tokens_per_mb):
            packed, fields = batch.select(indices).packed()
            yield indices, packed.to(self.device), {k: v.to(self.device) for k, v in fields.items()}

    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        self.model.eval()  # recomputed logprobs and values are the policy's, never a dropout sample
        out: dict[str, list[torch.Tensor | None]] = {}
        for indices, packed, _ in self._microbatches(batch):
            lengths = [len(batch.sequences[i]) for i in indices]
            with self._compute():
                outputs = self.forward_fn(self.model, packed)
            for name, values in outputs.items():
                per_sequence = out.setdefault(name, [None] * len(batch))
                for i, part in zip(indices, values.float().cpu().split(lengths)):
                    per_sequence[i] = part
        return out

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's part of a minibatch (which may be empty)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for _, packed, fields in self._microbatches(batch):
            with self._compute():
                outputs = self.forward_fn(self.model, packed)
            loss, mb_stats = loss_fn(outputs, packed, fields)
            loss.backward()
            parts.append({"loss": loss.item(), "microbatches": 1.0, **mb_stats})
        stats = merge_stats(parts)
        self._all_reduce_grads()
        max_norm = self.clip if self.clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        stats["grad_norm"], stats["lr"] = float(grad_norm), self.scheduler.get_last_lr()[0]  # the lr of this step
        self.optimizer.step()
        self.scheduler.step()
        return stats

    def _all_reduce_grads(self) -> None:
        """Sum gradients over data-parallel ranks in one flat buffer (a rank without data adds zeros)."""
        if not self._data_parallel():
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat, group=self.dp_group)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p))

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The state dict under its Hugging Face names (tied weights appear under both names, as in
        the state dict the servers' models have), on this engine's device."""
        named = ((name, tensor.detach().contiguous()) for name, tensor in self.model.state_dict().items())
        return weight_buckets(named, bucket_bytes)

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        if self._data_parallel() and dist.get_rank(self.dp_group) != 0:
            return
        save_model(self.model, self.tokenizer, folder)
        if optimizer and self.optimizer is not None:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       folder / TRAINING_STATE)

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for shard in sorted(folder.glob("*.safetensors")):
            state.update(load_file(shard, device=str(self.device)))
        missing, _ = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied:
            raise RuntimeError(f"checkpoint {folder} lacks {sorted(set(missing) - tied)[:5]}")
        if self.optimizer is not None and (folder / TRAINING_STATE).exists():
            training = torch.load(folder / TRAINING_STATE, map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(training["optimizer"])
            self.scheduler.load_state_dict(training["scheduler"])
