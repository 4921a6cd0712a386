"""``TrainEngine`` on Megatron-core (``actor.engine=megatron``): a GPTModel split over the trainer
mesh's tensor-parallel, context-parallel and pipeline ranks (a Qwen3-MoE's experts also over its
expert-parallel ranks), Megatron DDP (or, with ``actor.parallel.fsdp``, Megatron's FSDP2 wrapper) over
its data-parallel ranks, loaded from and saved to Hugging Face folders (``engines.megatron.convert``).

- Packed micro-batches run as THD ``PackedSeqParams`` through Megatron's schedules
  (``get_forward_backward_func``, variable sequence lengths across pipeline stages); on CPU the layer
  spec's core attention is ``PackedCoreAttention`` (Transformer Engine's on CUDA when it imports).
- Losses already carry the whole minibatch's normaliser, so gradients are summed over micro-batches
  and data-parallel ranks: ``calculate_per_token_loss`` stops Megatron dividing by the micro-batch
  count and DDP by the dp size, and gradients are finalised without its per-token scaling. DDP's
  reduction runs after the last micro-batch, so data-parallel ranks may run different numbers of them
  (or none) -- except under expert parallelism, where every MoE layer exchanges tokens over the
  expert-parallel ranks: a rank out of micro-batches runs idle ones (two tokens, nothing added to the
  gradients) until its peers are done. Expert gradients are summed over the expert-data-parallel
  ranks by DDP; each expert-parallel rank's experts are its own.
- With ``fsdp`` (dp, tp and cp; not with pp, ep or sequence parallelism yet) Megatron's
  ``TorchFullyShardedDataParallel`` shards every layer and the root over the dp x cp ranks (FSDP2,
  gradient divide factor 1): every pass gathers and reduces, so data-parallel ranks out of
  micro-batches run idle passes too; Adam's moments are DTensor shards, saved per rank as their local
  shards.
- Under context parallelism every sequence of a micro-batch is padded at its end to a multiple of
  2 x cp tokens and dealt in zig-zag chunks over the cp ranks (``parallel.context``): Megatron's
  rotary embedding for packed sequences takes exactly those equal chunks, the core attention gathers
  keys and values over the cp ranks, per-position fields and outputs are split and gathered with the
  tokens, and DDP reduces gradients over dp x cp.
- Sequence parallelism (``actor.parallel.sequence_parallel``, Megatron's own: norms and residuals on a
  TP rank's slice of the tokens) needs each rank's tokens of a pass to split evenly over the TP ranks:
  with cp, sequences are padded to a multiple of 2 x cp x tp; without, a filler sequence (no targets)
  ends the pass. On the local spec the norms are ``engines.megatron.norm.MarkedRMSNorm`` (marked for
  the TP sum of their gradients, as Megatron's fused norms are).
- "logprobs" and "entropy" come from the vocabulary-parallel logits of the last stage (a logsumexp
  over the TP ranks), and reach every rank of the pipeline.
- The PPO critic (``kind="critic"``) is HF's token classifier with one label: the same body, its
  ``score`` head in the last stage's output-layer slot (``ValueHead``, replicated over TP), per-position
  "values" (on the last stage, where GAE reads them, and sent to every stage); a head the folder
  lacks takes the same draws as ``models.hf.load_critic``'s, so both engines start from one critic.
- The optimizer and schedule are ``engines.optim``'s on each rank's shards (Adam is elementwise); the
  gradient norm counts each parameter once (TP duplicates and the last stage's tied-embedding copy
  excluded) over the model-parallel ranks, and each expert once over the expert-parallel ranks, as
  ``clip_grad_norm_`` does for one process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches, pack, with_filler
from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.base import (OPTIMIZER_SHARDS, TRAINING_STATE, LossFn, Outputs, WeightBucket, merge_over_context,
                                    merge_stats, weight_buckets)
from areal_hpc.engines.megatron import shim as megatron_shim
from areal_hpc.engines.megatron.convert import (ModelShape, gpt_model_args, hf_to_megatron, is_expert, stage_to_hf,
                                                transformer_config)
from areal_hpc.engines.optim import build_optimizer, build_scheduler
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.models.hf import read_checkpoint, save_model
from areal_hpc.parallel.context import context_passes
from areal_hpc.parallel.device import resolve_device
from areal_hpc.parallel.dims import ParallelDims
from areal_hpc.parallel.mesh import TrainMesh, build_mesh, init_distributed

DAY_MINUTES = 24 * 60


def _initialize_megatron(dims: ParallelDims) -> None:
    """Megatron's process groups (the mesh's own: same rank order) and RNG tracker, once per process."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size(),
                 parallel_state.get_expert_model_parallel_world_size())
        if sizes != (dims.tp, dims.pp, dims.cp, dims.ep):
            raise RuntimeError(f"Megatron is initialised for tp, pp, cp, ep = {sizes}, "
                               f"not {(dims.tp, dims.pp, dims.cp, dims.ep)}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                             context_parallel_size=dims.cp, expert_model_parallel_size=dims.ep,
                                             order="tp-cp-ep-dp-pp",
                                             distributed_timeout_minutes=7 * DAY_MINUTES,
                                             create_gloo_process_groups=False)
    with torch.random.fork_rng(devices=[]):  # it reseeds the default generator; the caller's stream stays
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def check_layout(dims: ParallelDims, shape: ModelShape) -> None:
    """Raise ``UserError`` for a layout this engine does not build or the model cannot be split into."""
    if dims.vpp > 1:
        raise UserError(f"actor.engine=megatron does not build vpp={dims.vpp} yet; it supports dp, tp, pp, cp, ep, "
                        "fsdp and sequence_parallel")
    if dims.fsdp and (dims.pp > 1 or dims.ep > 1 or dims.sequence_parallel):
        raise UserError(f"actor.engine=megatron builds fsdp=true with dp, tp and cp, not with pp={dims.pp} "
                        f"ep={dims.ep} sequence_parallel={str(dims.sequence_parallel).lower()} yet")
    if shape.experts and dims.tp > 1:
        raise UserError(f"actor.engine=megatron does not build a Mixture-of-Experts model with tp={dims.tp} yet; "
                        "use dp, pp and ep")
    shape.check_layout(dims.tp, dims.pp, dims.ep)


