"""Load Hugging Face causal LMs (the tiny model, Qwen2/2.5/3 checkpoints) from local folders only."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from areal_hpc.errors import UserError

# Nothing is ever fetched from a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf_logging.disable_progress_bar()  # per-shard progress bars are noise next to our own progress display

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _check_model_dir(path: str | Path) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UserError(
            f"model folder {path} has no config.json (expected a local Hugging Face model folder; "
            "make one with: areal-hpc init-model --out DIR)"
        )
    return folder


def load_model(
    path: str | Path, dtype: str = "float32", attn_impl: str = "sdpa", device: torch.device | str = "cpu"
) -> PreTrainedModel:
    folder = _check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=DTYPES[dtype], attn_implementation=attn_impl, local_files_only=True
    )
    return model.to(device)


def load_critic(
    path: str | Path, dtype: str = "float32", attn_impl: str = "sdpa", device: torch.device | str = "cpu"
) -> PreTrainedModel:
    """A value model for PPO: the causal LM's body with a fresh one-output head per position (no dropout:
    values must be deterministic)."""
    folder = _check_model_dir(path)
    config = AutoConfig.from_pretrained(folder, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0  # set on the object: transformers drops it as a from_pretrained keyword
    model = AutoModelForTokenClassification.from_pretrained(
        folder, config=config, dtype=DTYPES[dtype], attn_implementation=attn_impl, local_files_only=True
    )
    return model.to(device)


LANGUAGE_HEAD = "language_head"


def attach_language_head(critic: PreTrainedModel, path: str | Path) -> None:
    """Give a critic (``load_critic``) of the causal LM in ``path`` that LM's output layer, as the submodule
    ``language_head``: tied to the input embeddings when the checkpoint ties them, else a trainable copy of
    its ``lm_head``. A reward model's language-model regulariser reads it; ``detach_language_head`` takes it
    off again before the critic is saved."""
    config = critic.config
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")  # weight set below
    embeddings = critic.get_input_embeddings().weight
    if getattr(config, "tie_word_embeddings", False):
        head.weight = embeddings
    else:
        head.weight = torch.nn.Parameter(_read_tensor(_check_model_dir(path), "lm_head.weight").to(embeddings))
    critic.add_module(LANGUAGE_HEAD, head)


def detach_language_head(model: torch.nn.Module) -> None:
    if hasattr(model, LANGUAGE_HEAD):
        delattr(model, LANGUAGE_HEAD)


def _read_tensor(folder: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint (one file or indexed shards), without reading the others."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"].get(name) if index.exists() else "model.safetensors"
    if file is not None and (folder / file).exists():
        with safe_open(folder / file, framework="pt") as tensors:
            if name in tensors.keys():  # noqa: SIM118 (a safetensors file handle has no __contains__)
                return tensors.get_tensor(name)
    raise CheckpointError(
        f"{folder}: the checkpoint has no tensor {name!r} (its config does not tie the output layer to the embeddings)"
    )


def load_tokenizer(path: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(_check_model_dir(path), local_files_only=True)
    if tokenizer.pad_token is None:  # Qwen checkpoints ship one; others may not
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_model(
    model: PreTrainedModel, tokenizer, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Save in Hugging Face format atomically: written beside the target, then renamed into place.
    ``state_dict`` replaces the model's own (full tensors of a model sharded over ranks)."""
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, state_dict=state_dict)
    tokenizer.save_pretrained(staging)
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def fuse_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the names a transformers 5 model holds them. Mixture-of-Experts
    checkpoints (and ``save_pretrained``) store every expert's gate/up/down projection on its own;
    the model holds them fused per layer: ``gate_up_proj`` [E, 2I, H], expert e's [gate; up], and
    ``down_proj`` [E, H, I]. Other tensors pass unchanged."""
    fused, experts = {}, defaultdict(dict)
    for name, tensor in state.items():
        match = EXPERT_KEY.match(name)
        if match:
            experts[match[1]][int(match[2]), match[3]] = tensor
        else:
            fused[name] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(expert for expert, _ in parts)
        lacking = [
            f"{prefix}.{e}.{p}.weight"
            for e in range(count)
            for p in ("gate_proj", "up_proj", "down_proj")
            if (e, p) not in parts
        ]
        if lacking:
            raise ValueError(f"the checkpoint lacks {lacking[0]} (and {len(lacking) - 1} more expert tensors)")
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
    return fused


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read (the server answers 400 with this message)."""


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint (one file or an indexed set of shards),
    under the names a loaded model holds them (``fuse_expert_weights``): nothing is filled in, so a
    missing tensor is seen (``from_pretrained`` would initialise it at random)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if not index.exists() and not (folder / "model.safetensors").exists():
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json "
            "(the embedded engine loads safetensors checkpoints)"
        )
    try:
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else ["model.safetensors"]
        )
        stored = {name: tensor for file in files for name, tensor in load_file(folder / file).items()}
        return fuse_expert_weights(stored)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise CheckpointError(f"could not read the checkpoint in {folder}: {type(exc).__name__}: {exc}") from exc
