"""``areal-hpc export``: a model folder our engines saved (both save whole Hugging Face folders, beside their
training state) as the consolidated folder the Hub ships: config, tokenizer, generation config, safetensors
shards of at most ``max_shard_bytes`` with their index, in one dtype, and nothing of the training state
(optimizer shards, schedule, RNG, driver state).

It streams: one output shard is in memory at a time, so a login node exports a model larger than its memory.
The folder is written aside, checked as the engines' loader checks a folder (every tensor the config's model
needs, in its shape), then renamed into place; an existing non-empty ``out`` is refused before anything is
written.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_hpc.errors import UserError
from areal_hpc.fsio import fsync_path, fsync_tree
from areal_hpc.models.hf import DTYPES, model_skeleton
from areal_hpc.models.hub_checkpoint import INDEX, SINGLE_FILE, HubCheckpoint

WEIGHT_FILES = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
TRAINING_FILES = ("training_state.pt", "rng.pt", "driver.json")  # an engine's, and a checkpoint's, own state
ADAPTERS = "adapter_config.json"  # a LoRA checkpoint: the adapters alone (engines.torch.lora)


@dataclass(frozen=True)
class ExportedModel:
    folder: Path
    tensors: int
    shards: int
    bytes: int


def refuse_non_empty(out: Path) -> None:
    """``UserError`` when ``out`` already holds something: an export never replaces a folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty folder; name a new or empty folder")


def export_model(source: Path, out: Path, dtype: str = "bfloat16", max_shard_bytes: int = 2 * 10**9) -> ExportedModel:
    """Write the model in ``source`` (a Hugging Face folder) to ``out`` in ``dtype``, as shards of at most
    ``max_shard_bytes`` (a tensor larger than that alone in its own)."""
    refuse_non_empty(out)
    if (source / ADAPTERS).exists() and not (source / "config.json").exists():
        raise UserError(
            f"{source} holds LoRA adapters only (saved with actor.lora); export the run's model/ folder, "
            "which holds the merged weights"
        )
    checkpoint = HubCheckpoint(source)
    critic = _is_critic(source)
    model_skeleton(checkpoint, critic=critic)  # the source is complete and shaped as its config says
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = _plan_shards(checkpoint, DTYPES[dtype].itemsize, max_shard_bytes)
    total = _write_shards(checkpoint, shards, staging, DTYPES[dtype])
    _copy_companions(source, staging, dtype)
    model_skeleton(HubCheckpoint(staging), critic=critic)  # what was written loads: every tensor, its shape
    fsync_tree(staging)
    staging.rename(out)  # onto an empty folder, or a new name
    fsync_path(out.parent)
    return ExportedModel(out, len(checkpoint.names), len(shards), total)


def _is_critic(source: Path) -> bool:
    architectures = json.loads((source / "config.json").read_text()).get("architectures") or []
    return any(name.endswith("ForTokenClassification") for name in architectures)


def _plan_shards(checkpoint: HubCheckpoint, itemsize: int, limit: int) -> list[list[str]]:
    """The tensors' names (in the checkpoint's order) grouped into shards of at most ``limit`` bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in checkpoint.names:
        nbytes = itemsize * int(torch.Size(checkpoint.shape(name)).numel())
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shards(checkpoint: HubCheckpoint, shards: list[list[str]], folder: Path, dtype: torch.dtype) -> int:
    """Each shard's tensors in ``dtype`` (read one shard at a time), and the index when there are several
    (Hugging Face's names: ``model.safetensors`` alone, else ``model-00001-of-0000N.safetensors``); the bytes."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for number, names in enumerate(shards, 1):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: checkpoint.read(name).to(dtype).contiguous() for name in names}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total


def _copy_companions(source: Path, folder: Path, dtype: str) -> None:
    """The source's other files (config, tokenizer, chat template, generation config...), its weights, training
    state and folders (the optimizer's) left out; config.json says ``dtype``; a generation config made from
    the model's config when the source has none."""
    from transformers import AutoConfig, GenerationConfig

    for path in sorted(source.iterdir()):
        name = path.name
        if path.is_file() and not (WEIGHT_FILES.match(name) or name == INDEX or name in TRAINING_FILES):
            shutil.copy2(path, folder / name)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)  # transformers 4's name for it
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (folder / "generation_config.json").exists():
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
