"""Small causal LMs built offline for CPU runs, CI and the demo: tiny Qwen2s, a Qwen3-MoE, and scaled-down
replicas of released models (``models.replicas``).

``areal-hpc init-model --out DIR --preset tiny`` writes config.json, model.safetensors and the
tokenizer files; ``AutoModelForCausalLM.from_pretrained(DIR)`` loads them with HF_HUB_OFFLINE=1.
``builtins.MODEL_PRESETS`` names every preset and its family.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from areal_hpc.builtins import MODEL_PRESETS
from areal_hpc.models.chat_families import DEFAULT_FAMILY
from areal_hpc.models.replicas import REPLICA_TEMPLATES, REPLICAS
from areal_hpc.models.tokenizer import build_tokenizer

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
TINY_FIELDS = dict(tie_word_embeddings=True, rope_theta=10000.0)  # what PRESETS' models share


def preset_config(preset: str, **fields) -> PretrainedConfig:
    """The ``transformers`` config of ``preset`` (its family's class and its shape), with ``fields`` added
    (vocabulary, special tokens, context)."""
    shape = REPLICAS[preset] if preset in REPLICAS else {**PRESETS[preset], **TINY_FIELDS}
    return AutoConfig.for_model(MODEL_PRESETS[preset], **copy.deepcopy(shape), **fields)


def init_model(
    out: str | Path, corpus: list[str], preset: str = "tiny", seed: int = 0, template: str | None = None
) -> Path:
    """Write a freshly initialised model and its tokenizer (trained on ``corpus``, with the chat template and
    special tokens of ``template``: by default the replica's original's, else ChatML) to ``out`` in Hugging
    Face format. The folder appears whole (written aside, then renamed): processes on other nodes wait
    for it."""
    out = Path(out)
    tokenizer = build_tokenizer(corpus, family=template or REPLICA_TEMPLATES.get(preset, DEFAULT_FAMILY))
    config = preset_config(
        preset,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
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
