"""Model sizes the cost model needs (parameters, KV bytes per token), read from a Hugging Face config.json.

``--model NAME`` looks in the shipped catalog (areal_hpc/sched/catalog/models/NAME/config.json); a folder
or a config.json path works too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.errors import UserError, closest
from areal_hpc.sched.catalog import MODELS, model_names


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

    @property
    def params(self) -> float:
        head_dim = self.hidden // self.heads
        qkv = (self.heads + 2 * self.kv_heads) * head_dim
        attention = self.hidden * qkv + qkv + self.heads * head_dim * self.hidden  # q|k|v with bias, o without
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 2.0


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
        )
    except KeyError as exc:
        raise UserError(
            f"{config} lacks {exc.args[0]} (a decoder config.json needs hidden_size, num_hidden_layers, "
            f"num_attention_heads, intermediate_size, vocab_size)"
        ) from None
