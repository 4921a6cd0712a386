"""``TrainEngine`` on Megatron-core (``actor.engine=megatron``): a GPTModel split over the trainer
mesh's tensor-parallel, context-parallel and pipeline ranks (a Qwen3-MoE's experts also over its
expert-parallel ranks), Megatron DDP (or, with ``actor.parallel.fsdp``, Megatron's FSDP2 wrapper) over
its data-parallel ranks, loaded from and saved to Hugging Face folders. The pieces live beside it:
``model`` (building and wrapping the model, the gradient norm), ``schedule`` (packed micro-batches
through Megatron's schedules), ``outputs`` (per-position outputs), ``checkpoint`` (HF folders, the
rollout push, optimizer state) and ``convert`` (HF <-> Megatron tensors).

- The policy's "logprobs" and "entropy", and the PPO critic's (``kind="critic"``) "values", come from
  the last stage and reach every rank of the pipeline.
- The optimizer and schedule are ``engines.optim``'s on each rank's shards (Adam is elementwise);
  gradients are finalised without Megatron's per-token scaling.
- ``compute_dtype="bfloat16"`` is Megatron's bf16 mixed precision (``model``): bf16 parameters and
  compute, fp32 gradients, fp32 master weights and Adam state. The rollout push and the saved folder
  hold the bf16 parameters (what the trainer computes with; servers cast them to their own dtype); the
  optimizer shards hold the fp32 masters.
- ``recompute`` (``actor.recompute``) is Megatron's activation recomputation: "selective" reruns each
  layer's core attention in the backward pass, "full" each layer's forward from its input.
- ``actor.parallel.distributed_optimizer`` is Megatron's distributed optimizer (ZeRO-1) around the same
  AdamW: DDP reduce-scatters the gradients, each dp x cp rank clips and steps its share of the fp32
  master weights and Adam state, and the parameters are all-gathered; its checkpoint resumes in any dp.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from areal_hpc.algo.packing import PackedBatch
from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.base import (
    RL_ROLES,
    TRAINING_STATE,
    LossFn,
    Outputs,
    TrainEngine,
    WeightBucket,
    engine_options,
    merge_over_context,
    merge_stats,
    role_training,
    unsupported_role,
)
from areal_hpc.engines.megatron.checkpoint import (
    buckets_on_rank0,
    load_hf_weights,
    load_optimizer_state,
    save_hf_folder,
    save_optimizer_state,
    stage_hf_tensors,
)
from areal_hpc.engines.megatron.convert import ModelShape
from areal_hpc.engines.megatron.model import (
    build_stage,
    check_layout,
    clip_grad_norm,
    in_compute_dtype,
    initialize_megatron,
    with_distributed_optimizer,
    with_fp32_master_weights,
    wrap_data_parallel,
)
from areal_hpc.engines.megatron.outputs import PassTargets, per_position_outputs
from areal_hpc.engines.megatron.schedule import Pass, from_last_stage, microbatches, run_schedule
from areal_hpc.engines.optim import build_optimizer, build_scheduler
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.extras import require
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import DTYPES
from areal_hpc.parallel.device import resolve_device
from areal_hpc.parallel.mesh import TrainMesh, build_mesh, init_distributed
from areal_hpc.resolve import Host


class MegatronTrainEngine(TrainEngine):
    """``TrainEngine`` on a Megatron-core GPTModel built from the Hugging Face folder ``path`` over
    ``mesh`` (one process when ``mesh`` is None). ``kind`` is "policy" (per-position "logprobs" and
    "entropy") or "critic" (HF's token classifier with one label: "values")."""

    @classmethod
    def build(cls, role: str, cfg, mesh: TrainMesh | None, path: Path, tokenizer) -> MegatronTrainEngine:
        """The RL roles (policy, reference, critic); SFT, DPO and the reward model read the Hugging Face
        module itself (held-out evaluation, the regulariser's language head): one line, before anything
        imports Megatron."""
        if role not in RL_ROLES:
            raise unsupported_role(cfg, role)
        training = role_training(role, cfg)
        require("megatron.core")  # the extra `megatron`: one line naming it when it is missing
        return cls(
            str(path),
            "critic" if training.critic else "policy",
            temperature=training.temperature,
            **engine_options(training, cfg, mesh, tokenizer),
        )

    def __init__(
        self,
        path: str,
        kind: str,
        *,
        temperature: float = 1.0,
        mesh: TrainMesh | None = None,
        optimizer: OptimizerConfig | None = None,
        lr: float = 0.0,
        total_steps: int = 1,
        max_tokens_per_mb: int = 4096,
        tokenizer=None,
        compute_dtype: str = "float32",
        recompute: str = "none",
    ):
        from transformers import AutoConfig

        if mesh is None:  # one process: a group of one, on this node's accelerator
            device = resolve_device(Host.probe().accelerator)
            if not dist.is_initialized():
                init_distributed(device)
            mesh = build_mesh(ParallelDims(), device)
        self.mesh, self.device, self.tokenizer = mesh, mesh.device, tokenizer
        self.temperature, self.max_tokens_per_mb = temperature, max_tokens_per_mb
        self.critic = kind == "critic"
        self.hf_config = AutoConfig.from_pretrained(
            path, local_files_only=True, **({"num_labels": 1} if self.critic else {})
        )
        shape = ModelShape.from_hf(self.hf_config)
        self.shape = shape.critic() if self.critic else shape
        self.bf16 = DTYPES[compute_dtype] == torch.bfloat16
        check_layout(mesh.dims, self.shape, bf16=self.bf16)
        initialize_megatron(mesh.dims, self.device)
        with torch.random.fork_rng(devices=[]):  # the throwaway initialisation draws from the default generator
            self.stage = build_stage(
                self.shape, mesh.dims, self.device, critic=self.critic, dtype=DTYPES[compute_dtype], recompute=recompute
            )
        self.config, self.pp_group = self.stage.config, self.stage.pp_group
        self.model = torch.nn.ModuleList(self.stage.chunks)  # every chunk's parameters
        self._load_hf(Path(path))
        self.trainable = optimizer is not None
        self.model.requires_grad_(self.trainable)
        self.clip = optimizer.gradient_clipping if optimizer else 0.0
        self.sharded = self.trainable and mesh.dims.fsdp
        self.zero1 = self.trainable and mesh.dims.distributed_optimizer
        self.roots = [in_compute_dtype(chunk, self.config) for chunk in self.stage.chunks]  # what the schedule runs
        if self.trainable:
            self.roots = [
                wrap_data_parallel(root, self.config, mesh, sharded=self.sharded, distributed_optimizer=self.zero1)
                for root in self.roots
            ]
        # FSDP's shards, if any; the per-tensor loop: with the fused kernel inside Megatron's ZeRO-1 wrapper its
        # sharded steps no longer matched the replicated ones bit for bit (tests/engines/test_megatron_zero1.py)
        torch_optimizer = build_optimizer(self.model, optimizer, lr, fused=False) if optimizer else None
        if self.zero1:  # its shards of the parameters replace the torch optimizer's groups' parameters
            self.optimizer = with_distributed_optimizer(
                torch_optimizer, self.roots, self.clip or float("inf"), bf16=self.bf16
            )
        elif self.bf16 and torch_optimizer:
            self.optimizer = with_fp32_master_weights(torch_optimizer)
        else:
            self.optimizer = torch_optimizer
        self.scheduler = build_scheduler(torch_optimizer, optimizer, total_steps) if optimizer else None

    def _load_hf(self, folder: Path) -> None:
        load_hf_weights(self.stage, folder, self.hf_config, self.shape, self.mesh, critic=self.critic)

    def _head_input(self, packed: PackedBatch) -> PassTargets | None:
        return None if self.critic else PassTargets.of(packed, self.temperature)

    def _outputs(self, output: torch.Tensor, packed: PackedBatch) -> Outputs:
        return per_position_outputs(output, packed, critic=self.critic)

    def _passes(self, batch: SequenceBatch) -> list[Pass]:
        return microbatches(batch, self.mesh, self.max_tokens_per_mb, sharded=self.sharded)

    # --- TrainEngine --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        """Each output as per-sequence [len] tensors, without gradient, in evaluation mode. Collective
        over the mesh: every rank calls it with its data-parallel replica's share."""
        for root in self.roots:
            root.eval()
        out: dict[str, list[torch.Tensor | None]] = {}
        passes = self._passes(batch)

        def keep(indices: list[int], outputs: Outputs, packed: PackedBatch, fields) -> torch.Tensor:
            lengths = [len(batch.sequences[i]) for i in indices]
            for name, values in outputs.items():
                per_sequence = out.setdefault(name, [None] * len(batch))
                whole = packed.split.gather(values) if self.mesh.dims.cp > 1 else values[: sum(lengths)]
                for i, part in zip(indices, whole.float().cpu().split(lengths)):
                    per_sequence[i] = part
            return torch.zeros(())

        run_schedule(self.roots, passes, self._head_input, self._outputs, keep, forward_only=True)
        return from_last_stage(out, self.mesh, self.pp_group)

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's part of a minibatch (which may be empty)."""
        for root in self.roots:
            root.train()
            root.zero_grad_buffer()
        parts = []

        def loss(indices: list[int], outputs: Outputs, packed: PackedBatch, fields) -> torch.Tensor:
            value, mb_stats = loss_fn(outputs, packed, fields)
            parts.append({"loss": value.item(), "microbatches": 1.0, **mb_stats})
            return value

        run_schedule(self.roots, self._passes(batch), self._head_input, self._outputs, loss, forward_only=False)
        stats = from_last_stage(merge_over_context(merge_stats(parts), self.mesh), self.mesh, self.pp_group)
        stats["grad_norm"], stats["lr"] = self._optimizer_step(), self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return stats

    def _optimizer_step(self) -> float:
        """Gradients reduced over the data-parallel ranks, clipped and stepped; the gradient norm."""
        from megatron.core.distributed import finalize_model_grads

        if self.zero1:  # reduce-scattered; the optimizer clips and steps its shards, then all-gathers
            finalize_model_grads(self.roots)
            _, grad_norm, _ = self.optimizer.step()
            self.optimizer.zero_grad()
            return grad_norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.sharded:  # FSDP has summed each pass's gradient shards over dp x cp in its backward
            grads = [p.grad for p in params]
        else:
            finalize_model_grads(self.roots)  # DDP's sum over dp, tied-embedding grads over pp; no scaling
            grads = [p.main_grad for p in params]  # fp32 (DDP's grad_reduce_in_fp32) whatever the parameters'
            if not self.bf16:  # the bf16 optimizer hands the main gradients to its fp32 masters itself
                for p in params:
                    p.grad = p.main_grad
        grad_norm = clip_grad_norm(
            params, grads, self.clip if self.clip > 0 else float("inf"), self.mesh, sharded=self.sharded
        )
        self.optimizer.step()
        for p in params:
            p.grad = None
        return grad_norm

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The full state dict under its Hugging Face names (a tied embedding under both names).
        Collective: every rank iterates to the end; global rank 0's buckets hold the tensors, the
        others' are empty."""
        tensors = stage_hf_tensors(self.stage, self.shape, self.mesh)
        return buckets_on_rank0(tensors, self.mesh, self.pp_group, bucket_bytes)

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        """Collective: rank 0 writes the Hugging Face folder; every rank its optimizer state
        (``optimizer/rank{N}.pt``; the distributed optimizer's gathered per tp x pp rank,
        ``optimizer/tp{T}_pp{P}.pt``), rank 0 the schedule and layout (``training_state.pt``)."""
        folder = Path(folder)
        save_hf_folder(self.rollout_weights(1 << 30), folder, self.hf_config, self.tokenizer, critic=self.critic)
        if optimizer and self.optimizer is not None:
            save_optimizer_state(folder, self.optimizer, self.scheduler, self.mesh.dims)

    def load(self, folder: Path) -> None:
        """Collective. Weights load into any layout; optimizer state (with bf16, the fp32 master weights)
        into the layout that saved it (the distributed optimizer's into any dp)."""
        folder = Path(folder)
        self._load_hf(folder)
        if self.optimizer is not None and (folder / TRAINING_STATE).exists():  # with bf16, the exact fp32 masters
            load_optimizer_state(folder, self.optimizer, self.scheduler, self.mesh.dims, self.device)
        elif self.bf16 and self.optimizer is not None:  # weights alone: fp32 masters of the loaded bf16 weights
            self.optimizer.reload_model_params()
