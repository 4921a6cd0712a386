"""The Megatron-core engine on a Qwen3-MoE (``tiny_moe_dir``: 4 experts, top 2, two layers) against
independent implementations, on real gloo ranks: in one process and with the experts split over two
expert-parallel ranks (dp=2 ep=2), its logprobs equal the Hugging Face model's (the torch engine's
forward) and one step of a PPO-like loss equals the torch engine's in one process (loss, gradient
norm, updated weights under HF names), also with two replicas of each expert (dp=4 ep=2), with pp2,
and when one rank's experts receive no token; an ep2 checkpoint with an empty share restores the
step and loads into one process; HF -> Megatron shards (TP, PP and EP) -> HF is exact for random
shapes; MoE layouts the engine does not build are one ``UserError``.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from areal_hpc.engines.megatron.convert import ModelShape, hf_to_megatron, is_expert, stage_names, stage_to_hf
from areal_hpc.engines.megatron.engine import check_layout
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import load_model
from tests.engines.test_megatron import assert_checkpoint_round_trip, in_reference_order, run_ranks
from tests.engines.test_torch_parallel import assert_same_step
from tests.native_ranks import reference_run


@pytest.fixture(scope="module")
def moe_reference(tiny_moe_dir) -> dict:
    return reference_run(tiny_moe_dir)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "world, options",
    [(1, ()), (2, ("dp=2", "ep=2")), (4, ("dp=4", "ep=2")), (2, ("dp=2", "fsdp=1")), (2, ("cp=2", "ep=2"))],
    ids=["one_process", "ep2", "ep2_edp2", "fsdp2", "cp2_ep2"],
)
def test_moe_step_equals_the_torch_engine_in_one_process(world, options, tiny_moe_dir, moe_reference, tmp_path):
    """Router (softmax, top 2, renormalised), experts and the tokens' exchange between expert-parallel
    ranks: logprobs, loss, gradient norm (each expert counted once) and updated weights; with dp=4
    each expert has two replicas, whose gradients DDP sums over the expert-data-parallel ranks; with
    fsdp2 (no ep) the experts are sharded by FSDP like every other layer's weights; with cp2 x ep2 the
    two context ranks' (padded, zig-zag) tokens meet their experts across the expert-parallel pair."""
    got = run_ranks(world, tiny_moe_dir, tmp_path / "out.pt", *options)
    assert_same_step(in_reference_order(got, moe_reference), moe_reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_with_an_empty_share_restores_its_checkpoint_and_loads_into_one_process(
    tiny_moe_dir, moe_reference, tmp_path
):
    """dp rank 1 trains on nothing (it runs idle passes for its expert-parallel peer); the checkpoint
    restores weights, Adam moments and schedule, holds every expert of both ranks in one HF folder,
    and its weights load into one process."""
    folder = tmp_path / "checkpoint"
    got = run_ranks(2, tiny_moe_dir, tmp_path / "saved.pt", "dp=2", "ep=2", "empty=1", f"save={folder}")
    assert_same_step(in_reference_order(got, moe_reference), moe_reference)
    assert_checkpoint_round_trip(got, folder, tiny_moe_dir, tmp_path, 1)


def random_moe_model(experts: int, layers: int, tied: bool, renormalise: bool, seed: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=renormalise,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


@settings(max_examples=20, deadline=None)
@given(
    experts=st.sampled_from([2, 4, 8]),
    layers=st.sampled_from([2, 4]),
    tied=st.booleans(),
    renormalise=st.booleans(),
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 100),
)
def test_moe_hf_to_megatron_shards_and_back_is_exact(experts, layers, tied, renormalise, tp, pp, ep, seed):
    """Every (EP rank, TP rank) pair's shards of each stage; the experts come back fused as HF holds them."""
    model = random_moe_model(experts, layers, tied, renormalise, seed)
    shape = ModelShape.from_hf(model.config)
    if experts % ep:
        with pytest.raises(UserError, match=f"ep={ep} must divide the model's num_experts={experts}"):
            shape.check_layout(tp, pp, ep)
        return
    shape.check_layout(tp, pp, ep)
    hf = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    back = []
    for stage in range(pp):
        shards = [
            [hf_to_megatron(hf, shape, tp_rank, tp, stage, pp, ep_rank=ep_rank, ep=ep) for tp_rank in range(tp)]
            for ep_rank in range(ep)
        ]
        assert all(list(s) == stage_names(shape, stage, pp, ep) for row in shards for s in row)
        holders = {False: shards[:1], True: shards}  # an expert's tensors differ over EP ranks, the rest do not
        back += stage_to_hf(
            ((name, [s[name] for row in holders[is_expert(name)] for s in row]) for name in shards[0][0]),
            shape,
            stage,
            pp,
            ep,
        )
    assert sorted(name for name, _ in back) == sorted(hf)  # every tensor once (a tied one under both names)
    back = dict(back)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_router_matches_hf_top_k_rule():
    """norm_topk_prob=true: softmax over the top-k logits (= the top-k of the softmax, renormalised);
    false: the top-k of the softmax as it is (Megatron's pre-softmax)."""
    from areal_hpc.engines.megatron.convert import transformer_config

    for renormalise in (True, False):
        shape = ModelShape.from_hf(random_moe_model(4, 2, False, renormalise, 0).config)
        config = transformer_config(shape, 1, 1, 2)
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 16)
        assert config.moe_router_pre_softmax is not renormalise and config.expert_model_parallel_size == 2
        assert config.moe_aux_loss_coeff == 0.0 and config.moe_expert_capacity_factor is None


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(dp=2, tp=2, ep=2), "Mixture-of-Experts model with tp=2"),
        (dict(dp=4, ep=4), None),
        (dict(dp=8, ep=8), "ep=8 must divide the model's num_experts=4"),
    ],
)
def test_moe_layouts(sizes, message, tiny_moe_dir):
    shape = ModelShape.from_hf(load_model(tiny_moe_dir).config)
    if message is None:
        check_layout(ParallelDims(**sizes), shape)
        return
    with pytest.raises(UserError, match=message) as error:
        check_layout(ParallelDims(**sizes), shape)
    assert "\n" not in str(error.value)


def test_expert_parallelism_needs_a_moe_model(tiny_model_dir):
    shape = ModelShape.from_hf(load_model(tiny_model_dir).config)
    with pytest.raises(UserError, match="ep=2 needs a Mixture-of-Experts model"):
        check_layout(ParallelDims(dp=2, ep=2), shape)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_pp2_step_where_no_token_chooses_one_ranks_experts(tiny_moe_dir, tmp_path):
    """A zero router ties every expert and top-2 takes experts 0 and 1: the EP rank holding 2 and 3
    receives no tokens, yet takes part in every exchange, forward and backward, on both pipeline
    stages (one MoE layer each)."""
    folder = shutil.copytree(tiny_moe_dir, tmp_path / "tied_router")
    stored = load_file(folder / "model.safetensors")
    save_file(
        {name: tensor.zero_() if name.endswith("mlp.gate.weight") else tensor for name, tensor in stored.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    reference = reference_run(folder)
    assert_same_step(
        in_reference_order(run_ranks(4, folder, tmp_path / "out.pt", "dp=2", "ep=2", "pp=2"), reference), reference
    )
