"""The PyTorch-native ``TrainEngine``: the plain Hugging Face model parallelised by ``parallelize``
(DTensor TP, FSDP2 or replicate, experts over ep), pipeline stages run by ``pipeline``, context shards
by ``parallel.context``; gloo on CPU, NCCL on GPU.

Precision (``model.compute_dtype=bfloat16``): with FSDP2 over several replicas (``actor.parallel.fsdp``),
FSDP's ``MixedPrecisionPolicy``: float32 sharded master weights and Adam state, bf16 parameters
all-gathered for the forward and backward (activations in bf16 too), float32 gradient reduction.
Everywhere else (one process, replicate, TP alone, experts over ep) ``torch.autocast``: float32 weights,
matrix multiplies in bf16. Either way the weight push, checkpoints and ``load`` see the float32 masters
(``model.dtype``): ``rollout_weights`` hands out full tensors in that dtype, labelled with it, and each
rollout server casts them to its own (the embedded engine's ``copy_``, SGLang's loader).

Loading (``build``): the model is built on the meta device (``models.hf.model_skeleton``) and, once parallelised,
each rank reads only its own slices of the checkpoint's safetensors files (``rank_weights``); ``load`` reads a
saved folder the same way.

Activation recomputation (``actor.recompute``): ``engines.torch.recompute``, in every layout.

LoRA (``lora``, ``actor.lora``): ``engines.torch.lora`` injects the adapters before anything else and
freezes the rest, so the optimizer holds the adapters only; the weight push and ``save(optimizer=False)``
hand out merged weights, checkpoints (``save(optimizer=True)``) the adapters, which ``load`` restores.

Tree training (``actor.tree_training=dta``): ``train_step`` runs ``engines.torch.tree`` over the prefix
tree of the whole share instead of packed micro-batches; ``forward`` stays packed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches, pack
from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.algo.tree_balance import TREE_FEATURES, node_features
from areal_hpc.config import LoRAConfig, OptimizerConfig
from areal_hpc.engines.base import (
    OPTIMIZER_SHARDS,
    RL_ROLES,
    TRAINING_STATE,
    ForwardFn,
    LossFn,
    TrainEngine,
    WeightBucket,
    engine_options,
    merge_over_context,
    merge_stats,
    role_training,
    weight_buckets,
)
from areal_hpc.engines.optim import build_optimizer, build_scheduler
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch import lora as lora_adapters
from areal_hpc.engines.torch.experts import reduce_expert_gradients
from areal_hpc.engines.torch.mixed_gradients import MixedGradientSum
from areal_hpc.engines.torch.outputs import PolicyOutputs, RegularisedRewardOutputs, ValueOutputs
from areal_hpc.engines.torch.parallelize import (
    PackedForward,
    clip_grad_norm,
    full_state,
    parallelize,
    reduce_head_norm_gradients,
    sharded_mixed_precision,
)
from areal_hpc.engines.torch.pipeline import Pipeline
from areal_hpc.engines.torch.rank_weights import read_rank_weights
from areal_hpc.engines.torch.recompute import recompute_activations
from areal_hpc.engines.torch.tree import check_tree_layout, flat_subtree_tokens, tree_train_pass
from areal_hpc.errors import UserError
from areal_hpc.models.hf import DTYPES, attach_language_head, model_skeleton, save_model
from areal_hpc.models.hub_checkpoint import CheckpointError, HubCheckpoint
from areal_hpc.parallel.context import context_passes
from areal_hpc.parallel.device import resolve_device
from areal_hpc.parallel.mesh import TrainMesh

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class TorchTrainEngine(TrainEngine):
    """``TrainEngine`` on a plain Hugging Face model, parallelised over ``mesh`` by ``engines.torch.parallelize``
    (tensor parallel, FSDP2 or replicated data parallel; one process when ``mesh`` is None).

    ``forward_fn`` turns the model and a packed micro-batch into per-position outputs (e.g.
    ``outputs.packed_policy_outputs`` at the sampler's temperature, or ``packed_values``). Every rank
    of the mesh calls ``forward`` and ``train_step`` with its data-parallel replica's share (tensor-
    parallel peers with the same one) and gets complete results; ``rollout_weights``, ``save`` and
    ``load`` are collective over the whole mesh. With training groups of different shapes
    (``mesh.mixed``), ``train_step`` also sums the gradients across the groups (``mixed_gradients``),
    and ``save`` and ``rollout_weights`` are made by group 0 alone (every group holds the same weights).
    ``compute_dtype``, ``recompute`` and ``tree_training``
    as the module says (``tree_min_saved_tokens``: which shared prefixes the tree shares, see
    ``algo.prefix_tree.build_prefix_tree``); ``lora`` (a rank above 0) trains LoRA adapters instead of
    the weights.
    """

    supports_tree_training = supports_lora = supports_training_groups = True

    @classmethod
    def build(cls, role: str, cfg, mesh: TrainMesh | None, path: Path, tokenizer) -> TorchTrainEngine:
        """Every role of ``engines.base.ROLES``: the Hugging Face causal LM (a policy's) or token classifier
        (a critic's, the reward model's: ``models.hf.load_critic``) from ``path``, built on the meta device
        and read in part by each rank (``on_checkpoint``); the RL roles with ``actor.tree_training``, the RL
        policy with ``actor.lora``; the reward model with its language head for ``preference.nll_weight`` > 0."""
        training, actor, model_cfg = role_training(role, cfg), cfg.actor, cfg.model
        device = mesh.device if mesh is not None else resolve_device(cfg.cluster.device)
        checkpoint = HubCheckpoint(path)
        model = model_skeleton(checkpoint, model_cfg.dtype, model_cfg.attn_impl, critic=training.critic)
        model.requires_grad_(training.lr is not None)
        outputs = ValueOutputs() if training.critic else PolicyOutputs(training.temperature)
        if role == "rm" and cfg.preference.nll_weight > 0:
            try:
                attach_language_head(model, path)
            except CheckpointError as exc:
                raise UserError(
                    f"config key 'model.path': {exc}; the reward model's language-model regulariser "
                    "reads that output layer (preference.nll_weight=0 trains without it)"
                ) from None
            outputs = RegularisedRewardOutputs()
        tree = actor.tree_training if role in RL_ROLES else "off"
        return cls.on_checkpoint(
            model,
            checkpoint,
            outputs,
            device,
            **engine_options(training, cfg, mesh, tokenizer),
            tree_training=tree,
            tree_min_saved_tokens=actor.tree_min_saved_tokens,
            lora=actor.lora if role == "policy" else None,
        )

    @classmethod
    def on_checkpoint(
        cls, model: torch.nn.Module, checkpoint: HubCheckpoint, forward_fn: ForwardFn, device: torch.device, **options
    ) -> TorchTrainEngine:
        """The engine (``options``: the constructor's) on ``model``, built on the meta device
        (``models.hf.model_skeleton``), with ``checkpoint``'s weights: each rank of the mesh reads its part
        once the model is parallelised. One process, and LoRA (peft moves the adapters it draws to the base
        weights' device), read the whole model first, on ``device``."""
        lora = options.get("lora")
        if options.get("mesh") is None or (lora is not None and lora.rank > 0):
            read_rank_weights(model, model, checkpoint, device=device, prefix="")
            return cls(model, forward_fn, **options)
        return cls(model, forward_fn, checkpoint=checkpoint, **options)

    def __init__(
        self,
        model: torch.nn.Module,
        forward_fn: ForwardFn,
        *,
        mesh: TrainMesh | None = None,
        optimizer: OptimizerConfig | None = None,
        lr: float = 0.0,
        total_steps: int = 1,
        max_tokens_per_mb: int = 4096,
        tokenizer=None,
        compute_dtype: str = "float32",
        recompute: str = "none",
        tree_training: str = "off",
        tree_min_saved_tokens: int = 0,
        lora: LoRAConfig | None = None,
        checkpoint: HubCheckpoint | None = None,
    ):
        """``checkpoint``: where a ``model`` on the meta device takes its weights from (``on_checkpoint``)."""
        check_tree_layout(tree_training, mesh, recompute, forward_fn, model.config.to_dict())
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is not None:  # on a layout resolve() accepted for LoRA
            lora_adapters.add_adapters(model, self.lora)
        self.tree_training, self.tree_min_saved_tokens = tree_training, tree_min_saved_tokens
        self.model, self.mesh, self.tokenizer = model, mesh, tokenizer
        self.device = mesh.device if mesh is not None else next(model.parameters()).device
        weights_dtype, compute = next(model.parameters()).dtype, DTYPES[compute_dtype]
        sharded = mesh is not None and sharded_mixed_precision(mesh.dims, compute)
        self.autocast_dtype = weights_dtype if sharded else compute  # FSDP casts the parameters itself
        if self.lora is not None and self.autocast_dtype != torch.float32:
            lora_adapters.keep_autocast_inputs(model)
        self.max_tokens_per_mb = max_tokens_per_mb
        self.rank = dist.get_rank() if mesh is not None else 0
        recompute_activations(model, recompute)
        self.root = (
            parallelize(model, forward_fn, mesh, compute, checkpoint)
            if mesh is not None
            else PackedForward(model, forward_fn)
        )
        activations = compute if sharded else weights_dtype
        self.pipeline = Pipeline(model, mesh, activations) if mesh is not None and mesh.dims.pp > 1 else None
        self.clip = optimizer.gradient_clipping if optimizer else 0.0
        self.across_groups = MixedGradientSum(model, mesh) if mesh is not None and mesh.mixed and optimizer else None
        self.optimizer = build_optimizer(model, optimizer, lr) if optimizer else None  # on the sharded parameters
        self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps) if optimizer else None
        self._idle = pack([[0, 0]], [[0, 1]]).to(self.device)  # the pass of a rank out of micro-batches

    def _data_parallel(self) -> bool:
        """Whether gradients are reduced over replicas (data- and context-parallel ranks)."""
        return self.mesh is not None and self.mesh.dims.dp * self.mesh.dims.cp > 1

    def _context_parallel(self) -> bool:
        return self.mesh is not None and self.mesh.dims.cp > 1

    def _compute(self):
        """Autocast to ``compute_dtype`` where FSDP's mixed precision does not apply (matrix multiplies in
        bfloat16, master weights kept)."""
        lower = self.autocast_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=lower)

    def _passes(self, batch: SequenceBatch) -> list[tuple[list[int], PackedBatch, dict[str, torch.Tensor]]]:
        """(sequence indices, packed micro-batch, packed fields) of this rank's share, then idle passes
        (no indices) up to the most any data-parallel peer has: FSDP and replicate gather and reduce
        in every pass, so every rank must run as many."""
        passes = []
        for indices in dynamic_microbatches([len(s) for s in batch.sequences], self.max_tokens_per_mb):
            packed, fields = batch.select(indices).packed()
            passes.append((indices, packed.to(self.device), {k: v.to(self.device) for k, v in fields.items()}))
        if self._data_parallel():
            count = torch.tensor(len(passes), device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.mesh.group("dp"))
            passes += [([], self._idle, {})] * (int(count) - len(passes))
        if self._context_parallel():  # this rank's tokens of each pass, and of each per-position field
            passes = context_passes(passes, self.mesh.dims.cp, self.mesh.coords["cp"], self.mesh.group("cp"))
        return passes

    def _whole(self, packed: PackedBatch, values: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of a whole micro-batch from this rank's (its context shard's) ones."""
        return packed.split.gather(values) if self._context_parallel() else values

    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        self.root.eval()  # recomputed logprobs and values are the policy's, never a dropout sample
        passes = self._passes(batch)

        def run(i: int, hidden: torch.Tensor | None):
            with self._compute():
                outputs = self.root(passes[i][1], hidden)
            if self.pipeline is not None and not self.pipeline.is_last:
                return outputs  # the activation for the next stage
            return {name: self._whole(passes[i][1], values).float().cpu() for name, values in outputs.items()}

        if self.pipeline is None:
            per_pass = [run(i, None) for i in range(len(passes))]
        else:
            per_pass = self.pipeline.forward([p.input_ids.shape[1] for _, p, _ in passes], run)
        out: dict[str, list[torch.Tensor | None]] = {}
        for (indices, _, _), outputs in zip(passes, per_pass):
            lengths = [len(batch.sequences[i]) for i in indices]
            for name, values in outputs.items() if indices else ():
                per_sequence = out.setdefault(name, [None] * len(batch))
                for i, part in zip(indices, values.split(lengths)):
                    per_sequence[i] = part
        return out

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's part of a minibatch (which may be empty)."""
        self.root.train()
        self.optimizer.zero_grad(set_to_none=True)
        gradients = self._tree_gradients if self.tree_training == "dta" else self._micro_batch_gradients
        parts = gradients(batch, loss_fn)
        if self.root.expert_params:
            reduce_expert_gradients(self.root.expert_params, self.mesh)
        reduce_head_norm_gradients(self.model, self.mesh)
        stats = merge_over_context(merge_stats(parts), self.mesh)
        if self.pipeline is not None:
            stats = self.pipeline.from_last_stage(stats)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.clip if self.clip > 0 else float("inf")
        if self.across_groups is not None:
            grad_norm = self.across_groups(max_norm)
        elif self.pipeline is None:
            grad_norm = clip_grad_norm(params, max_norm)
        else:
            grad_norm = clip_grad_norm(params, max_norm, self.mesh.group("pp"), self.pipeline.uncounted)
        stats["grad_norm"], stats["lr"] = float(grad_norm), self.scheduler.get_last_lr()[0]  # the lr of this step
        self.optimizer.step()
        self.scheduler.step()
        return stats

    def _micro_batch_gradients(self, batch: SequenceBatch, loss_fn: LossFn) -> list[dict[str, float]]:
        """The gradients of ``batch`` through packed micro-batches (a pipeline's schedule with pp);
        each micro-batch's statistics."""
        parts = []
        passes = self._passes(batch)

        def run(i: int, hidden: torch.Tensor | None) -> torch.Tensor:
            """Pass i's loss (its output activation on a pipeline stage before the last)."""
            indices, packed, fields = passes[i]
            with self._compute():
                outputs = self.root(packed, hidden)
            if self.pipeline is not None and not self.pipeline.is_last:
                return outputs
            if not indices:  # an idle pass: every parameter in the graph, nothing added to the gradients
                return sum(values.sum() for values in outputs.values()) * 0.0
            loss, mb_stats = loss_fn(outputs, packed, fields)
            parts.append({"loss": loss.item(), "microbatches": 1.0, **mb_stats})
            return loss

        def before_backward(i: int) -> None:
            if self._data_parallel():  # reduce once, in the last pass's backward
                self.root.set_requires_gradient_sync(i == len(passes) - 1)

        if self.pipeline is None:
            for i in range(len(passes)):
                before_backward(i)
                run(i, None).backward()
        else:
            self.pipeline.train([p.input_ids.shape[1] for _, p, _ in passes], run, before_backward)
            self.pipeline.sum_tied_gradients()
        return parts

    def _tree_gradients(self, batch: SequenceBatch, loss_fn: LossFn) -> list[dict[str, float]]:
        """The gradients of ``batch`` by depth-first tree training over its prefix tree; each chunk's
        statistics, and the tree's size. Data-parallel replicas gather their parameters once, train
        their own trees without communicating (an empty share trains nothing), then reduce the
        gradients in one idle pass."""
        if self._data_parallel():
            self._hold_parameters(True)
        parts = []
        if len(batch) or not self._data_parallel():
            flatten_within = flat_subtree_tokens(self.model, self.max_tokens_per_mb)
            tree = build_prefix_tree(batch.sequences, self.tree_min_saved_tokens, flatten_within)
            started = time.perf_counter()
            with self._compute():
                parts = tree_train_pass(self.root, tree, batch, loss_fn, self.max_tokens_per_mb, flatten_within)
            # "loss" is the chunks' sum: 0 with no trained target, as for flat micro-batches without one;
            # the tree's features and seconds are what 'areal-hpc tree-cost' fits the cost model on
            features = dict(zip(TREE_FEATURES, node_features(tree).sum(0).tolist()))
            parts.append(
                {
                    "loss": 0.0,
                    "microbatches": 1.0,
                    **{f"tree_{k}": v for k, v in features.items()},
                    "tree_seconds": time.perf_counter() - started,
                }
            )
        if self._data_parallel():
            self._hold_parameters(False)
            with self._compute():
                outputs = self.root(self._idle)
            (sum(values.sum() for values in outputs.values()) * 0.0).backward()  # reduces what accumulated
        return parts

    def _hold_parameters(self, hold: bool) -> None:
        """Hold every FSDP unit's parameters gathered and its gradients unreduced (``True``: no
        collective until released), or go back to gathering per forward and reducing in each backward."""
        self.root.set_requires_gradient_sync(not hold)
        if self.mesh.dims.fsdp:
            self.root.set_reshard_after_forward(not hold)
            self.root.set_reshard_after_backward(not hold)
        if hold:
            for unit in self.root.modules():
                if isinstance(unit, FSDPModule):
                    unit.unshard()

    def _full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) of the whole model on global rank 0, nothing on the other
        ranks. Collective: every rank iterates to the end."""
        keep = self.rank == 0
        if self.pipeline is None:
            state = ((n, t) for n, t in full_state(self.root, keep) if keep)
            return lora_adapters.merged(state, self.lora.alpha / self.lora.rank) if self.lora is not None else state
        header = [(name.removeprefix("model."), t.shape, t.dtype) for name, t in self.root.state_dict().items()]
        return self.pipeline.gathered(header, lambda lead: full_state(self.root, lead))

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The full state dict under its Hugging Face names (tied weights appear under both names, as in
        the state dict the servers' models have), on this engine's device. Collective: every rank
        iterates to the end; global rank 0's buckets hold the tensors, the others' are empty."""
        return weight_buckets(self._full_state(), bucket_bytes)

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        """Collective: rank 0 writes the Hugging Face folder (with LoRA and ``optimizer``: the adapters
        only, in peft's format); with a mesh every rank writes its shard of the optimizer state
        (torch.distributed.checkpoint, in ``optimizer/``)."""
        keep = self.rank == 0
        if self.lora is not None and optimizer:
            adapters = lora_adapters.adapter_state(self.root, keep)
            if keep:
                lora_adapters.save_adapters(folder, adapters, self.lora, self.model.name_or_path)
        else:
            state = dict(self._full_state())
            if keep:
                save_model(self.model, self.tokenizer, folder, state_dict=state)
        if not optimizer or self.optimizer is None:
            return
        training = {"scheduler": self.scheduler.state_dict()}
        if self.mesh is None:
            training["optimizer"] = self.optimizer.state_dict()
        else:
            dist.barrier(group=self.mesh.members)  # rank 0 has renamed the folder into place
            dcp.save(self._optimizer_state(), checkpoint_id=folder / OPTIMIZER_SHARDS, process_group=self.mesh.members)
        if keep:
            torch.save(training, folder / TRAINING_STATE)

    def load(self, folder: Path) -> None:
        """Collective. Weights (with LoRA: the adapters, over the base model) load into any layout (each
        rank takes its shard of the full tensors); optimizer state into the layout that saved it."""
        if self.lora is not None:
            missing = lora_adapters.load_adapters(self.root, folder, self.lora)
        else:
            missing = self._load_weights(folder)
        if missing:
            raise RuntimeError(f"checkpoint {folder} lacks {sorted(missing)[:5]}")
        if self.optimizer is None or not (folder / TRAINING_STATE).exists():
            return
        training = torch.load(folder / TRAINING_STATE, map_location=self.device, weights_only=True)
        self.scheduler.load_state_dict(training["scheduler"])
        if "optimizer" in training:
            self.optimizer.load_state_dict(training["optimizer"])
        else:
            sharded = self._optimizer_state()
            dcp.load(sharded, checkpoint_id=folder / OPTIMIZER_SHARDS, process_group=self.mesh.members)
            if self.pipeline is not None:
                sharded = self.pipeline.rename_tied(sharded, to_embedding=False)
            set_optimizer_state_dict(self.root, self.optimizer, sharded, options=FLAT)

    def _load_weights(self, folder: Path) -> list[str]:
        """Load a Hugging Face folder's weights, each rank its part; the names it lacks."""
        return read_rank_weights(self.root, self.model, HubCheckpoint(folder))

    def _optimizer_state(self) -> dict:
        """This rank's optimizer state, flattened (every entry keyed by its parameter's name, so ranks
        holding different parameters never write the same key) under the names one process uses
        (``Pipeline.rename_tied``)."""
        state = get_optimizer_state_dict(self.root, self.optimizer, options=FLAT)
        return self.pipeline.rename_tied(state, to_embedding=True) if self.pipeline is not None else state
