"""Checkpoints as the Hub ships them (bf16 safetensors shards and their index), read tensor by tensor and slice
by slice (``models.hub_checkpoint``), and the faults a user can bring, each one line naming the file, before
anything is built or written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_hpc.cli import main
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_model, model_skeleton
from areal_hpc.models.hub_checkpoint import INDEX, HubCheckpoint
from tests.conftest import small_llama


def hub_form(model: torch.nn.Module, folder: Path, max_shard_size: str = "64KB") -> Path:
    """``model`` saved as the Hub ships checkpoints: bf16 on disk, in safetensors shards with their index."""
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


@pytest.fixture(scope="module")
def hub_llama(tmp_path_factory) -> Path:
    return hub_form(small_llama(256, 16384, 8192, tied=False), tmp_path_factory.mktemp("hub") / "llama")


def test_slices_read_only_their_bytes_and_experts_fuse_as_the_model_holds_them(hub_llama, tiny_moe_dir):
    checkpoint = HubCheckpoint(hub_llama)
    assert len(_shards(hub_llama)) >= 3
    name = "model.layers.1.mlp.down_proj.weight"
    full = checkpoint.read(name)
    before = checkpoint.bytes_read
    part = checkpoint.read(name, (slice(10, 20), slice(64, 128)))
    assert torch.equal(part, full[10:20, 64:128]) and part.dtype == torch.bfloat16
    assert checkpoint.bytes_read - before == 10 * 64 * 2

    experts, stored = load_model(tiny_moe_dir).model.layers[0].mlp.experts, HubCheckpoint(tiny_moe_dir)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored.names  # saved one tensor per expert and projection
    assert stored.shape("model.layers.0.mlp.experts.gate_up_proj") == tuple(experts.gate_up_proj.shape)
    torch.testing.assert_close(
        stored.read("model.layers.0.mlp.experts.gate_up_proj", (slice(1, 3),)),
        experts.gate_up_proj[1:3],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(stored.read("model.layers.0.mlp.experts.down_proj"), experts.down_proj, rtol=0, atol=0)


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))


def _without_a_shard(folder: Path) -> str:
    (folder / _shards(folder)[1]).unlink()
    return f"{folder / INDEX}: names the shard {_shards(folder)[1]}, which {folder} lacks"


def _without_a_tensor(folder: Path) -> str:
    name = "model.layers.0.self_attn.o_proj.weight"
    index = json.loads((folder / INDEX).read_text())
    shard = folder / index["weight_map"].pop(name)
    save_file({k: v for k, v in load_file(shard).items() if k != name}, shard, metadata={"format": "pt"})
    (folder / INDEX).write_text(json.dumps(index))
    return f"{folder / INDEX}: no tensor '{name}', which the model needs"


def _misplaced_in_the_index(folder: Path) -> str:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = _shards(folder)[0]
    (folder / INDEX).write_text(json.dumps(index))
    return f"{folder / _shards(folder)[0]}: has no tensor 'model.norm.weight', which {INDEX} places there"


def _shaped_unlike_the_config(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    file = json.loads((folder / INDEX).read_text())["weight_map"]["model.layers.0.mlp.gate_proj.weight"]
    return (
        f"{folder / file}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], the model's config "
        f"({folder / 'config.json'}) makes it [96, 64]"
    )


def _unknown_model_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "lama"
    (folder / "config.json").write_text(json.dumps(config))
    return f"{folder / 'config.json'}: model_type 'lama' is not a model transformers"


FAULTS = [_without_a_shard, _without_a_tensor, _misplaced_in_the_index, _shaped_unlike_the_config, _unknown_model_type]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda fault: fault.__name__.strip("_"))
def test_a_faulty_checkpoint_is_one_line_naming_its_file_and_nothing_is_written(fault, hub_llama, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hub_llama, folder)
    message = fault(folder)
    with pytest.raises(UserError) as raised:  # what an engine building from it meets
        model_skeleton(HubCheckpoint(folder))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
