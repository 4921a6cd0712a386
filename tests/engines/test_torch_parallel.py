"""The PyTorch-native engine on real gloo ranks: one optimizer step of a PPO-like weighted loss in
each supported layout (replicated dp, FSDP2, TP and their products, with a replica whose share is
empty) equals the same step in one process (logprobs, loss, gradient norm, updated weights), and a
checkpoint saved in one layout loads into another. Layouts not built are one ``UserError``."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.engines.torch.parallelize import check_layout
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import fuse_expert_weights, load_model, load_tokenizer, save_model
from tests.models.test_export import assert_exports_as_trained
from tests.native_ranks import LOGITS_IN_CHUNKS, reference_run, seeded_batch
from tests.trainer_processes import run_ranks as run_trainer_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def run_ranks(world: int, model_dir, out, *options: str) -> dict:
    """``world`` ranks of ``tests.native_ranks`` on loopback; what rank 0 wrote."""
    return run_trainer_ranks(world, model_dir, out, *options, timeout=120, module="tests.native_ranks")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:
    return reference_run(tiny_model_dir)


@pytest.fixture(scope="module")
def references():
    """``references(model_dir)``: a model's one-process step, run once a module however many layouts compare."""
    return functools.cache(reference_run)


@pytest.mark.parametrize(
    "world, options",
    [(2, ["dp=2", "ep=2"]), (4, ["dp=2", "cp=2", "ep=2"]), (4, ["dp=2", "ep=2", "pp=2"])],
    ids=["ep2", "cp2_ep2_edp2", "ep2_pp2"],
)
def test_moe_step_with_expert_parallelism_equals_one_process(world, options, tiny_moe_dir, references, tmp_path):
    assert_same_step(run_ranks(world, tiny_moe_dir, tmp_path / "out.pt", *options), references(tiny_moe_dir))


