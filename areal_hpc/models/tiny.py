"""Tiny causal LMs built offline (Qwen2, and a Qwen3-MoE), for CPU runs, CI and the demo.

``areal-hpc init-model --out DIR --preset tiny`` writes config.json, model.safetensors and the
tokenizer files; ``AutoModelForCausalLM.from_pretrained(DIR)`` loads them with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from areal_hpc.models.tokenizer import IM_END, PAD, build_tokenizer

# hidden, layers, heads, kv heads, MLP width; "tiny" learns 1-3 digit addition in minutes on 2 cores.
# "tiny-moe" is a Qwen3-MoE of the same shape whose MLPs are 8 experts (2 per token) of a quarter the
# width: the model for trying expert parallelism (actor.parallel.ep) on a CPU.
PRESETS = {
    "tiny": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024
    ),
    "tiny-moe": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    ),
}


def preset_classes(preset: str) -> tuple[type, type]:
    """(config class, model class) of a preset's architecture."""
    if "num_experts" in PRESETS[preset]:
        return Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen2Config, Qwen2ForCausalLM


def init_model(out: str | Path, corpus: list[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Write a freshly initialised model and its tokenizer (trained on ``corpus``) to ``out`` in Hugging
    Face format. The folder appears whole (written aside, then renamed): processes on other nodes wait
    for it."""
    out = Path(out)
    tokenizer = build_tokenizer(corpus)
    config_class, model_class = preset_classes(preset)
    config = config_class(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        use_cache=True,
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
