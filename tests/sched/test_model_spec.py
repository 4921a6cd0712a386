"""The cost model's sizes of every catalogued family against transformers' own model of the same config.json
(built on the meta device): parameter counts exactly, and which layers keep a sliding-window KV cache."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from areal_hpc.sched.catalog import MODELS, model_names
from areal_hpc.sched.model_spec import load_model_spec


@pytest.mark.parametrize("name", model_names())
def test_parameters_and_kv_cache_match_the_transformers_model(name):
    spec = load_model_spec(name)
    config = AutoConfig.from_pretrained(MODELS / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert spec.params == sum(p.numel() for p in model.parameters())

    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * 2.0  # K and V in bf16
    for context in (100, 4096):
        expected = sum(
            per_token * (min(context, window) if kind == "sliding_attention" else context) for kind in layer_types
        )
        assert spec.kv_bytes(context) == expected


def test_the_catalogue_holds_each_family():
    families = {json.loads((MODELS / name / "config.json").read_text())["model_type"] for name in model_names()}
    assert families >= {"qwen2", "qwen3", "llama", "gemma3_text"}