def test_moe_step_where_no_token_chooses_one_ranks_experts(tiny_moe_dir, tmp_path):
    """A zero router ties every expert, and top-2 takes experts 0 and 1: the ep rank holding 2 and 3
    receives no rows, yet its backward must join both exchanges' (it used to wait forever)."""
    model = load_model(tiny_moe_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    folder = tmp_path / "tied_router"
    save_model(model, load_tokenizer(tiny_moe_dir), folder)
    assert_same_step(run_ranks(2, folder, tmp_path / "out.pt", "dp=2", "ep=2"), reference_run(folder))


def test_moe_ep2_checkpoint_restores_the_step_and_holds_every_expert(tiny_moe_dir, references, tmp_path):
    folder = tmp_path / "checkpoint"
    got = run_ranks(2, tiny_moe_dir, tmp_path / "saved.pt", "dp=2", "ep=2", f"save={folder}")
    assert got["ranks"][0]["restored_step_diff"] == 0.0  # expert shards, Adam moments and schedule restored
    saved = load_model(folder).state_dict()  # one Hugging Face folder with all four experts of each layer
    for name, tensor in references(tiny_moe_dir)["weights"].items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    stored = load_file(folder / "model.safetensors")  # one tensor per expert and projection, as HF stores them
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored
    fused = fuse_expert_weights(stored)  # what the engine loads, against transformers' own loading
    assert fused.keys() == saved.keys() and all(torch.equal(fused[k], saved[k]) for k in saved)


def assert_same_step(got: dict, reference: dict) -> None:
    ranks = got["ranks"]
    for name, expected in reference["outputs"].items():
        seen = [None] * len(seeded_batch())
        for rank in ranks:  # every rank has all of its share's outputs
            for i, values in zip(rank["indices"], rank["outputs"].get(name, [])):
                torch.testing.assert_close(values, expected[i], rtol=1e-5, atol=1e-5, msg=name)
                seen[i] = values
        assert all(values is not None for values in seen), name
    replicas = [rank["stats"] for rank in ranks if rank["leads"]]
    assert sum(s.get("loss", 0.0) for s in replicas) == pytest.approx(reference["stats"]["loss"], rel=1e-5)
    assert sum(s.get("loss_tokens", 0.0) for s in replicas) == reference["stats"]["loss_tokens"]
    for rank in ranks:  # summed over ranks, not averaged: the same norm as one process's
        assert rank["stats"]["grad_norm"] == pytest.approx(reference["stats"]["grad_norm"], rel=1e-5)
    assert list(got["weights"]) == list(reference["weights"])  # Hugging Face names, tied head included
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


LAYOUTS = {  # name: (processes, options)
    "dp2": (2, ["dp=2"]),
    "fsdp2_empty_share_logits_in_chunks": (2, ["dp=2", "fsdp=1", "empty=1", LOGITS_IN_CHUNKS]),
    "tp2": (2, ["tp=2"]),
    "tp2_dp2": (4, ["tp=2", "dp=2"]),
    "pp2": (2, ["pp=2"]),
    "pp4": (4, ["pp=4"]),  # middle stages: both neighbours, 1F1B warm-up of 3
    "tp2_pp2": (4, ["tp=2", "pp=2"]),
    "pp2_fsdp2_empty_share": (4, ["pp=2", "dp=2", "fsdp=1", "empty=1"]),
    "cp2": (2, ["cp=2"]),
    "cp2_fsdp2_empty_share": (4, ["cp=2", "dp=2", "fsdp=1", "empty=1"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_step_equals_one_process(layout, tiny_model_dir, reference, tmp_path):
    world, options = LAYOUTS[layout]
    assert_same_step(run_ranks(world, tiny_model_dir, tmp_path / "out.pt", *options), reference)


@pytest.mark.parametrize(
    "family, layout",
    [
        ("llama", "dp2"),
        ("llama", "tp2"),
        ("llama", "pp2"),
        ("llama", "fsdp2_empty_share_logits_in_chunks"),
        ("qwen3-replica", "dp2"),
        ("qwen3-replica", "tp2"),
        ("qwen3-replica", "pp2"),
        ("qwen3-replica", "fsdp2_empty_share_logits_in_chunks"),
        ("gemma3", "dp2"),
        ("gemma3", "tp2"),
        ("gemma3-replica", "cp2_fsdp2_empty_share"),
        ("gemma3-replica", "pp2"),
    ],
)
def test_another_familys_step_equals_one_process(family, layout, request, preset_dir, references, tmp_path):
    """Llama 3's structure (its own attention and RoPE scaling, an untied head), Qwen3's (q/k norms per head,
    whose gradients tp ranks sum over their heads) and Gemma 3's (sliding-window layers shorter than the
    batch's longer sequences: 16 tokens in the replica; 6 in ``small_gemma3``, with softcapped logits and two
    key/value heads for tp) through the same layouts. The replica's second pipeline stage holds layers 3-5, the
    last of them its one global layer, which takes its own RoPE base only if the stage numbers it 5 as the model
    does (a stage that counted from 0 gave it the sliding layers' table, and other logprobs)."""
    fixtures = {"llama": "tiny_llama_dir", "gemma3": "tiny_gemma3_dir"}
    model_dir = request.getfixturevalue(fixtures[family]) if family in fixtures else preset_dir(family)
    world, options = LAYOUTS[layout]
    got = run_ranks(world, model_dir, tmp_path / "out.pt", *options)
    assert_same_step(got, references(model_dir))


GROUPS = {  # training groups of different shapes (dp.tp.pp each), in one job
    "fsdp2_x_tp2_and_one": (5, ["groups=2.2.1/1.1.1", "fsdp=1"]),  # 2-D DTensor gradients against plain ones
    # the tied head (one stage's copy, the other group's one tensor); buckets smaller than the embedding
    "pp2_and_one_small_buckets": (3, ["groups=1.1.2/1.1.1", "bucket=20000"]),
    "dp2_and_pp2": (4, ["groups=2.1.1/1.1.2"]),  # the second group's stages sum the tied head's gradients
    "fsdp2_and_tp2_empty_share": (4, ["groups=2.1.1/1.2.1", "fsdp=1", "empty=1"]),
}


def assert_every_rank_holds(got: dict, weights: dict) -> None:
    for rank in got["ranks"]:
        for name, tensor in rank["held"].items():
            torch.testing.assert_close(tensor, weights[name], rtol=1e-5, atol=1e-6, msg=(rank["group"], name))


@pytest.mark.parametrize("layout", GROUPS)
def test_groups_of_different_shapes_step_as_one_process(layout, tiny_model_dir, reference, tmp_path):
    world, options = GROUPS[layout]
    got = run_ranks(world, tiny_model_dir, tmp_path / "out.pt", *options)
    assert_same_step(got, reference)  # group 0's weights, every rank's norm, every replica's share
    assert {rank["group"] for rank in got["ranks"]} == {0, 1}
    assert_every_rank_holds(got, reference["weights"])  # and the other group trained the same step


def test_groups_checkpoint_made_by_group_0_restores_every_group(tiny_model_dir, reference, tmp_path):
    folder = tmp_path / "checkpoint"
    got = run_ranks(4, tiny_model_dir, tmp_path / "saved.pt", "groups=1.2.1/2.1.1", f"save={folder}")
    assert_same_step(got, reference)
    # group 1 (dp2) loads the optimizer state group 0 (tp2) saved, and takes the same next step
    assert [rank["restored_step_diff"] for rank in got["ranks"]] == [0.0] * 4


@pytest.mark.parametrize("world, options", [(4, ["tp=2", "dp=2", "fsdp=1"]), (2, ["pp=2"])], ids=["tp2_fsdp2", "pp2"])
def test_critic_step_equals_one_process(world, options, tiny_model_dir, tmp_path):
    got = run_ranks(world, tiny_model_dir, tmp_path / "out.pt", *options, "critic=1")
    assert_same_step(got, reference_run(tiny_model_dir, critic=True))


def test_tp2_fsdp2_checkpoint_restores_the_step_and_loads_into_other_layouts(tiny_model_dir, reference, tmp_path):
    folder = tmp_path / "checkpoint"
    got = run_ranks(4, tiny_model_dir, tmp_path / "saved.pt", "tp=2", "dp=2", "fsdp=1", "empty=1", f"save={folder}")
    assert_same_step(got, reference)
    assert got["ranks"][0]["restored_step_diff"] == 0.0  # weights, Adam moments and schedule all restored
    saved = load_file(folder / "model.safetensors")
    plain = load_model(folder).state_dict()  # a complete Hugging Face folder
    for name, tensor in saved.items():
        assert torch.equal(tensor, got["weights"][name]) and torch.equal(plain[name], tensor), name
    for options in (["dp=2"], ["tp=2"], ["pp=2"]):  # re-sharded into other layouts
        loaded = run_ranks(2, tiny_model_dir, tmp_path / "loaded.pt", *options, f"load={folder}")["weights"]
        assert list(loaded) == list(reference["weights"])
        for name, tensor in loaded.items():
            assert torch.equal(tensor, plain[name]), (options, name)
    assert_exports_as_trained(folder, got["weights"], tmp_path)  # `areal-hpc export` of it: plain transformers


def test_pp2_checkpoint_restores_the_step(tiny_model_dir, reference, tmp_path):
    folder = tmp_path / "checkpoint"
    got = run_ranks(2, tiny_model_dir, tmp_path / "saved.pt", "pp=2", f"save={folder}")
    assert_same_step(got, reference)
    assert got["ranks"][0]["restored_step_diff"] == 0.0
    saved = load_model(folder).state_dict()  # the stages' layers, embeddings and head in one folder
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # A folder that stores the tied head once (save_pretrained's way): the last stage's head is the embedding.
    loaded = run_ranks(2, tiny_model_dir, tmp_path / "loaded.pt", "pp=2", f"load={tiny_model_dir}")["weights"]
    initial = load_model(tiny_model_dir).state_dict()
    assert all(torch.equal(loaded[name], initial[name]) for name in initial)
    assert_exports_as_trained(folder, got["weights"], tmp_path)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(pp=3), "pp=3 must divide the model's num_hidden_layers=4"),
        (dict(tp=3), "tp=3 must divide the model's num_attention_heads=4"),
        (dict(dp=2, distributed_optimizer=True), "does not build actor.parallel.distributed_optimizer=true"),
        (dict(pp=2, vpp=2), "does not build actor.parallel.vpp=2"),
    ],
)
def test_layouts_not_built_are_one_user_error(sizes, message, tiny_model_dir):
    config = load_model(tiny_model_dir).config
    with pytest.raises(UserError, match=message):
        check_layout(ParallelDims(**sizes), config)
