"""Hugging Face Qwen2/Qwen3/Qwen3-MoE/Llama 3/Gemma 3 <-> Megatron-core GPTModel: the model's ``TransformerConfig`` and
GPTModel arguments from the HF config, and the state dict of one tensor-parallel rank, expert-parallel
rank and pipeline stage from the HF tensors (and back, from the shards of every TP and EP rank).

Megatron's layout (megatron/core/transformer/attention.py, mlp.py, tensor_parallel/layers.py):
- ``linear_qkv`` fuses q, k and v per query group: the rows of group g are its heads' q rows, then
  its k rows, then its v rows; tensor parallelism gives each rank a contiguous run of groups.
- ``linear_fc1`` (SwiGLU) is [gate; up] *per TP shard*: rank r holds gate rows r and up rows r.
- column-parallel weights (qkv, fc1, embedding, output layer) split dim 0 over TP, row-parallel ones
  (``linear_proj``, ``linear_fc2``) dim 1; norms are replicated.
- each pipeline stage numbers its layers from 0; stage s holds global layers s*L/pp onwards. The
  embedding lives on the first stage, the final norm and output layer on the last; with tied
  embeddings and pp > 1 the last stage keeps its own copy of the embedding as ``output_layer``.
- A PPO critic (``ModelShape.value_head``) is HF's token classifier with one label: the same body,
  and in the output layer's place its ``score`` head (weight [1, H] and bias, replicated over TP).
- Mixture-of-Experts layers (megatron/core/transformer/moe/): ``mlp.router`` is HF's ``mlp.gate``
  (replicated); expert-parallel rank k holds experts k*E/ep onwards as ``mlp.experts.local_experts.i``
  (``SequentialMLP``), each a SwiGLU MLP split over TP like the dense one. HF holds a layer's experts
  fused (``experts.gate_up_proj`` [E, 2I, H], expert e's [gate; up]; ``experts.down_proj`` [E, H, I]);
  the conversion goes through the per-expert names checkpoints store (``models.hf.EXPERT_KEY``).
- Gemma 3's norms after attention and after the MLP are ``post_layernorm`` inside ``linear_proj`` and
  ``linear_fc2`` (``engines.megatron.gemma``); its pre-MLP norm is HF's ``pre_feedforward_layernorm``.
  Gemma's RMSNorm weights w (applied as 1 + w) are Megatron's zero-centred gammas as they are.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from areal_hpc.builtins import check_family
from areal_hpc.errors import UserError
from areal_hpc.models.hf import EXPERT_KEY, fuse_expert_weights

REPLICATED, COLUMN, ROW, QKV, FC1 = "replicated", "column", "row", "qkv", "fc1"
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # within a layer
# Megatron name within a layer -> (HF names within "model.layers.N.", how TP splits it)
LAYER_RULES = {
    "input_layernorm.weight": (("input_layernorm.weight",), REPLICATED),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        QKV,
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), REPLICATED),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), REPLICATED),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ROW),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), REPLICATED),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), ROW),
    "mlp.router.weight": (("mlp.gate.weight",), REPLICATED),
}
# Gemma 3's sandwich norms: Megatron name within a layer -> (HF names, how TP splits it), over LAYER_RULES
SANDWICH_NORM_RULES = {
    "pre_mlp_layernorm.weight": (("pre_feedforward_layernorm.weight",), REPLICATED),
    "self_attention.linear_proj.post_layernorm.weight": (("post_attention_layernorm.weight",), REPLICATED),
    "mlp.linear_fc2.post_layernorm.weight": (("post_feedforward_layernorm.weight",), REPLICATED),
}
DENSE_MLP, ROUTER = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"), "mlp.router.weight"
# Megatron name within an expert -> (HF names within "model.layers.N.mlp.experts.E.", how TP splits it)
EXPERT_RULES = {
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), FC1),
    "linear_fc2.weight": (("down_proj.weight",), ROW),
}
EMBEDDING, FINAL_NORM, OUTPUT = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
GLOBAL_RULES = {
    EMBEDDING: (("model.embed_tokens.weight",), COLUMN),
    FINAL_NORM: (("model.norm.weight",), REPLICATED),
    OUTPUT: (("lm_head.weight",), COLUMN),
}
VALUE_HEAD = {OUTPUT: (("score.weight",), REPLICATED), "output_layer.bias": (("score.bias",), REPLICATED)}


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs of a Hugging Face Qwen2/Qwen3/Qwen3-MoE/Llama 3/Gemma 3 config (``experts`` = 0:
    dense)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    rope_base: float
    eps: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    renormalise_top_k: bool = False  # HF's norm_topk_prob: the chosen experts' probabilities sum to 1
    value_head: bool = False  # a critic: HF's token classifier (``score``) in place of the LM head, untied
    rope_scaling_factor: float = 0.0  # Llama 3's RoPE scaling ("llama3"); 0: none
    rope_interpolation: float = 0.0  # "linear" RoPE scaling: positions divided by this factor; 0: none
    # Gemma 3: (1 + w) RMSNorms, norms after attention and after the MLP too, embeddings times sqrt(hidden),
    # gated GELU (tanh); its attention scale; its sliding-window layers (``sliding_layers``, one per layer),
    # whose queries see the last ``sliding_window`` positions (their own included), at RoPE base ``local_rope_base``
    gemma: bool = False
    softmax_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    local_rope_base: float = 0.0

    @classmethod
    def from_hf(cls, config) -> ModelShape:
        check_family(config.model_type, "Megatron engine", "train it with actor.engine=torch")
        qwen3, moe = config.model_type in ("qwen3", "qwen3_moe"), config.model_type == "qwen3_moe"
        llama, gemma = config.model_type == "llama", config.model_type == "gemma3_text"
        rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta, "rope_type": "default"}
        if (qwen3 or gemma) and config.attention_bias:
            raise UserError(f"actor.engine=megatron does not build {config.model_type} with attention_bias=true")
        if llama and config.mlp_bias:
            raise UserError("actor.engine=megatron does not build Llama with mlp_bias=true")
        if moe and (config.decoder_sparse_step != 1 or config.mlp_only_layers):
            raise UserError(
                "actor.engine=megatron builds Qwen3-MoE with experts in every layer, not "
                f"decoder_sparse_step={config.decoder_sparse_step} mlp_only_layers={config.mlp_only_layers}"
            )
        experts = (
            dict(
                experts=config.num_experts,
                experts_per_token=config.num_experts_per_tok,
                expert_ffn=config.moe_intermediate_size,
                renormalise_top_k=config.norm_topk_prob,
            )
            if moe
            else {}
        )
        if gemma:  # the global layers' RoPE (the sliding layers' base is ``local_rope_base``)
            rope = rope["full_attention"]
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            max_positions=config.max_position_embeddings,
            rope_base=float(rope["rope_theta"]),
            eps=config.rms_norm_eps,
            tied=bool(config.tie_word_embeddings),
            qkv_bias=bool(config.attention_bias) if llama else not (qwen3 or gemma),
            qk_norm=qwen3 or gemma,
            **_rope_scaling(rope),
            **(_gemma3_fields(config) if gemma else experts),
        )

    def critic(self) -> ModelShape:
        """The shape of this model's PPO critic (its body under a value head)."""
        if self.gemma:  # the critic's folder is HF's token classifier
            raise UserError(
                "actor.engine=megatron cannot build a PPO critic of a Gemma 3 model: transformers has no Gemma 3 "
                "token classifier; use a critic-free actor.adv_estimator such as grpo"
            )
        return replace(self, tied=False, value_head=True)

    def check_layout(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise ``UserError`` when the model cannot be split ``tp`` x ``pp`` x ``ep`` ways."""
        mlp = ("moe_intermediate_size", self.expert_ffn) if self.experts else ("intermediate_size", self.ffn)
        for name, size in (
            ("num_key_value_heads", self.kv_heads),
            ("num_attention_heads", self.heads),
            mlp,
            ("vocab_size", self.vocab),
        ):
            if size % tp:
                raise UserError(f"actor.parallel.tp={tp} must divide the model's {name}={size}")
        if self.layers % pp:
            raise UserError(f"actor.parallel.pp={pp} must divide the model's num_hidden_layers={self.layers}")
        if ep > 1 and not self.experts:
            raise UserError(f"actor.parallel.ep={ep} needs a Mixture-of-Experts model (Qwen3-MoE); this one is dense")
        if self.experts % ep:
            raise UserError(f"actor.parallel.ep={ep} must divide the model's num_experts={self.experts}")

    def layer_offset(self, stage: int, pp: int) -> int:
        return stage * self.layers // pp

    def layer_rules(self) -> dict:
        """Megatron name within a layer -> (HF names within "model.layers.N.", how TP splits it)."""
        return LAYER_RULES | SANDWICH_NORM_RULES if self.gemma else LAYER_RULES


# Llama 3's RoPE scaling as Megatron builds it (rotary_pos_embedding.py's _apply_scaling): only the factor
# is a parameter there, the rest are these constants, which Llama 3.1-3.3's configs carry.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_scaling(rope: dict) -> dict:
    """The ``ModelShape`` RoPE-scaling field of HF's ``rope_parameters``: the "llama3" factor, or the "linear"
    one (Megatron's ``seq_len_interpolation_factor``); other scalings, or llama3's with constants Megatron
    does not take, are refused in one line."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_interpolation": float(rope["factor"])}
    if kind != "llama3":
        raise UserError(f"actor.engine=megatron does not build RoPE scaling {kind!r} (it builds 'llama3' and 'linear')")
    given = {name: float(rope.get(name, -1)) for name in MEGATRON_LLAMA3_ROPE}
    if given != MEGATRON_LLAMA3_ROPE:
        raise UserError(f"actor.engine=megatron builds 'llama3' RoPE scaling with {MEGATRON_LLAMA3_ROPE}, not {given}")
    return {"rope_scaling_factor": float(rope["factor"])}


# Gemma 3 settings the engine builds as they are by default; any other value is refused by name
GEMMA3_FIXED = {
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}


def _gemma3_fields(config) -> dict:
    """``ModelShape``'s Gemma 3 fields of a ``Gemma3TextConfig``: its sliding layers ("sliding_attention" in
    ``layer_types``) take their RoPE base from ``rope_parameters["sliding_attention"]``, the full ones
    theirs (possibly "linear"-scaled) from ``["full_attention"]``."""
    for key, value in GEMMA3_FIXED.items():
        if getattr(config, key) != value:
            raise UserError(
                f"actor.engine=megatron builds Gemma 3 with {key}={value}, not {getattr(config, key)!r}; "
                "train it with actor.engine=torch"
            )
    local = config.rope_parameters["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise UserError(
            "actor.engine=megatron builds Gemma 3's sliding-window layers without RoPE scaling, "
            f"not {local['rope_type']!r}"
        )
    sliding = tuple(kind == "sliding_attention" for kind in config.layer_types)
    window = (config.sliding_window or 0) if any(sliding) else 0
    return dict(
        gemma=True,
        softmax_scale=config.query_pre_attn_scalar**-0.5,
        sliding_window=window,
        sliding_layers=sliding if window else (),
        local_rope_base=float(local["rope_theta"]),
    )


GELU_TANH = functools.partial(F.gelu, approximate="tanh")  # HF's "gelu_pytorch_tanh"


def transformer_config(shape: ModelShape, tp: int, pp: int, ep: int = 1, dtype: torch.dtype = torch.float32, **runtime):
    """Megatron's ``TransformerConfig`` of the model (RMSNorm, SwiGLU, no linear biases but q/k/v's for
    Qwen2, q/k RMSNorm for Qwen3, no dropout; Gemma 3's (1 + w) RMSNorms, gated GELU, attention scale and
    sliding windows: Megatron's ``window_size`` (left, right) counts the keys before the query's own);
    ``runtime`` adds the engine's own settings.

    Qwen3-MoE's router is softmax -> top-k -> (norm_topk_prob) renormalise. Megatron's softmax router
    either takes the softmax over the top-k logits, which is the renormalised top-k of the full softmax,
    or (``moe_router_pre_softmax``) the top-k of the full softmax as it is. No load-balancing loss: HF
    adds one only when asked for router logits with labels (``output_router_logits``, off by default),
    and the trainer's loss is computed from logprobs alone. Every token reaches its experts (no capacity
    factor, nothing dropped), as in HF."""
    from megatron.core.transformer import TransformerConfig

    experts = (
        dict(
            num_moe_experts=shape.experts,
            moe_router_topk=shape.experts_per_token,
            moe_ffn_hidden_size=shape.expert_ffn,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not shape.renormalise_top_k,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
        )
        if shape.experts
        else {}
    )
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.eps,
        layernorm_zero_centered_gamma=shape.gemma,
        gated_linear_unit=True,
        activation_func=GELU_TANH if shape.gemma else F.silu,
        softmax_scale=shape.softmax_scale or None,
        window_size=(shape.sliding_window - 1, 0) if shape.sliding_window else None,
        window_attn_skip_freq=[int(s) for s in shape.sliding_layers] if shape.sliding_window else None,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **experts,
        **runtime,
    )