def vocab_parallel_outputs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                           group) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(token), entropy of p_T) per row of this TP rank's vocabulary slice ``logits`` [N, V/tp]:
    the logsumexp and the target's logit are all-reduced over ``group`` (backward: identity)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    logits = logits.float() / temperature
    peak = logits.detach().amax(-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak[:, None]
    normaliser = reduce(shifted.exp().sum(-1), group).log()
    width = logits.shape[-1]
    local = tokens - dist.get_rank(group) * width
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1)[:, None])[:, 0] * inside
    logprobs = reduce(picked, group) - normaliser
    with torch.no_grad():  # logged, not trained
        expected = reduce((shifted - normaliser[:, None]).exp().mul(shifted).sum(-1), group)
        entropy = normaliser - expected
    return logprobs, entropy


class ValueHead(torch.nn.Linear):
    """A critic's head in GPTModel's ``output_layer`` slot: hidden [s, b, H] -> values [s, b, 1]
    (replicated over the TP ranks, whose hidden states are the same once gathered from the sequence-
    parallel split: each rank then computes the whole loss, so the gather's backward takes its slice)."""

    def __init__(self, hidden: int, outputs: int, *, sequence_parallel: bool = False):
        super().__init__(hidden, outputs)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return super().forward(hidden), None


def fresh_value_head(hf_config) -> dict[str, torch.Tensor]:
    """HF's ``score`` weights as ``load_critic`` initialises them when the folder has none (the same
    draws from the default generator: the critic's initialisation depends on the seed only)."""
    from transformers import AutoModelForTokenClassification

    with torch.device("meta"):
        skeleton = AutoModelForTokenClassification.from_config(hf_config)
    head = torch.nn.Linear(hf_config.hidden_size, 1, device="meta").to_empty(device="cpu")  # no draws
    skeleton._init_weights(head)
    return {"score.weight": head.weight.detach(), "score.bias": head.bias.detach()}


