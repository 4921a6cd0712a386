"""The torch-native training engine: one model replica per data-parallel rank (gloo on CPU, NCCL on GPU).

The surface every engine implements (DESIGN.md section 5), so a Megatron engine can stand behind it:

    engine.forward(batch)                   # [T] per-position outputs (logprobs, or values for a critic), no grad
    engine.train_step(batch, loss_fn)       # micro-batched forward/backward, DP all-reduce, clip, step
    engine.state_dict_for_rollout()         # Hugging Face names, what rollout servers load
    engine.save(folder); engine.load(folder)

Losses are weighted sums whose weights already carry the normaliser of the whole minibatch (see
``algo.ppo.token_weights``), so summing gradients over micro-batches and ranks is exact.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches
from areal_hpc.config import OptimizerConfig
from areal_hpc.models.hf import save_model
from areal_hpc.train.sequence_batch import SequenceBatch
from areal_hpc.train.optim import build_optimizer, build_scheduler

ForwardFn = Callable[[torch.nn.Module, PackedBatch], torch.Tensor]
LossFn = Callable[[torch.Tensor, PackedBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
TRAINING_STATE = "training_state.pt"


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine statistics of micro-batches or ranks: ``*_max`` keys by max, everything else summed."""
    merged: dict[str, float] = defaultdict(float)
    for part in parts:
        for key, value in part.items():
            merged[key] = max(merged.get(key, value), value) if key.endswith("_max") else merged[key] + value
    return dict(merged)


class TorchTrainEngine:
    def __init__(self, model: torch.nn.Module, forward_fn: ForwardFn, *, optimizer: OptimizerConfig | None = None,
                 lr: float = 0.0, total_steps: int = 1, max_tokens_per_mb: int = 4096,
                 dp_group: dist.ProcessGroup | None = None, tokenizer=None):
        self.model, self.forward_fn, self.tokenizer = model, forward_fn, tokenizer
        self.device = next(model.parameters()).device
        self.max_tokens_per_mb, self.dp_group = max_tokens_per_mb, dp_group
        self.clip = optimizer.gradient_clipping if optimizer else 0.0
        self.optimizer = build_optimizer(model, optimizer, lr) if optimizer else None
        self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps) if optimizer else None
        self._broadcast_from_rank0()

    def _broadcast_from_rank0(self) -> None:
        """Start every data-parallel replica from rank 0's weights (a freshly initialised head, e.g. a
        critic's, would otherwise differ between ranks)."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        root = dist.get_global_rank(self.dp_group, 0)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            dist.broadcast(tensor.data, src=root, group=self.dp_group)

    def _microbatches(self, batch: SequenceBatch):
        for indices in dynamic_microbatches([len(s) for s in batch.sequences], self.max_tokens_per_mb):
            packed, fields = batch.select(indices).packed()
            yield indices, packed.to(self.device), {k: v.to(self.device) for k, v in fields.items()}

    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per-sequence [len] outputs of ``forward_fn`` (in the batch's order), computed micro-batch by micro-batch."""
        self.model.eval()  # recomputed logprobs and values are the policy's, never a dropout sample
        out: list[torch.Tensor | None] = [None] * len(batch)
        for indices, packed, _ in self._microbatches(batch):
            values = self.forward_fn(self.model, packed).float().cpu()
            for i, part in zip(indices, values.split([len(batch.sequences[i]) for i in indices])):
                out[i] = part
        return out

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's part of a minibatch (which may be empty)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for _, packed, fields in self._microbatches(batch):
            loss, mb_stats = loss_fn(self.forward_fn(self.model, packed), packed, fields)
            loss.backward()
            parts.append({"loss": loss.item(), **mb_stats})
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
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat, group=self.dp_group)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p))

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, folder: Path) -> None:
        """The model in Hugging Face format plus optimizer and schedule state (call on one rank)."""
        save_model(self.model, self.tokenizer, folder)
        if self.optimizer is not None:
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
