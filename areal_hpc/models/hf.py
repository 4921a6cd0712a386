"""Load Hugging Face causal LMs (the tiny model, Qwen2/2.5/3, Llama 3 checkpoints) from local folders only:
whole (``load_model``, ``load_critic``), or as a ``model_skeleton`` on the meta device whose weights each
training rank then reads in part (``models.hub_checkpoint``)."""

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

from areal_hpc.errors import UserError, closest
from areal_hpc.models.hub_checkpoint import CheckpointError, HubCheckpoint

# Nothing is ever fetched from a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf_logging.disable_progress_bar()  # per-shard progress bars are noise next to our own progress display

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _check_model_dir(path: str | Path) -> Path:
    """``path`` as a folder whose config.json names a model type transformers builds (else one line)."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(
            f"model folder {path} has no config.json (expected a local Hugging Face model folder; "
            "make one with: areal-hpc init-model --out DIR)"
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except ValueError as exc:
        raise UserError(f"{config}: not JSON ({exc})") from None
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(
            f"{config}: model_type {model_type!r} is not a model transformers {__version__} builds"
            f"{closest(str(model_type), CONFIG_MAPPING_NAMES)}"
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
    model = AutoModelForTokenClassification.from_pretrained(
        folder, config=_critic_config(folder), dtype=DTYPES[dtype], attn_implementation=attn_impl, local_files_only=True
    )
    return model.to(device)


def _critic_config(folder: Path):
    config = AutoConfig.from_pretrained(folder, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0  # set on the object: transformers drops it as a from_pretrained keyword
    return config


def model_skeleton(
    checkpoint: HubCheckpoint, dtype: str = "float32", attn_impl: str = "sdpa", *, critic: bool = False
) -> PreTrainedModel:
    """The model ``load_model`` (``critic``: ``load_critic``) would load from ``checkpoint``'s folder, built on
    the meta device: no weight is read or allocated; its non-persistent buffers (rotary frequencies) and a
    critic's fresh head (when the folder has none: the same draws as ``load_critic``'s) are real. Raises
    ``CheckpointError`` when the folder lacks a tensor the model needs or stores one in another shape."""
    folder = _check_model_dir(checkpoint.folder)
    config = _critic_config(folder) if critic else AutoConfig.from_pretrained(folder, local_files_only=True)
    kind = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    with torch.device("meta"):
        model = kind.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn_impl)
    for module in model.modules():  # transformers computes non-persistent buffers in _init_weights
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        if meta:
            model._init_weights(module)
    if critic and "score.weight" not in checkpoint:
        fresh = fresh_value_head(config)
        model.score.weight = torch.nn.Parameter(fresh["score.weight"].to(DTYPES[dtype]))
        model.score.bias = torch.nn.Parameter(fresh["score.bias"].to(DTYPES[dtype]))
    checkpoint.check(
        {stored_name(model, checkpoint, name): t.shape for name, t in model.state_dict().items() if t.is_meta}
    )
    return model


def fresh_value_head(hf_config) -> dict[str, torch.Tensor]:
    """HF's ``score`` weights as ``load_critic`` initialises them when the folder has none (the same
    draws from the default generator: the critic's initialisation depends on the seed only)."""
    with torch.device("meta"):
        skeleton = AutoModelForTokenClassification.from_config(hf_config)
    head = torch.nn.Linear(hf_config.hidden_size, 1, device="meta").to_empty(device="cpu")  # no draws
    skeleton._init_weights(head)
    return {"score.weight": head.weight.detach(), "score.bias": head.bias.detach()}


LANGUAGE_HEAD = "language_head"


def stored_name(model: torch.nn.Module, checkpoint: HubCheckpoint, name: str) -> str:
    """The checkpoint's name of ``model``'s state-dict entry ``name``: the reward model's language head is
    the causal LM's head, and a head tied to the embeddings that the folder stores once is the embedding."""
    if name == f"{LANGUAGE_HEAD}.weight":
        name = "lm_head.weight"
    if name == "lm_head.weight" and name not in checkpoint and getattr(model.config, "tie_word_embeddings", False):
        return f"{model.base_model_prefix}.embed_tokens.weight"
    return name


def attach_language_head(critic: PreTrainedModel, path: str | Path) -> None:
    """Give a critic (``load_critic``) of the causal LM in ``path`` that LM's output layer, as the submodule
    ``language_head``: tied to the input embeddings when the checkpoint ties them, else a trainable copy of
    its ``lm_head`` (left on the meta device, to be read with the rest, on a ``model_skeleton``). A reward
    model's language-model regulariser reads it; ``detach_language_head`` takes it off again before the
    critic is saved."""
    config = critic.config
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")  # weight set below
    embeddings = critic.get_input_embeddings().weight
    if getattr(config, "tie_word_embeddings", False):
        head.weight = embeddings
    else:
        checkpoint = HubCheckpoint(_check_model_dir(path))
        if "lm_head.weight" not in checkpoint:
            raise CheckpointError(
                f"{checkpoint.folder}: the checkpoint has no tensor 'lm_head.weight' (its config does not tie the "
                "output layer to the embeddings)"
            )
        weight = head.weight if embeddings.is_meta else checkpoint.read("lm_head.weight")
        head.weight = torch.nn.Parameter(weight.to(embeddings))
    critic.add_module(LANGUAGE_HEAD, head)


def detach_language_head(model: torch.nn.Module) -> None:
    if hasattr(model, LANGUAGE_HEAD):
        delattr(model, LANGUAGE_HEAD)


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


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint (one file or an indexed set of shards),
    under the names a loaded model holds them (``fuse_expert_weights``): nothing is filled in, so a
    missing tensor is seen (``from_pretrained`` would initialise it at random)."""
    checkpoint = HubCheckpoint(path)
    try:
        return fuse_expert_weights(dict(checkpoint.tensors()))
    except ValueError as exc:
        raise CheckpointError(f"could not read the checkpoint in {checkpoint.folder}: {exc}") from exc
