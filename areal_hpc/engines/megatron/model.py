"""The Megatron-core GPTModel of this rank over the trainer mesh: Megatron readied on the process (the
CPU shim, its process groups in the mesh's rank order), the layout check, the layer spec, the critic's
value head, activation recomputation, the bf16 and DDP or FSDP2 wrapping, the fp32 master weights or the
distributed optimizer (ZeRO-1), and the gradient norm over the model's shards.

- On CPU the layer spec's core attention is ``PackedCoreAttention`` (Transformer Engine's on CUDA when
  it imports) and its norms are ``engines.megatron.norm.MarkedRMSNorm`` (marked for the TP sum of
  their gradients under sequence parallelism, as Megatron's fused norms are). Gemma 3's layers take
  ``engines.megatron.gemma``'s pieces (norms after attention and MLP, sliding layers' RoPE, scaled embeddings).
- Losses already carry the whole minibatch's normaliser, so gradients are summed over micro-batches
  and data-parallel ranks: ``calculate_per_token_loss`` stops Megatron dividing by the micro-batch
  count and DDP by the dp size. DDP reduces gradients over dp x cp; expert gradients over the
  expert-data-parallel ranks; each expert-parallel rank's experts are its own.
- With ``fsdp`` (dp, tp and cp; not with pp, ep or sequence parallelism yet) Megatron's
  ``TorchFullyShardedDataParallel`` shards every layer and the root over the dp x cp ranks (FSDP2,
  gradient divide factor 1).
- bf16 mixed precision is Megatron's: bf16 parameters and compute (``Float16Module``; the output layer's
  logits in bf16, their log-softmax in fp32),
  gradients accumulated and reduced in DDP's fp32 ``main_grad`` buffer, and
  ``Float16OptimizerWithFloat16Params`` around ``engines.optim``'s AdamW, which steps fp32 master
  copies (its state fp32 too) and copies them back into the bf16 parameters. Not with FSDP yet.
- The policy's last stage turns hidden states into logprobs in its output-layer slot (``outputs.LogprobHead``,
  the same vocabulary-parallel weight): a chunk of positions at a time, so its [tokens, V/tp] logits never
  exist whole. The PPO critic is HF's token classifier with one label: the same body, its ``score`` head in
  that slot (``ValueHead``, replicated over TP).
- The gradient norm counts each parameter once (TP duplicates and the last stage's tied-embedding
  copy excluded) over the model-parallel ranks, and each expert once over the expert-parallel ranks,
  as ``clip_grad_norm_`` does for one process.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_hpc.engines.megatron import shim as megatron_shim
from areal_hpc.engines.megatron.convert import ModelShape, gpt_model_args, transformer_config
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.parallel.mesh import TrainMesh

DAY_MINUTES = 24 * 60
# ``actor.recompute`` as Megatron's settings: "selective" recomputes each layer's core attention (its
# default ``recompute_modules``), "full" each layer's whole forward from its input, one layer at a time.
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def check_layout(dims: ParallelDims, shape: ModelShape, *, bf16: bool = False) -> None:
    """Raise ``UserError`` for a layout this engine does not build (``bf16``: in bf16 mixed precision) or
    the model cannot be split into."""
    if bf16 and dims.fsdp:
        raise UserError(
            "actor.engine=megatron builds model.compute_dtype=bfloat16 with fsdp=false only yet; "
            "set actor.parallel.fsdp=false or model.compute_dtype=float32"
        )
    if dims.fsdp and (dims.pp > 1 or dims.ep > 1 or dims.sequence_parallel):
        raise UserError(
            f"actor.engine=megatron builds fsdp=true with dp, tp and cp, not with pp={dims.pp} "
            f"ep={dims.ep} sequence_parallel={str(dims.sequence_parallel).lower()} yet"
        )
    if dims.distributed_optimizer and dims.fsdp:
        raise UserError(
            "actor.parallel.distributed_optimizer=true shards the optimizer state that fsdp=true already "
            "shards; set one of them"
        )
    if dims.distributed_optimizer and shape.experts:
        raise UserError(
            "actor.engine=megatron does not build distributed_optimizer=true for a Mixture-of-Experts "
            "model yet; set actor.parallel.distributed_optimizer=false"
        )
    if shape.experts and dims.tp > 1:
        raise UserError(
            f"actor.engine=megatron does not build a Mixture-of-Experts model with tp={dims.tp} yet; use dp, pp and ep"
        )
    shape.check_layout(dims.tp, dims.pp, dims.ep)
    if shape.layers % (dims.pp * dims.vpp):
        raise UserError(
            f"actor.parallel.pp={dims.pp} x vpp={dims.vpp} = {dims.pp * dims.vpp} virtual stages must "
            f"divide the model's num_hidden_layers={shape.layers}"
        )


def initialize_megatron(dims: ParallelDims, device: torch.device) -> None:
    """Megatron ready on this process: the CPU shim on CPU (and Megatron without Transformer Engine
    where that does not import), its process groups (the mesh's own: same rank order; with the
    distributed optimizer also gloo twins of the data-parallel ones, through which it gathers and scatters
    its state on the host for checkpoints) and RNG tracker, once per process."""
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cpu":
        megatron_shim.apply()
    if not has_transformer_engine():
        megatron_shim.without_transformer_engine()
    if dims.vpp > 1:
        megatron_shim.interleaving_shapes_by_direction()
    if parallel_state.model_parallel_is_initialized():
        sizes = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        )
        if sizes != (dims.tp, dims.pp, dims.cp, dims.ep, dims.vpp):
            raise RuntimeError(
                f"Megatron is initialised for tp, pp, cp, ep, vpp = {sizes}, "
                f"not {(dims.tp, dims.pp, dims.cp, dims.ep, dims.vpp)}"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        order="tp-cp-ep-dp-pp",
        distributed_timeout_minutes=7 * DAY_MINUTES,
        create_gloo_process_groups=dims.distributed_optimizer,
    )
    with torch.random.fork_rng(devices=[]):  # it reseeds the default generator; the caller's stream stays
        tensor_parallel.model_parallel_cuda_manual_seed(0)


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


class PipelineStage(NamedTuple):
    """This rank's pipeline stage: its GPTModel chunks (one per virtual stage: ``vpp`` of them, the
    layers of virtual stages ``index``, ``index + pp``, ...), the model's ``TransformerConfig``, the
    stage's index, and the tensor- and pipeline-parallel groups it runs over."""

    chunks: list[torch.nn.Module]
    config: Any
    index: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup

    def virtual_stages(self) -> list[int]:
        """The virtual stage (of pp x vpp, in layer order) each chunk is."""
        pp = self.pp_group.size()
        return [chunk * pp + self.index for chunk in range(len(self.chunks))]


