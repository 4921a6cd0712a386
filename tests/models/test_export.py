"""``areal-hpc export``: a model our engines saved (or a run's newest) as the folder the Hub ships, in the dtype
asked, sharded, without training state, loadable by plain transformers; and the bad inputs, one line and
exit 2 with nothing written. ``assert_exports_as_trained`` is what the engines' checkpoint tests run on the
folders they save (torch at tp2 x fsdp2 and pp2, Megatron at tp2 x dp2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.cli import main
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs
from areal_hpc.models.hf import load_tokenizer, model_skeleton
from areal_hpc.models.hub_checkpoint import INDEX, HubCheckpoint
from areal_hpc.models.replicas import REPLICA_TEMPLATES
from areal_hpc.models.tiny import init_model
from areal_hpc.runtime.run_state import model_to_export
from tests.native_ranks import seeded_batch


def engine_save(model_dir: Path, folder: Path) -> Path:
    """A copy of ``model_dir`` with what an engine's save puts beside the model: its training state and optimizer
    shards (and a checkpoint's RNG and driver state)."""
    shutil.copytree(model_dir, folder)
    for name in ("training_state.pt", "rng.pt", "driver.json"):
        (folder / name).write_text("{}")
    (folder / "optimizer").mkdir()
    (folder / "optimizer" / "rank0.pt").write_text("")
    return folder


def test_export_writes_hub_shards_in_the_dtype_asked_and_leaves_training_state_out(tiny_model_dir, tmp_path, capsys):
    source = engine_save(tiny_model_dir, tmp_path / "actor")
    out = tmp_path / "hf"
    out.mkdir()  # an empty folder may be named
    assert main(["export", str(source), "--out", str(out), "--max-shard-size", "400KB"]) == 0
    assert capsys.readouterr().out.startswith(f"exported {source} to {out}: 50 tensors in bfloat16")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(json.loads((out / INDEX).read_text())["weight_map"].values()) == set(shards)
    assert {p.name for p in out.iterdir()} == {*shards, INDEX, *(p.name for p in tiny_model_dir.iterdir())} - {
        "model.safetensors"
    }
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(out)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16)
    assert exported.dtype == torch.bfloat16
    assert all(torch.equal(t, trained.state_dict()[k]) for k, t in exported.state_dict().items())
    assert load_tokenizer(out)("12+34=46").input_ids == load_tokenizer(tiny_model_dir)("12+34=46").input_ids


@pytest.mark.parametrize("preset", list(REPLICA_TEMPLATES))
def test_each_replica_saved_by_the_engine_exports_with_its_template_and_logits(preset, tmp_path):
    """Qwen3, Llama 3 and Gemma 3 replicas: what the torch engine saves exports to a folder plain transformers
    loads with the engine's weights and log-probabilities, and the family's chat template."""
    source = init_model(tmp_path / "model", corpus_for_tokenizer(0), preset=preset)
    checkpoint = HubCheckpoint(source)
    engine = TorchTrainEngine.on_checkpoint(
        model_skeleton(checkpoint), checkpoint, PolicyOutputs(), torch.device("cpu"), tokenizer=load_tokenizer(source)
    )
    engine.save(tmp_path / "saved", optimizer=False)
    weights = {name: tensor for bucket in engine.rollout_weights(1 << 30) for name, tensor in bucket}
    assert_exports_as_trained(tmp_path / "saved", weights, tmp_path)
    assert load_tokenizer(tmp_path / "exported").chat_template == load_tokenizer(source).chat_template


def test_a_run_folder_exports_its_newest_model(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    older, newer = run / "checkpoints" / "step000002" / "actor", run / "checkpoints" / "step000004" / "actor"
    for age, folder in enumerate([older, newer, run / "model"]):
        shutil.copytree(tiny_model_dir, folder)
        for file in folder.iterdir():
            os.utime(file, (1000.0 + age, 1000.0 + age))
    (run / "checkpoints" / "step000006.partial").mkdir()  # a save cut short
    assert model_to_export(run) == run / "model"  # the finished run's model
    shutil.rmtree(run / "model")
    assert model_to_export(run) == newer  # an unfinished run's latest checkpoint
    assert model_to_export(newer.parent) == newer  # a checkpoint: its actor
    assert model_to_export(older) == older
    sft = tmp_path / "sft" / "checkpoints" / "step350"  # an SFT checkpoint is the model folder itself
    shutil.copytree(tiny_model_dir, sft)
    assert model_to_export(sft.parent.parent) == sft


@pytest.mark.parametrize("case", ["missing", "not_empty", "lora_only", "no_model"])
def test_bad_inputs_are_one_line_and_exit_2_with_nothing_written(case, tiny_model_dir, tmp_path, capsys):
    source, out = tiny_model_dir, tmp_path / "out"
    if case == "missing":
        source, expected = tmp_path / "nowhere", f"{tmp_path / 'nowhere'} does not exist"
    elif case == "not_empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        expected = f"--out {out} already exists and is not an empty folder"
    elif case == "lora_only":
        source = tmp_path / "actor"
        source.mkdir()
        (source / "adapter_config.json").write_text("{}")
        expected = f"{source} holds LoRA adapters only"
    else:
        source, expected = tmp_path, f"{tmp_path} holds no model"
    assert main(["export", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    if case == "not_empty":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    else:
        assert not out.exists()
    assert not (tmp_path / "out.partial").exists()


def assert_exports_as_trained(folder: Path, weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Export the checkpoint ``folder`` (float32) and load it with plain transformers: it holds exactly the engine's
    ``weights`` (its pushed weights after the step), and its log-probabilities of seeded sequences' tokens equal
    the torch engine's on that checkpoint (packed micro-batches against one forward per sequence: 1e-5)."""
    out = tmp_path / "exported"
    assert main(["export", str(folder), "--out", str(out), "--dtype", "float32"]) == 0
    assert not {"training_state.pt", "optimizer"} & {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], t) for k, t in weights.items())
    checkpoint = HubCheckpoint(folder)
    engine = TorchTrainEngine.on_checkpoint(
        model_skeleton(checkpoint), checkpoint, PolicyOutputs(), torch.device("cpu")
    )
    batch = seeded_batch(n=3)
    ours = engine.forward(batch)["logprobs"]
    with torch.no_grad():
        for tokens, mask, logprobs in zip(batch.sequences, batch.loss_masks, ours):
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
            want = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            targets = torch.tensor(mask[1:], dtype=torch.bool)  # position t predicts the completion's token t+1
            assert targets.any()
            torch.testing.assert_close(logprobs[:-1][targets], want[targets], rtol=1e-5, atol=1e-5)