def gpt_model_args(shape: ModelShape) -> dict:
    """GPTModel's keyword arguments besides the config, layer spec and pre/post process."""
    return dict(
        vocab_size=shape.vocab,
        max_sequence_length=shape.max_positions,
        position_embedding_type="rope",
        rotary_base=shape.rope_base,
        rotary_percent=1.0,
        rope_scaling=bool(shape.rope_scaling_factor),
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=shape.rope_interpolation or None,
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,
    )


def stage_names(shape: ModelShape, stage: int, pp: int, ep: int = 1) -> list[str]:
    """The Megatron state-dict names of pipeline stage ``stage`` (its layers, and an expert-parallel
    rank's experts, numbered from 0)."""
    per_layer = [
        name
        for name in shape.layer_rules()
        if (shape.qkv_bias or not name.endswith("linear_qkv.bias"))
        and (shape.qk_norm or ("k_layernorm" not in name and "q_layernorm" not in name))
        and name not in ((ROUTER,) if not shape.experts else DENSE_MLP)
    ]
    per_layer += [f"mlp.experts.local_experts.{i}.{name}" for i in range(shape.experts // ep) for name in EXPERT_RULES]
    names = [EMBEDDING] if stage == 0 else []
    names += [f"decoder.layers.{i}.{name}" for i in range(shape.layers // pp) for name in per_layer]
    if stage == pp - 1:
        names.append(FINAL_NORM)
        if shape.value_head:
            names += list(VALUE_HEAD)
        elif not shape.tied or pp > 1:
            names.append(OUTPUT)
    return names


def global_name(name: str, offset: int, first_expert: int = 0) -> str:
    """A stage's Megatron name with its layer (and an expert-parallel rank's expert, the first of which
    is ``first_expert``) numbered in the whole model."""
    match = LAYER.match(name)
    if not match:
        return name
    expert = LOCAL_EXPERT.match(match[2])
    within = f"mlp.experts.local_experts.{int(expert[1]) + first_expert}.{expert[2]}" if expert else match[2]
    return f"decoder.layers.{int(match[1]) + offset}.{within}"


def is_expert(name: str) -> bool:
    """Whether a Megatron name is an expert's tensor (each expert-parallel rank holds its own)."""
    layer = LAYER.match(name)
    return bool(layer and LOCAL_EXPERT.match(layer[2]))


def hf_names(name: str, shape: ModelShape) -> tuple[tuple[str, ...], str]:
    """(HF names, TP split) of a Megatron name numbered in the whole model; an expert's are the
    per-expert names that checkpoints store."""
    match = LAYER.match(name)
    if not match:
        return (VALUE_HEAD if shape.value_head and name in VALUE_HEAD else GLOBAL_RULES)[name]
    expert = LOCAL_EXPERT.match(match[2])
    if expert:
        names, kind = EXPERT_RULES[expert[2]]
        return tuple(f"model.layers.{match[1]}.mlp.experts.{expert[1]}.{n}" for n in names), kind
    names, kind = shape.layer_rules()[match[2]]
    return tuple(f"model.layers.{match[1]}.{n}" for n in names), kind


def _hf_tensor(hf_state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The HF tensor ``name`` of a model's state dict; one expert's projection is cut from its layer's
    fused ``gate_up_proj`` / ``down_proj``."""
    expert = EXPERT_KEY.match(name)
    if not expert:
        return hf_state[name]
    prefix, index, projection = expert[1], int(expert[2]), expert[3]
    if projection == "down_proj":
        return hf_state[f"{prefix}.down_proj"][index]
    return hf_state[f"{prefix}.gate_up_proj"][index].chunk(2)[projection == "up_proj"]


def _qkv_groups(tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """q, k, v -> [groups, (heads/groups + 2) * head_dim, ...]: each group's q rows, k rows, v rows."""
    q, k, v = (t.reshape(shape.kv_heads, -1, *t.shape[1:]) for t in tensors)
    return torch.cat([q, k, v], dim=1)


def shard(kind: str, tensors: list[torch.Tensor], shape: ModelShape, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of the Megatron tensor made of the full HF ``tensors``."""
    if kind == REPLICATED:
        return tensors[0].clone()
    if kind in (COLUMN, ROW):
        return tensors[0].chunk(tp, dim=0 if kind == COLUMN else 1)[rank].clone()
    if kind == FC1:
        return torch.cat([t.chunk(tp)[rank] for t in tensors])
    groups = _qkv_groups(tensors, shape).chunk(tp)[rank]
    return groups.reshape(-1, *groups.shape[2:]).clone()


def unshard(kind: str, shards: list[torch.Tensor], shape: ModelShape) -> list[torch.Tensor]:
    """The full HF tensors of a Megatron tensor from the shards of every TP rank, in rank order."""
    if kind == REPLICATED:
        return [shards[0]]
    if kind in (COLUMN, ROW):
        return [torch.cat(shards, dim=0 if kind == COLUMN else 1)]
    if kind == FC1:
        gates, ups = zip(*(s.chunk(2) for s in shards))
        return [torch.cat(gates), torch.cat(ups)]
    groups = torch.cat(shards).reshape(shape.kv_heads, -1, *shards[0].shape[1:])
    q, k, v = groups.split([shape.heads // shape.kv_heads * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return [t.reshape(-1, *t.shape[2:]).contiguous() for t in (q, k, v)]


def hf_to_megatron(
    hf_state: dict[str, torch.Tensor],
    shape: ModelShape,
    tp_rank: int,
    tp: int,
    stage: int,
    pp: int,
    *,
    ep_rank: int = 0,
    ep: int = 1,
) -> dict[str, torch.Tensor]:
    """The state dict of TP rank ``tp_rank`` and EP rank ``ep_rank`` on pipeline stage ``stage`` from a
    HF model's state dict (experts fused as the model holds them; ``lm_head.weight`` may be missing
    when the embeddings are tied)."""
    offset, first_expert = shape.layer_offset(stage, pp), ep_rank * shape.experts // ep
    state = {}
    for name in stage_names(shape, stage, pp, ep):
        names, kind = hf_names(global_name(name, offset, first_expert), shape)
        if name == OUTPUT and shape.tied:
            names = GLOBAL_RULES[EMBEDDING][0]  # the last stage's copy of the tied embedding
        state[name] = shard(kind, [_hf_tensor(hf_state, n) for n in names], shape, tp_rank, tp)
    return state


def stage_to_hf(
    stage_shards: Iterator[tuple[str, list[torch.Tensor]]], shape: ModelShape, stage: int, pp: int, ep: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs of pipeline stage ``stage`` from its (Megatron name, shards) pairs:
    the TP shards in rank order, and for an expert's tensor those of every EP rank, EP rank major
    (what an all-gather over Megatron's expert tensor-and-model-parallel group returns). A layer's
    experts come fused, as the HF model holds them, once the last of them is seen. A tied embedding
    also comes as ``lm_head.weight`` (the last stage's copy with pp > 1, the embedding itself after
    the final norm with pp = 1)."""
    offset, local_experts = shape.layer_offset(stage, pp), shape.experts // ep
    embedding, experts = None, {}
    for name, shards in stage_shards:
        if is_expert(name):
            tp = len(shards) // ep
            for rank in range(ep):
                names, kind = hf_names(global_name(name, offset, rank * local_experts), shape)
                experts.update(zip(names, unshard(kind, shards[rank * tp : (rank + 1) * tp], shape)))
            if len(experts) == 3 * shape.experts:  # gate, up and down of every expert of the layer
                yield from fuse_expert_weights(experts).items()
                experts = {}
            continue
        names, kind = hf_names(global_name(name, offset), shape)
        for hf_name, tensor in zip(names, unshard(kind, shards, shape)):
            embedding = tensor if name == EMBEDDING else embedding
            yield hf_name, tensor
    if shape.tied and pp == 1:
        yield "lm_head.weight", embedding