def build_stage(
    shape: ModelShape,
    dims: ParallelDims,
    device: torch.device,
    *,
    critic: bool,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
) -> PipelineStage:
    """This rank's pipeline stage of the GPTModel on ``device`` with ``dtype`` parameters (bf16: Megatron's
    bf16 mode), randomly initialised (the caller loads the real weights); a critic's last stage ends in
    a ``ValueHead``. ``recompute`` ("none", "selective", "full") picks Megatron's activation
    recomputation (``RECOMPUTE``); with ``dims.vpp`` > 1, one chunk per virtual stage (interleaved 1F1B)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from areal_hpc.engines.megatron.attention import PackedCoreAttention
    from areal_hpc.engines.megatron.gemma import gemma3_layer, scale_embeddings
    from areal_hpc.engines.megatron.norm import MarkedRMSNorm
    from areal_hpc.engines.megatron.outputs import LogprobHead

    # perform_initialization: on CPU it is what marks the TP-split parameters (tensor_model_parallel),
    # which the gradient norm reads; the loaded weights then replace the random ones.
    config = transformer_config(
        shape,
        dims.tp,
        dims.pp,
        dims.ep,
        dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=True,
        calculate_per_token_loss=True,
        sequence_parallel=dims.sequence_parallel,
        variable_seq_lengths=True,  # micro-batches of any length across stages
        moe_token_dispatcher_type="alltoall",  # "allgather" refuses the above
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        batch_p2p_comm=dims.vpp == 1,  # interleaved: each direction on its own group
        **RECOMPUTE[recompute],
    )
    experts = dict(num_experts=shape.experts or None, moe_grouped_gemm=False)  # one MLP per expert
    if device.type == "cuda" and has_transformer_engine():
        from megatron.core.extensions.transformer_engine import TENorm

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm, **experts)
        if shape.gemma:
            gemma3_layer(spec, shape, TENorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm", **experts)
        layer, attention = spec.submodules, spec.submodules.self_attention.submodules
        attention.core_attention = PackedCoreAttention
        layer.input_layernorm = layer.pre_mlp_layernorm = MarkedRMSNorm
        if shape.qk_norm:
            attention.q_layernorm = attention.k_layernorm = MarkedRMSNorm
        if shape.gemma:
            gemma3_layer(spec, shape, MarkedRMSNorm)
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * (shape.layers // (dims.pp * dims.vpp)), layer_norm=MarkedRMSNorm
        )
    chunks = []
    for virtual in range(dims.vpp):
        vp_stage = virtual if dims.vpp > 1 else None
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config,
            spec,
            post_process=last,
            vp_stage=vp_stage,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            **gpt_model_args(shape),
        )
        if critic and last:
            model.output_layer = ValueHead(shape.hidden, 1, sequence_parallel=dims.sequence_parallel)
        elif last:  # the same weight, turned into logprobs a chunk of positions at a time
            layer = model.output_layer
            model.output_layer = LogprobHead(layer.weight, layer.tp_group, sequence_parallel=layer.sequence_parallel)
        if shape.gemma and model.pre_process:
            scale_embeddings(model, shape.hidden)
        chunks.append(model.to(device))
    return PipelineStage(
        chunks,
        config,
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
    )


def in_compute_dtype(model, config):
    """``model`` in Megatron's ``Float16Module`` when its config is bf16 (every parameter bf16, the last
    stage's output upcast to fp32), else itself."""
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model) if config.bf16 else model


