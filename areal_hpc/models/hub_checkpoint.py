"""A Hugging Face checkpoint folder as the Hub ships it (``model.safetensors``, or shards listed by
``model.safetensors.index.json``) read tensor by tensor and slice by slice (``safe_open`` + ``get_slice``):
opening it reads the shards' headers only, so a training rank reads just the parts of the tensors it keeps.

Every fault a user can bring is one ``CheckpointError`` line naming the file: a shard the index names but the
folder lacks, a tensor the index places in a shard that does not hold it, an unreadable shard, and (``check``)
a tensor the model needs that no file holds, or one shaped unlike the model's config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from areal_hpc.errors import UserError

INDEX, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # how transformers 5 holds MoE experts
Index = tuple[slice, ...]  # a part of a tensor: one slice per leading dimension


class CheckpointError(UserError, ValueError):
    """A checkpoint folder that cannot be read (one line naming the file; the rollout server answers 400 with it)."""


class HubCheckpoint:
    """The safetensors tensors of ``folder``: their names, stored shapes and files, read on demand.
    ``bytes_read`` counts what ``read`` returned (what a rank's loading cost it)."""

    def __init__(self, folder: str | Path):
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        self.bytes_read = 0
        index = self.folder / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        elif (self.folder / SINGLE_FILE).exists():
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.folder} has no {SINGLE_FILE} or {INDEX} (the embedded engine loads safetensors checkpoints)"
            )
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            path = self.folder / file
            if not path.is_file():
                raise CheckpointError(f"{index}: names the shard {file}, which {self.folder} lacks")
            try:
                with safe_open(path, framework="pt") as tensors:
                    for name in tensors.keys():  # noqa: SIM118 (a safetensors file handle has no __iter__)
                        self.file_of[name], self.shapes[name] = file, tuple(tensors.get_slice(name).get_shape())
            except SafetensorError as exc:
                raise CheckpointError(
                    f"could not read the checkpoint in {self.folder}: SafetensorError: {file}: {exc}"
                ) from None
        for name, file in (weight_map or {}).items():
            if self.file_of.get(name) != file:
                raise CheckpointError(f"{self.folder / file}: has no tensor {name!r}, which {INDEX} places there")

    @property
    def names(self) -> list[str]:
        """The stored tensors' names, in file order."""
        return list(self.file_of)

    def index_file(self) -> Path:
        """The file that says where each tensor is: the index, or the one safetensors file."""
        return self.folder / (INDEX if (self.folder / INDEX).exists() else SINGLE_FILE)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes or self._experts(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``; a fused expert weight's from its experts' tensors."""
        if name in self.shapes:
            return self.shapes[name]
        experts = self._experts(name)
        if experts is None:
            raise KeyError(name)
        parts = [[self.shapes[n] for n in names] for names in experts]
        return (len(parts), sum(shape[0] for shape in parts[0]), *parts[0][0][1:])

    def read(self, name: str, index: Index | None = None) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype, or the part ``index`` of it (only that part is read). A
        fused expert weight the folder stores expert by expert (as ``save_pretrained`` does) is made of the
        indexed experts' tensors."""
        from safetensors import safe_open

        if name not in self.shapes:
            return self._read_fused(name, index)
        with safe_open(self.folder / self.file_of[name], framework="pt") as tensors:
            part = tensors.get_slice(name)[index] if index else tensors.get_tensor(name)
        self.bytes_read += part.numel() * part.element_size()
        return part

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stored (name, tensor), one at a time, in file order."""
        for name in self.file_of:
            yield name, self.read(name)

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """``CheckpointError`` for the first tensor of ``expected`` ({name: shape the model's config makes it})
        that the folder lacks or stores in another shape."""
        for name, shape in expected.items():
            if name not in self:
                raise CheckpointError(f"{self.index_file()}: no tensor {name!r}, which the model needs")
            if tuple(self.shape(name)) != tuple(shape):
                stored_as = name if name in self.file_of else (self._experts(name) or [[name]])[0][0]  # experts' 1st
                file = self.folder / self.file_of[stored_as]
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {list(self.shape(name))}, the model's config "
                    f"({self.folder / 'config.json'}) makes it {list(shape)}"
                )

    def _experts(self, name: str) -> list[list[str]] | None:
        """A fused expert weight's stored names, expert by expert ([gate, up] or [down]); None when ``name``
        is not one or an expert's tensor is missing."""
        match = FUSED_EXPERTS.match(name)
        if not match:
            return None
        prefix, projections = match[1], ("gate_proj", "up_proj") if match[2] == "gate_up_proj" else ("down_proj",)
        count = sum(1 for n in self.shapes if n.startswith(f"{prefix}.") and n.endswith(f".{projections[0]}.weight"))
        experts = [[f"{prefix}.{e}.{p}.weight" for p in projections] for e in range(count)]
        return experts if count and all(n in self.shapes for names in experts for n in names) else None

    def _read_fused(self, name: str, index: Index | None) -> torch.Tensor:
        experts = self._experts(name)
        if experts is None:
            raise KeyError(name)
        chosen = range(len(experts))[index[0]] if index else range(len(experts))
        fused = torch.stack([torch.cat([self.read(n) for n in experts[e]]) for e in chosen])
        return fused[(slice(None), *index[1:])] if index else fused
