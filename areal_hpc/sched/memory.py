"""Memory of one rank, by kind: parameters, gradients, optimizer states, activations and a rollout server's KV
cache, in bytes, and whether they fit a device once a reserve for the framework is set aside. One set of
formulas for the planner (it skips layouts that cannot fit), ``areal-hpc plan`` (printed per role) and
``areal-hpc submit --check-memory`` (a layout that cannot fit is refused before anything is queued).

The activations are those of a Hugging Face Qwen2/Llama block trained by the torch engine: checked against
measured CPU runs in tests/sched/test_memory_estimator.py (within 5%) and one H200 step of a 1.78B model at
8192-token micro-batches (60.5 GiB estimated, 57.2 measured; bench/results/gpu_check-2026-11-27.md). This
project's Megatron engine (local layer spec, no Transformer Engine) kept more in that run: 78.2 GiB
measured against 59.7 estimated, so for ``actor.engine=megatron`` the estimate is low by about a quarter
(measured while its output layer still made the whole [tokens, V/tp] logits; it now makes them a chunk at
a time, as the torch engine does). Dense models only: expert parallelism (``ep``) changes nothing here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.sched.model_spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
RESERVE_FRACTION = 0.10  # of device memory: CUDA/NPU context, communicator buffers, allocator fragmentation
ROLLOUT_WORKSPACE_BYTES = 2e9  # a rollout server's prefill activations and CUDA graphs
ADAM_STATES = 2  # first and second moments
GB = 1e9


@dataclass(frozen=True)
class Precision:
    """``param_dtype``: the weights as the model holds them; ``compute_dtype``: its matrix multiplies
    (narrower: autocast, which keeps a copy of every weight in it through the step); ``master_dtype``:
    Adam's moments and, when wider than the weights, master weights; ``grad_dtype``: the gradients
    (Megatron's mixed precision: bfloat16 weights, float32 master weights, gradients in either)."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    master_dtype: str = "float32"
    grad_dtype: str = "float32"

    def __post_init__(self):
        for field in fields(self):
            if getattr(self, field.name) not in DTYPE_BYTES:
                raise UserError(
                    f"{field.name}={getattr(self, field.name)!r} is not a dtype the estimator knows "
                    f"({', '.join(DTYPE_BYTES)})"
                )

    @property
    def autocast(self) -> bool:
        return DTYPE_BYTES[self.compute_dtype] < DTYPE_BYTES[self.param_dtype]


@dataclass(frozen=True)
class TrainLayout:
    """What a trainer rank's memory depends on besides the model: the mesh (``dims.fsdp`` shards parameters,
    gradients and optimizer states over dp), ``shard_optimizer`` (ZeRO-1, Megatron's distributed optimizer:
    master weights and moments over dp), the tokens of one micro-batch, activation recomputation, and
    ``logit_tokens``: how many tokens' logits exist at once (None: the whole micro-batch's; the torch
    engine's chunked log-softmax holds one chunk's), and ``vocab_parallel``: whether tp splits the
    embedding and the LM head (Megatron) or each rank holds them whole (the torch engine)."""

    dims: ParallelDims
    precision: Precision = Precision()
    micro_tokens: int = 4096
    recompute: str = "none"
    shard_optimizer: bool = False
    logit_tokens: int | None = None
    vocab_parallel: bool = True

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise UserError(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of one rank of ``role``, by kind (all assumed held at once: an upper bound for engines
    that allocate gradients during the backward pass)."""

    role: str
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache

    def fits(self, device_bytes: float) -> bool:
        return self.total <= usable_bytes(device_bytes)

    def breakdown(self) -> dict[str, float]:
        """The kinds that hold memory, and the total, in bytes."""
        kinds = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "role"}
        return {**{k: v for k, v in kinds.items() if v}, "total": self.total}

    def describe(self, device_bytes: float | None = None) -> str:
        """One line: the total and its parts in GB, and the fit when ``device_bytes`` is given."""
        parts = ", ".join(f"{kind} {value / GB:.2f}" for kind, value in self.breakdown().items() if kind != "total")
        line = f"{self.role}: {self.total / GB:.2f} GB ({parts})"
        if device_bytes is None:
            return line
        verdict = "fits" if self.fits(device_bytes) else "does NOT fit"
        return f"{line}: {verdict} in {usable_bytes(device_bytes) / GB:.1f} of {device_bytes / GB:.0f} GB"


def usable_bytes(device_bytes: float) -> float:
    """What a rank may fill: the device less ``RESERVE_FRACTION`` for the framework."""
    return device_bytes * (1 - RESERVE_FRACTION)


def layer_params(model: ModelSpec) -> float:
    """Parameters of one decoder layer (ModelSpec's count: q/k/v with bias, o without, SwiGLU, two norms)."""
    return (
        model.params - model.hidden - model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
    ) / model.layers


def stage_params(model: ModelSpec, layout: TrainLayout) -> float:
    """Parameters on the heaviest rank: its stage's layers split over tp, plus the embedding and the LM
    head (one table when tied; with pp > 1 the first stage holds one, the last the other, or a copy of
    it when tied), split over tp by vocabulary when ``layout.vocab_parallel``."""
    dims = layout.dims
    layers = math.ceil(model.layers / dims.pp)
    tables = 1 if dims.pp > 1 or model.tied_embeddings else 2
    vocab_shards = dims.tp if layout.vocab_parallel else 1
    return layers * layer_params(model) / dims.tp + tables * model.vocab * model.hidden / vocab_shards + model.hidden


def layer_activation_bytes(model: ModelSpec, tokens: float, layout: TrainLayout) -> float:
    """Bytes one decoder layer keeps for its backward pass over ``tokens`` tokens of one rank.

    Per token, h hidden, q = heads x head dim, kv = kv heads x head dim, i the MLP width, split over tp
    but for the residual stream. In the parameter dtype: each norm's input and normalised value (2h a
    norm; Gemma 3 has four; HF computes RMSNorm in float32) and the rotary and attention tensors (rotated
    q and k, the grouped q/k/v the kernel reads, its output before and after the head merge: 4q + 3kv,
    in the dtype of the rotary tables). In the compute dtype: v (kv), the o projection's input (q), the
    SwiGLU's gate, up, activation and product (4i), and the matmuls' inputs from the norms: one cast per matmul under
    autocast (q, k, v, gate, up: 5h), else the two norms' outputs (2h). Selective recomputation drops
    the attention part; full recomputation keeps only the layer's input.
    """
    m, p, tp = model, layout.precision, layout.dims.tp
    # tp beyond the kv heads copies them
    q, kv = m.heads * m.head_width / tp, m.kv_heads / min(tp, m.kv_heads) * m.head_width
    wide, narrow = DTYPE_BYTES[p.param_dtype], DTYPE_BYTES[p.compute_dtype]
    if layout.recompute == "full":
        return tokens * m.hidden * wide
    attention = 0.0 if layout.recompute == "selective" else (4 * q + 3 * kv) * wide
    norm_outputs = 5 * m.hidden if p.autocast else 2 * m.hidden
    norms = 2 * m.norms_per_layer * m.hidden
    per_token = norms * wide + attention + (kv + q + 4 * m.intermediate / tp + norm_outputs) * narrow
    return tokens * per_token


def activation_bytes(model: ModelSpec, layout: TrainLayout) -> float:
    """A rank's activations at their peak: its stage's layers for every micro-batch a 1F1B pipeline holds
    (pp on the first stage), the one layer a full recomputation rebuilds, the logits, and autocast's
    copy of the weights."""
    dims = layout.dims
    tokens = layout.micro_tokens / dims.cp
    in_flight = math.ceil(model.layers / dims.pp) * dims.pp
    activations = in_flight * layer_activation_bytes(model, tokens, layout)
    if layout.recompute == "full":
        activations += layer_activation_bytes(model, tokens, replace(layout, recompute="none"))
    logit_tokens = tokens if layout.logit_tokens is None else min(tokens, layout.logit_tokens)
    # the LM head's output in the compute dtype and its float32 softmax (the gradient is formed in place)
    vocab = model.vocab / dims.tp if layout.vocab_parallel else model.vocab
    activations += logit_tokens * vocab * (4 + DTYPE_BYTES[layout.precision.compute_dtype])
    if layout.precision.autocast:
        activations += stage_params(model, layout) * DTYPE_BYTES[layout.precision.compute_dtype]
    return activations


def train_estimate(model: ModelSpec, layout: TrainLayout) -> MemoryEstimate:
    """Peak memory of one trainer rank of ``layout`` (Adam)."""
    dims, p = layout.dims, layout.precision
    params = stage_params(model, layout)
    weights_shards = dims.dp if dims.fsdp else 1
    states_shards = dims.dp if dims.fsdp or layout.shard_optimizer else 1
    master = DTYPE_BYTES[p.master_dtype]
    weights = params / weights_shards * DTYPE_BYTES[p.param_dtype]
    if dims.fsdp and dims.dp > 1:  # the layer being gathered and the one prefetched, whole
        weights += 2 * layer_params(model) / dims.tp * DTYPE_BYTES[p.param_dtype]
    master_copy = master if master > DTYPE_BYTES[p.param_dtype] else 0
    return MemoryEstimate(
        "trainer",
        params=weights,
        grads=params / weights_shards * DTYPE_BYTES[p.grad_dtype],
        optimizer=params / states_shards * (ADAM_STATES * master + master_copy),
        activations=activation_bytes(model, layout),
    )


def kv_shards(model: ModelSpec, tp: int, pp: int) -> int:
    """Ways the KV cache splits: by layer over pp, by KV head over tp (TP beyond the KV heads replicates)."""
    return min(tp, model.kv_heads) * pp


def kv_bytes_per_slot(model: ModelSpec, tp: int, pp: int, context: int, dtype: str = "bfloat16") -> float:
    """One sequence slot's KV cache on one device: context x layers x kv heads x head dim x 2 (K and V) x
    the dtype's bytes (``ModelSpec.kv_bytes`` counts bfloat16)."""
    scale = DTYPE_BYTES[dtype] / DTYPE_BYTES["bfloat16"]
    return model.kv_bytes(context) * scale / kv_shards(model, tp, pp)


def rollout_estimate(
    model: ModelSpec, tp: int, pp: int, slots: int, context: int, dtype: str = "bfloat16"
) -> MemoryEstimate:
    """Peak memory of one device of a rollout server: its share of the weights, ``slots`` sequences of
    ``context`` tokens of KV cache, and ``ROLLOUT_WORKSPACE_BYTES``."""
    weights = model.params * DTYPE_BYTES[dtype] / (tp * pp)
    return MemoryEstimate(
        "rollout",
        params=weights,
        activations=ROLLOUT_WORKSPACE_BYTES,
        kv_cache=slots * kv_bytes_per_slot(model, tp, pp, context, dtype),
    )


def rollout_slots(
    model: ModelSpec, device_bytes: float, tp: int, pp: int, context: int, dtype: str = "bfloat16"
) -> int:
    """The most sequence slots of ``context`` tokens whose KV cache fits beside the weights (0: none)."""
    free = usable_bytes(device_bytes) - rollout_estimate(model, tp, pp, 0, context, dtype).total
    return max(0, int(free / kv_bytes_per_slot(model, tp, pp, context, dtype)))


def largest_micro_tokens(model: ModelSpec, layout: TrainLayout, device_bytes: float) -> int:
    """The most tokens per micro-batch that fit (0: not even one); the estimate grows with them."""

    def fits(tokens: int) -> bool:
        return train_estimate(model, replace(layout, micro_tokens=tokens)).fits(device_bytes)

    low, high = 0, 1 << 24
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
