"""Model sizes the cost model needs (parameters, KV cache bytes), read from a Hugging Face config.json of
any family ``builtins.FAMILY_PATHS`` lists: Qwen2 (q/k/v biases), Qwen3 (q/k norms), Llama 3 and Gemma 3
(a head dimension of its own, four norms a layer, sliding-window layers whose KV cache stops growing at
the window).

``--model NAME`` looks in the shipped catalog (areal_hpc/sched/catalog/models/NAME/config.json); a folder
or a config.json path works too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.errors import UserError, closest
from areal_hpc.sched.catalog import MODELS, model_names

QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: shapes from its config.json, bf16 weights and KV cache."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int = 32768  # config.json's max_position_embeddings: the longest sequence it serves
    head_dim: int = 0  # 0: hidden / heads
    attention_bias: bool = True  # q/k/v projections with biases (Qwen2's)
    qk_norm: bool = False  # an RMSNorm over each head's q and k (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # Gemma 3's four: before and after attention and MLP
    sliding_layers: int = 0  # layers attending over the last ``sliding_window`` tokens only
    sliding_window: int = 0

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> float:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_width
        attention = self.hidden * qkv + self.heads * self.head_width * self.hidden + (qkv if self.attention_bias else 0)
        norms = self.norms_per_layer * self.hidden + (2 * self.head_width if self.qk_norm else 0)
        per_layer = attention + 3 * self.hidden * self.intermediate + norms
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    def kv_bytes(self, context: float) -> float:
        """bf16 K and V of one sequence of ``context`` tokens over every layer (a sliding layer keeps at
        most its window)."""
        per_layer_token = 2 * self.kv_heads * self.head_width * 2.0
        full = (self.layers - self.sliding_layers) * context
        return per_layer_token * (full + self.sliding_layers * min(context, self.sliding_window))


def load_model_spec(name: str) -> ModelSpec:
    """A model by its name in the shipped catalog, or by a path to a folder or a config.json."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    model, config = (path.parent.name, path) if path.is_file() else (name, MODELS / name / "config.json")
    if not config.is_file():
        raise UserError(
            f"unknown model '{name}'{closest(name, model_names())} "
            f"(known: {', '.join(model_names())}; or give a folder with a config.json)"
        )
    cfg = json.loads(config.read_text())
    family = cfg.get("model_type", "qwen2")
    try:
        return ModelSpec(
            model,
            cfg["hidden_size"],
            cfg["num_hidden_layers"],
            cfg["num_attention_heads"],
            cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            cfg["intermediate_size"],
            cfg["vocab_size"],
            bool(cfg.get("tie_word_embeddings", False)),
            int(cfg.get("max_position_embeddings", 32768)),
            head_dim=int(cfg.get("head_dim") or 0),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),  # Qwen2's config has no such key
            qk_norm=family in QK_NORM_FAMILIES,
            norms_per_layer=4 if family == "gemma3_text" else 2,
            sliding_layers=_sliding_layers(cfg),
            sliding_window=int(cfg.get("sliding_window") or 0),
        )
    except KeyError as exc:
        raise UserError(
            f"{config} lacks {exc.args[0]} (a decoder config.json needs hidden_size, num_hidden_layers, "
            f"num_attention_heads, intermediate_size, vocab_size)"
        ) from None


def _sliding_layers(cfg: dict) -> int:
    """How many layers attend over a sliding window: Gemma 3's ``layer_types`` (or every layer but each
    ``sliding_window_pattern``-th), Qwen's ``use_sliding_window`` layers from ``max_window_layers`` on."""
    if not cfg.get("sliding_window"):
        return 0
    if cfg.get("layer_types"):
        return sum(kind == "sliding_attention" for kind in cfg["layer_types"])
    if cfg.get("model_type") == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return sum((i + 1) % pattern != 0 for i in range(cfg["num_hidden_layers"]))
    if cfg.get("use_sliding_window"):
        return max(0, cfg["num_hidden_layers"] - int(cfg.get("max_window_layers", cfg["num_hidden_layers"])))
    return 0
