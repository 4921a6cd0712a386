"""Tiny model and tokenizer: built offline, loadable by plain transformers, identical after a round trip."""

import functools
import json
import subprocess
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.models.chat import completion_ids, prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.models.tiny import count_parameters
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