def with_fp32_master_weights(optimizer: torch.optim.Optimizer):
    """Megatron's ``Float16OptimizerWithFloat16Params`` around ``optimizer`` (built on bf16 parameters):
    its parameter groups then hold fp32 master copies, it takes each parameter's fp32 ``main_grad`` as
    the master's gradient and copies the stepped masters back. No loss scaling (bf16 needs none) and no
    clipping of its own: the engine clips the main gradients with ``clip_grad_norm`` first."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return Float16OptimizerWithFloat16Params(
        optimizer, OptimizerConfig(bf16=True, clip_grad=0.0), grad_scaler=None, init_state_fn=None
    )


def with_distributed_optimizer(optimizer: torch.optim.Optimizer, roots: list, max_norm: float, *, bf16: bool):
    """Megatron's ``DistributedOptimizer`` (ZeRO-1) around ``optimizer`` (built on the parameters of the DDP
    model chunks ``roots``, which reduce-scatter gradients): each dp x cp rank keeps the fp32 master
    weights (in fp32, views of the parameters) and Adam state of its contiguous share of each gradient
    buffer, steps them, and all-gathers the parameters. It clips at ``max_norm`` itself (``inf``: no
    clipping) over its shards, counting each parameter once over all ranks, and returns the norm from
    ``step()``."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    config = OptimizerConfig(bf16=bf16, clip_grad=max_norm, use_distributed_optimizer=True)
    sharded = DistributedOptimizer(
        optimizer,
        config,
        grad_scaler=None,
        init_state_fn=None,
        model_chunks=roots,
        per_model_buffers={i: root.buffers for i, root in enumerate(roots)},
        data_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        data_parallel_group_gloo=parallel_state.get_data_parallel_group_gloo(with_context_parallel=True),
        data_parallel_group_idx=parallel_state.get_model_parallel_group().rank(),
        distributed_optimizer_instance_id=0,
    )
    sharded.grad_stats_parallel_group = parallel_state.get_intra_distributed_optimizer_instance_group()
    return sharded


def wrap_data_parallel(model, config, mesh: TrainMesh, *, sharded: bool, distributed_optimizer: bool = False):
    """Megatron DDP (reduce-scattering the gradients for the ``distributed_optimizer``), or with ``sharded``
    (``fsdp``) Megatron's FSDP2 wrapper (``fully_shard`` on every layer, then the root, over the dp x cp
    ranks), with gradients summed, not averaged. Its default units also take ``ColumnParallelLinear``
    (inside the local spec's layers: FSDP2 wants inner units wrapped first) and the embedding (whose
    weight a tied output layer reads outside its forward): both stay with the root here."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.fsdp import FSDPModule

    if not sharded:
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        return DistributedDataParallel(config, ddp, model)
    root = TorchFullyShardedDataParallel(
        config,
        TorchFullyShardedDataParallelConfig(),
        model,
        sub_modules_to_wrap={TransformerLayer},
        process_group=mesh.group("dp_cp"),
    )
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum: the loss weights already normalise the minibatch
            unit.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)
    return root


def clip_grad_norm(
    params: list[torch.nn.Parameter], grads: list[torch.Tensor], max_norm: float, mesh: TrainMesh, *, sharded: bool
) -> float:
    """The norm of the whole model's gradient (``grads``, one per parameter of ``params``), each parameter
    counted once, and the gradients scaled in place to at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s
    rule). Experts (Megatron marks them ``allreduce=False``) are summed over the expert-parallel ranks that
    hold them, the rest over the model-parallel ranks (and with ``sharded``, FSDP's shards over the dp x cp
    ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    total = 0.0
    for expert, group in (
        (False, parallel_state.get_model_parallel_group()),
        (True, parallel_state.get_expert_tensor_model_pipeline_parallel_group()),
    ):
        square = torch.zeros((), dtype=torch.float32, device=mesh.device)
        for p, grad in zip(params, grads):
            if (
                param_is_not_shared(p)
                and param_is_not_tensor_parallel_duplicate(p)
                and expert != getattr(p, "allreduce", True)
            ):
                grad = grad.to_local() if isinstance(grad, DTensor) else grad
                square += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
        dist.all_reduce(square, group=group)
        if sharded:
            dist.all_reduce(square, group=mesh.group("dp_cp"))
        total += float(square)
    norm = total**0.5
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
    return norm


@functools.cache
def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
