"""Tiny model and tokenizer: built offline, loadable by plain transformers, identical after a round trip."""

import functools
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from areal_hpc.builtins import MODEL_PRESETS
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.models.chat import completion_ids, prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.models.replicas import REPLICAS
from areal_hpc.models.tiny import PRESETS, count_parameters
from areal_hpc.models.tokenizer import build_tokenizer


def test_plain_transformers_loads_the_folder_offline(tiny_model_dir):
    """A fresh interpreter with only transformers and HF_HUB_OFFLINE=1, no areal_hpc code involved."""
    script = (
        "import json, sys; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r});"
        f"t = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r});"
        "print(json.dumps([m.config.model_type, sum(p.numel() for p in m.parameters()), t('1+2')['input_ids']]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    model_type, n_params, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert model_type == "qwen2"
    assert 0.5e6 < n_params < 5e6
    assert ids == load_tokenizer(tiny_model_dir)("1+2")["input_ids"]


def test_save_load_round_trip_gives_identical_logits(tiny_model_dir, tmp_path):
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)  # differ from the initialisation on disk
    ids = torch.tensor([prompt_ids(tokenizer, "What is 12+7?")])
    saved = save_model(model, tokenizer, tmp_path / "copy")
    reloaded = load_model(saved)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert count_parameters(reloaded) == count_parameters(model)
    assert not (tmp_path / "copy.partial").exists()


def test_tokenizer_is_deterministic_and_digits_are_single_tokens(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert build_tokenizer(corpus_for_tokenizer(0)).get_vocab() == tokenizer.get_vocab()
    digits = tokenizer("9081726354", add_special_tokens=False)["input_ids"]
    assert len(digits) == 10


def test_chat_template_renders_turns_with_explicit_newlines(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    text = tokenizer.decode(prompt_ids(tokenizer, "What is 2+2?"))
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert completion_ids(tokenizer, "4")[-1] == tokenizer.eos_token_id


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_encode_decode_round_trip_preserves_any_text(tiny_model_dir, text):
    tokenizer = _cached_tokenizer(str(tiny_model_dir))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    import unicodedata

    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


@functools.lru_cache
def _cached_tokenizer(path: str):
    return load_tokenizer(path)


def test_every_preset_name_has_one_shape():
    assert list(MODEL_PRESETS) == [*PRESETS, *REPLICAS]


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_each_preset_is_a_model_of_its_family_that_transformers_loads(preset, preset_dir):
    """``init-model --preset``'s folder: plain transformers builds the preset's family from it, with the
    tokenizer's vocabulary and the head tied to the embeddings, and generates from it; a replica keeps what
    sets its original apart (Qwen3-1.7B: q/k norms, heads x head dim = hidden; Llama-3.2-1B: "llama3" RoPE
    scaling, 4 query heads per key/value head; gemma-3-1b: five sliding-window layers to one global, each kind
    its RoPE base, one key/value head)."""
    folder = preset_dir(preset)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), load_tokenizer(folder)
    config = model.config
    assert config.model_type == MODEL_PRESETS[preset] and config.vocab_size == len(tokenizer)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    prompt = torch.tensor([prompt_ids(tokenizer, "What is 2+2?")])
    assert model.generate(prompt, max_new_tokens=3, do_sample=False).shape == (1, prompt.shape[1] + 3)
    if preset == "qwen3-replica":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
        assert config.num_attention_heads * config.head_dim == config.hidden_size
    if preset == "llama3-replica":
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.num_attention_heads == 4 * config.num_key_value_heads
    if preset == "gemma3-replica":
        assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert config.sliding_window < config.max_position_embeddings and config.num_key_value_heads == 1
        thetas = {kind: config.rope_parameters[kind]["rope_theta"] for kind in ("sliding_attention", "full_attention")}
        assert thetas == {"sliding_attention": 1e4, "full_attention": 1e6}