class MegatronTrainEngine:
    """``TrainEngine`` on a Megatron-core GPTModel built from the Hugging Face folder ``path`` over
    ``mesh`` (one process when ``mesh`` is None). ``kind`` is "policy" (per-position "logprobs" and
    "entropy") or "critic" (HF's token classifier with one label: "values")."""

    def __init__(self, path: str, kind: str, *, temperature: float = 1.0, mesh: TrainMesh | None = None,
                 optimizer: OptimizerConfig | None = None, lr: float = 0.0, total_steps: int = 1,
                 max_tokens_per_mb: int = 4096, tokenizer=None, compute_dtype: str = "float32"):
        from transformers import AutoConfig

        if compute_dtype != "float32":
            raise UserError(f"actor.engine=megatron does not build model.compute_dtype={compute_dtype} yet (Megatron's "
                            "linear layers take no autocast); set model.compute_dtype=float32")
        if mesh is None:  # one process: a group of one
            device = resolve_device("auto")
            if not dist.is_initialized():
                init_distributed(device)
            mesh = build_mesh(ParallelDims(), device)
        self.mesh, self.device, self.tokenizer = mesh, mesh.device, tokenizer
        self.rank, self.temperature, self.max_tokens_per_mb = dist.get_rank(), temperature, max_tokens_per_mb
        self.critic = kind == "critic"
        self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True, **({"num_labels": 1} if self.critic
                                                                                   else {}))
        self.shape = ModelShape.from_hf(self.hf_config)
        self.shape = self.shape.critic() if self.critic else self.shape
        check_layout(mesh.dims, self.shape)
        if self.device.type == "cpu":
            megatron_shim.apply()
        if not _has_transformer_engine():
            megatron_shim.without_transformer_engine()
        _initialize_megatron(mesh.dims)
        with torch.random.fork_rng(devices=[]):  # the throwaway initialisation draws from the default generator
            self.model = self._build_model()
        self._load_hf(Path(path))
        self.trainable = optimizer is not None
        self.model.requires_grad_(self.trainable)
        self.clip = optimizer.gradient_clipping if optimizer else 0.0
        self.sharded = self.trainable and mesh.dims.fsdp
        self.root = self._wrap() if self.trainable else self.model
        self.optimizer = build_optimizer(self.model, optimizer, lr) if optimizer else None  # FSDP's shards, if any
        self.scheduler = build_scheduler(self.optimizer, optimizer, total_steps) if optimizer else None

    # --- construction -------------------------------------------------------------------------
    def _build_model(self):
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                              get_gpt_layer_with_transformer_engine_spec)

        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from areal_hpc.engines.megatron.attention import PackedCoreAttention
        from areal_hpc.engines.megatron.norm import MarkedRMSNorm

        dims = self.mesh.dims
        # perform_initialization: on CPU it is what marks the TP-split parameters (tensor_model_parallel),
        # which the gradient norm reads; the loaded weights then replace the random ones.
        self.config = transformer_config(self.shape, dims.tp, dims.pp, dims.ep, use_cpu_initialization=True,
                                         perform_initialization=True, calculate_per_token_loss=True,
                                         sequence_parallel=dims.sequence_parallel,
                                         variable_seq_lengths=True,  # micro-batches of any length across stages
                                         moe_token_dispatcher_type="alltoall")  # "allgather" refuses the above
        experts = dict(num_experts=self.shape.experts or None, moe_grouped_gemm=False)  # one MLP per expert
        if self.device.type == "cuda" and _has_transformer_engine():
            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.shape.qk_norm, **experts)
        else:
            spec = get_gpt_layer_local_spec(qk_layernorm=self.shape.qk_norm, normalization="RMSNorm", **experts)
            layer, attention = spec.submodules, spec.submodules.self_attention.submodules
            attention.core_attention = PackedCoreAttention
            layer.input_layernorm = layer.pre_mlp_layernorm = MarkedRMSNorm
            if self.shape.qk_norm:
                attention.q_layernorm = attention.k_layernorm = MarkedRMSNorm
            spec = TransformerBlockSubmodules(layer_specs=[spec] * (self.shape.layers // dims.pp),
                                              layer_norm=MarkedRMSNorm)
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        model = GPTModel(self.config, spec, pre_process=self.first, post_process=self.last,
                         **gpt_model_args(self.shape))
        if self.critic and self.last:
            model.output_layer = ValueHead(self.shape.hidden, 1, sequence_parallel=dims.sequence_parallel)
        self._idle = pack([[0, 0]], [[0, 1]]).to(self.device)  # the pass of a rank out of micro-batches
        return model.to(self.device)

    def _wrap(self):
        """Megatron DDP, or with ``fsdp`` Megatron's FSDP2 wrapper (``fully_shard`` on every layer, then
        the root, over the dp x cp ranks) with gradients summed, not averaged. Its default units also
        take ``ColumnParallelLinear`` (inside the local spec's layers: FSDP2 wants inner units wrapped
        first) and the embedding (whose weight a tied output layer reads outside its forward): both
        stay with the root here."""
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig)
        from megatron.core.transformer.transformer_layer import TransformerLayer
        from torch.distributed.fsdp import FSDPModule

        if not self.sharded:
            ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
            return DistributedDataParallel(self.config, ddp, self.model)
        root = TorchFullyShardedDataParallel(self.config, TorchFullyShardedDataParallelConfig(), self.model,
                                             sub_modules_to_wrap={TransformerLayer},
                                             process_group=self.mesh.group("dp_cp"))
        for unit in self.model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)  # sum: the loss weights already normalise the minibatch
                unit.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)
        return root

    def _state_names(self) -> list[str]:
        return [n for n in self.model.state_dict() if not n.endswith("_extra_state")]

    @torch.no_grad()
    def _load_hf(self, folder: Path) -> None:
        """This rank's shards of the Hugging Face weights in ``folder`` (any layout saved them)."""
        hf_state = read_checkpoint(folder)
        if self.critic and "score.weight" not in hf_state:  # a critic starting from the policy's folder
            hf_state.update(fresh_value_head(self.hf_config))
        dims, coords = self.mesh.dims, self.mesh.coords
        try:
            state = hf_to_megatron(hf_state, self.shape, coords["tp"], dims.tp, self.stage, dims.pp,
                                   ep_rank=coords["ep"], ep=dims.ep)
        except KeyError as missing:
            raise RuntimeError(f"checkpoint {folder} lacks {missing}") from None
        if sorted(state) != sorted(self._state_names()):
            raise RuntimeError(f"Megatron stage {self.stage} has {sorted(set(self._state_names()) ^ set(state))[:5]} "
                               "beyond the converter's names")
        for name, tensor in self.model.state_dict().items():
            if isinstance(tensor, DTensor):  # FSDP's shard: every rank cuts its own from the full tensor
                tensor.copy_(distribute_tensor(state[name].to(tensor.device), tensor.device_mesh, tensor.placements,
                                               src_data_rank=None))
            elif name in state:
                tensor.copy_(state[name])

    # --- passes -------------------------------------------------------------------------------
    def _microbatches(self, batch: SequenceBatch) -> list[tuple[list[int], PackedBatch, dict[str, torch.Tensor]]]:
        """(sequence indices, packed micro-batch, packed fields) of this rank's share; under expert
        parallelism or FSDP (whose every pass exchanges over the data-parallel ranks) then idle passes
        (no indices) up to the most any data-parallel peer has; under context parallelism each pass's
        share of this cp rank. Under sequence parallelism each rank's tokens of a pass must split evenly
        over the TP ranks: sequences are padded (with cp) or a filler sequence ends the pass."""
        passes = []
        for indices in dynamic_microbatches([len(s) for s in batch.sequences], self.max_tokens_per_mb):
            packed, fields = batch.select(indices).packed()
            passes.append((indices, packed.to(self.device), {k: v.to(self.device) for k, v in fields.items()}))
        if self.mesh.dims.ep > 1 or self.sharded:
            count = torch.tensor(len(passes), device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.mesh.group("dp"))
            passes += [([], self._idle, {})] * (int(count) - len(passes))
        dims = self.mesh.dims
        tp_split = dims.tp if dims.sequence_parallel else 1
        if dims.cp > 1:
            passes = context_passes(passes, dims.cp, self.mesh.coords["cp"], self.mesh.group("cp"),
                                    pad_multiple=2 * dims.cp * tp_split)
        elif tp_split > 1:
            passes = [(indices, with_filler(packed, tp_split),
                       {k: F.pad(v, (0, -len(v) % tp_split)) for k, v in fields.items()})
                      for indices, packed, fields in passes]
        return passes

    def _outputs(self, logits: torch.Tensor, packed: PackedBatch) -> Outputs:
        """Per-position "logprobs" and "entropy" (0 off target positions) from [1, T, V/tp] logits; a
        critic's "values" from its head's [1, T, 1]."""
        if self.critic:
            return {"values": logits[0, :, 0].float()}
        targets, tokens = packed.target_tokens()
        logprobs, entropy = vocab_parallel_outputs(logits[0, targets], tokens, self.temperature, self.tp_group)
        total = packed.input_ids.shape[1]
        return {"logprobs": logprobs.new_zeros(total).index_put((targets,), logprobs),
                "entropy": entropy.new_zeros(total).index_put((targets,), entropy)}

    def _run(self, passes, on_outputs, forward_only: bool) -> None:
        """Megatron's schedule over ``passes``; the last stage calls ``on_outputs(indices, outputs, packed,
        fields)`` for each pass with sequences, which returns the micro-batch's loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from areal_hpc.engines.megatron.attention import PackedSequences

        def step(iterator, model):
            indices, packed, fields = next(iterator)
            sequences = PackedSequences.of(packed)
            logits = model(packed.input_ids, packed.position_ids, None, packed_seq_params=sequences)

            def loss(output):
                outputs = self._outputs(output, packed)
                if not indices:  # an idle pass: its backward still runs the experts' exchanges, adding 0
                    return sum(values.sum() for values in outputs.values()) * 0.0, torch.tensor(1), {}
                return on_outputs(indices, outputs, packed, fields), torch.tensor(1), {}
            return logits, loss

        if not passes:
            return
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(passes), model=[self.root], num_microbatches=len(passes),
            seq_length=max(p.input_ids.shape[1] for _, p, _ in passes), micro_batch_size=1,
            forward_only=forward_only)

    def _from_last_stage(self, value):
        """``value`` of the last pipeline stage, on every stage."""
        if self.mesh.dims.pp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, self.mesh.dims.pp - 1),
                                   group=self.pp_group)
        return box[0]

    # --- TrainEngine --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        """Each output as per-sequence [len] tensors, without gradient, in evaluation mode. Collective
        over the mesh: every rank calls it with its data-parallel replica's share."""
        self.root.eval()
        out: dict[str, list[torch.Tensor | None]] = {}
        passes = self._microbatches(batch)

        def keep(indices: list[int], outputs: Outputs, packed: PackedBatch, fields) -> torch.Tensor:
            lengths = [len(batch.sequences[i]) for i in indices]
            for name, values in outputs.items():
                per_sequence = out.setdefault(name, [None] * len(batch))
                whole = packed.split.gather(values) if self.mesh.dims.cp > 1 else values[:sum(lengths)]
                for i, part in zip(indices, whole.float().cpu().split(lengths)):
                    per_sequence[i] = part
            return torch.zeros(())
        self._run(passes, keep, forward_only=True)
        return self._from_last_stage(out)

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's part of a minibatch (which may be empty)."""
        from megatron.core.distributed import finalize_model_grads

        self.root.train()
        self.root.zero_grad_buffer()
        parts = []

        def loss(indices: list[int], outputs: Outputs, packed: PackedBatch, fields) -> torch.Tensor:
            value, mb_stats = loss_fn(outputs, packed, fields)
            parts.append({"loss": value.item(), "microbatches": 1.0, **mb_stats})
            return value
        self._run(self._microbatches(batch), loss, forward_only=False)
        stats = self._from_last_stage(merge_over_context(merge_stats(parts), self.mesh))
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.sharded:  # FSDP has summed each pass's gradient shards over dp x cp in its backward
            finalize_model_grads([self.root])  # DDP's sum over dp, tied-embedding grads over pp; no scaling
            for p in params:
                p.grad = p.main_grad
        grad_norm = self._clip_grad_norm(params, self.clip if self.clip > 0 else float("inf"))
        stats["grad_norm"], stats["lr"] = grad_norm, self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        for p in params:
            p.grad = None
        return stats

    def _clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """The norm of the whole model's gradient, each parameter counted once, and gradients scaled to
        at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule). Experts (Megatron marks them
        ``allreduce=False``) are summed over the expert-parallel ranks that hold them, the rest over the
        model-parallel ranks (and FSDP's shards over the dp x cp ranks)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        total = 0.0
        for expert, group in ((False, parallel_state.get_model_parallel_group()),
                              (True, parallel_state.get_expert_tensor_model_pipeline_parallel_group())):
            square = torch.zeros((), dtype=torch.float32, device=self.device)
            for p in params:
                if (param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
                        and expert != getattr(p, "allreduce", True)):
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    square += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
            dist.all_reduce(square, group=group)
            if self.sharded:
                dist.all_reduce(square, group=self.mesh.group("dp_cp"))
            total += float(square)
        norm = total ** 0.5
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of this stage on the stage's first replica's TP rank 0: FSDP's shards
        gathered by every replica, then TP shards over the first replica, experts over the TP and EP
        ranks of the first expert replica (the other ranks of those take part and get nothing; other
        replicas do nothing more)."""
        from megatron.core import parallel_state

        state, coords = self.model.state_dict(), self.mesh.coords
        first_replica = coords["dp"] == coords["cp"] == 0
        takes_part = {False: first_replica, True: coords["edp"] == 0}  # keyed by: is it an expert's?
        groups = {False: self.tp_group, True: parallel_state.get_expert_tensor_and_model_parallel_group()}

        def gathered() -> Iterator[tuple[str, list[torch.Tensor]]]:
            for name in self._state_names():
                local = state[name].detach()
                local = local.full_tensor() if isinstance(local, DTensor) else local
                expert = is_expert(name)
                if not takes_part[expert]:
                    continue
                local = local.contiguous()
                shards = [torch.empty_like(local) for _ in range(dist.get_world_size(groups[expert]))]
                dist.all_gather(shards, local, group=groups[expert])  # EP rank major, then TP rank
                yield name, shards
        if first_replica and coords["tp"] == 0:
            yield from stage_to_hf(gathered(), self.shape, self.stage, self.mesh.dims.pp, self.mesh.dims.ep)
        else:
            for _ in gathered():
                pass

    def _full_state(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Buckets of the whole model on global rank 0: its own stage's, then each later stage's leader
        sends its buckets (``None`` ends a stage)."""
        leader = self.mesh.coords["dp"] == self.mesh.coords["cp"] == self.mesh.coords["tp"] == 0
        buckets = weight_buckets(self._hf_tensors(), bucket_bytes)
        if self.rank == 0:
            yield from buckets
            for stage in range(1, self.mesh.dims.pp):
                source = dist.get_global_rank(self.pp_group, stage)
                while (bucket := _receive(source)) is not None:
                    yield bucket
        elif leader:
            for bucket in buckets:
                dist.send_object_list([bucket], dst=0)
            dist.send_object_list([None], dst=0)
        else:
            for _ in buckets:
                pass

    def rollout_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The full state dict under its Hugging Face names (a tied embedding under both names).
        Collective: every rank iterates to the end; global rank 0's buckets hold the tensors, the
        others' are empty."""
        return self._full_state(bucket_bytes)

    def save(self, folder: Path, *, optimizer: bool = True) -> None:
        """Collective: rank 0 writes the Hugging Face folder; every rank its optimizer state
        (``optimizer/rank{N}.pt``), rank 0 the schedule and layout (``training_state.pt``)."""
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        folder = Path(folder)
        state = {name: tensor for bucket in self._full_state(1 << 30) for name, tensor in bucket}
        if self.rank == 0:
            with torch.device("meta"):
                kind = AutoModelForTokenClassification if self.critic else AutoModelForCausalLM
                skeleton = kind.from_config(self.hf_config)
            save_model(skeleton, self.tokenizer, folder, state_dict=state)
        if not optimizer or self.optimizer is None:
            return
        dist.barrier()  # rank 0 has renamed the folder into place
        (folder / OPTIMIZER_SHARDS).mkdir(exist_ok=True)
        torch.save(_local_shards(self.optimizer.state_dict()), folder / OPTIMIZER_SHARDS / f"rank{self.rank}.pt")
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "megatron_layout": self._layout()},
                       folder / TRAINING_STATE)

    def _layout(self) -> dict[str, int]:
        dims = self.mesh.dims
        return {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep, "fsdp": int(dims.fsdp)}

    def load(self, folder: Path) -> None:
        """Collective. Weights load into any layout; optimizer state into the layout that saved it."""
        folder = Path(folder)
        self._load_hf(folder)
        if self.optimizer is None or not (folder / TRAINING_STATE).exists():
            return
        training = torch.load(folder / TRAINING_STATE, map_location="cpu", weights_only=True)
        saved = training.get("megatron_layout")
        saved = {"cp": 1, "fsdp": 0, **saved} if saved else saved  # checkpoints from before cp and fsdp
        if saved != self._layout():
            raise UserError(f"checkpoint {folder} holds optimizer state of layout {saved}, not this run's "
                            f"{self._layout()} (actor.engine=megatron resumes in the layout it saved)")
        self.scheduler.load_state_dict(training["scheduler"])
        shard = torch.load(folder / OPTIMIZER_SHARDS / f"rank{self.rank}.pt", map_location=self.device,
                           weights_only=True)
        self.optimizer.load_state_dict(shard)
        _placed_like_parameters(self.optimizer)


def _local_shards(state: dict) -> dict:
    """An optimizer state dict with FSDP's DTensors as this rank's local shards (what its file holds)."""
    local = {key: {name: value.to_local() if isinstance(value, DTensor) else value for name, value in entry.items()}
             for key, entry in state["state"].items()}
    return {**state, "state": local}


def _placed_like_parameters(optimizer: torch.optim.Optimizer) -> None:
    """After loading local shards: each FSDP-sharded parameter's moments become DTensors placed as the
    parameter is (its step count stays a plain tensor)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            entry = optimizer.state[param]
            for name, value in entry.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and name != "step":
                    entry[name] = DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                                                     stride=param.stride(), run_check=False)


def _receive(source: int):
    box = [None]
    dist.recv_object_list(box, src=source)
    return box[0]


@functools.cache
def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
