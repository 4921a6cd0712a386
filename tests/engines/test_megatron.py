"""The Megatron-core engine (``actor.engine=megatron``) against independent implementations, on real
gloo ranks: its forward equals the Hugging Face model's ``packed_policy_outputs``; one step of a
PPO-like loss (``tests.megatron_ranks``) and one whole PPO update through the trainer
(``tests.trainer_processes``) equal the torch engine's in one process in every layout (weights, loss,
gradient norm: summed over micro-batches and data-parallel ranks, not averaged); a checkpoint restores
the step and loads into other layouts; the PPO critic's step and checkpoint equal the torch engine's;
HF -> Megatron shards -> HF is exact for random shapes; layouts the engine does not build are one
``UserError``.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from areal_hpc.algo import logprobs
from areal_hpc.engines.base import OPTIMIZER_SHARDS, TRAINING_STATE
from areal_hpc.engines.megatron.convert import ModelShape, gpt_model_args, hf_to_megatron, stage_names, stage_to_hf
from areal_hpc.engines.megatron.engine import check_layout
from areal_hpc.engines.megatron.outputs import LogprobHead, PassTargets
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import load_critic, load_model, load_tokenizer, save_model
from tests.engines.test_parallel_layouts import STEP, assert_same_step, single_process
from tests.engines.test_torch_parallel import assert_same_step as assert_same_engine_step
from tests.models.test_export import assert_exports_as_trained
from tests.native_ranks import LOGITS_IN_CHUNKS, reference_run, seeded_batch
from tests.trainer_processes import run_ranks as run_trainer_ranks


def run_ranks(world: int, model_dir, out, *options: str) -> dict:
    """``world`` ranks of ``tests.megatron_ranks`` on loopback; what rank 0 wrote."""
    return run_trainer_ranks(world, model_dir, out, *options, timeout=120, module="tests.megatron_ranks")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:
    return reference_run(tiny_model_dir)


@pytest.fixture(scope="module")
def critic_reference(tiny_model_dir) -> dict:
    return reference_run(tiny_model_dir, critic=True)


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("single"))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, options",
    [
        (1, ()),
        (2, ("tp=2",)),
        (2, ("cp=2",)),
        (2, ("tp=2", "sp=1")),
        (2, ("cp=2", "temperatures=mixed", LOGITS_IN_CHUNKS)),
        (2, ("tp=2", "sp=1", "temperatures=mixed", LOGITS_IN_CHUNKS)),
    ],
    ids=[
        "one_process",
        "tp2",
        "cp2",
        "tp2_sequence_parallel",
        "cp2_mixed_temperatures_logits_in_chunks",
        "tp2_sequence_parallel_mixed_temperatures_logits_in_chunks",
    ],
)
def test_forward_equals_hf_packed_policy_outputs(world, options, tiny_model_dir, tmp_path):
    """Per-sequence RoPE and attention over THD-packed rows, and the vocabulary-parallel log-softmax at
    T = 0.7 (or at each sequence's own temperature, as records sampled at different ones carry them,
    through context shards and sequence-parallel padding; there a few positions at a time), against the
    Hugging Face model's own packed forward."""
    assert_forward_equals_hf(world, options, tiny_model_dir, tmp_path)


# Gemma 3's structure at the tests' scale: a sliding-window layer of 6 tokens (shorter than most sequences of
# ``seeded_batch``) at RoPE base 1e4, then a global layer at 1e6 scaled "linear" x8 (Gemma 3 4B-27B's),
# queries scaled by a query_pre_attn_scalar other than the head dimension, heads wider in all than the hidden
# size (as Gemma 3 1B's), which is no square (sqrt(hidden) scales the embeddings)
GEMMA3 = dict(
    hidden_size=24,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    },
)


def family_dir(family: str, tiny_model_dir, folder, **config):
    """``random_model`` of ``family`` (4 heads in 2 groups, two layers, a tied head) with the tiny model's
    tokenizer, saved in ``folder``."""
    tokenizer = load_tokenizer(tiny_model_dir)
    save_model(random_model(family, 4, 2, 2, True, 0, vocab=len(tokenizer), **config), tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir, tmp_path_factory):
    return family_dir("qwen3", tiny_model_dir, tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def gemma3_dir(tiny_model_dir, tmp_path_factory):
    return family_dir("gemma3", tiny_model_dir, tmp_path_factory.mktemp("gemma3") / "model", **GEMMA3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``run_ranks(world, model_dir, *options)``, each run once in this module (one process's is others' reference)."""
    done = {}

    def run(world: int, model_dir, *options: str) -> dict:
        key = (world, str(model_dir), options)
        if key not in done:
            done[key] = run_ranks(world, model_dir, tmp_path_factory.mktemp("run") / "out.pt", *options)
        return done[key]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model, world, options",
    [
        ("tiny_llama_dir", 1, ()),
        ("tiny_llama_dir", 4, ("tp=2", "pp=2")),
        ("qwen3_dir", 1, ()),
        ("qwen3_dir", 4, ("tp=2", "pp=2")),
        ("gemma3_dir", 1, ()),
        ("gemma3_dir", 4, ("tp=2", "sp=1", "cp=2")),
        ("gemma3_dir", 2, ("pp=2",)),
    ],
    ids=[
        "llama_one_process",
        "llama_tp2xpp2",
        "qwen3_one_process",
        "qwen3_tp2xpp2",
        "gemma3_one_process",
        "gemma3_tp2xcp2_sequence_parallel",
        "gemma3_pp2",
    ],
)
def test_family_forward_equals_hf_one_sequence_at_a_time(model, world, options, request, runs):
    """Llama 3 (no q/k/v biases, RoPE scaled as "llama3", an untied head), Qwen3 (q/k RMSNorm) and Gemma 3 (see
    ``GEMMA3``; (1 + w) RMSNorms before and after attention and the MLP, embeddings times sqrt(hidden), gated
    tanh-GELU): Megatron's logprobs and entropies equal those of the Hugging Face model run on each sequence
    alone, in one process and over tensor- and pipeline-parallel ranks. The rollout push names every tensor as
    the Hugging Face model does, and every layout's step is one process's: the vocabulary-parallel output layer
    over TP ranks on the last stage (Qwen3's tied to the first stage's embedding, Llama's not), and Gemma 3's
    sandwich norms after the TP reduce-scatter (their gradients summed over the TP ranks), windows over context
    shards, windows and their RoPE base by global layer number on the second pipeline stage."""
    model_dir = request.getfixturevalue(model)
    got = runs(world, model_dir, *options, "temperature=0.7")
    assert_outputs_equal_hf(got, options, model_dir, reference=hf_outputs_one_sequence_at_a_time)
    assert got["weights"].keys() == load_model(model_dir).state_dict().keys()
    if world > 1:
        one = runs(1, model_dir, "temperature=0.7")
        (rank,) = one["ranks"]
        outputs = {
            name: [values[rank["indices"].index(i)] for i in range(len(values))]
            for name, values in rank["outputs"].items()
        }
        assert_same_engine_step(got, {"outputs": outputs, "stats": rank["stats"], "weights": one["weights"]})


def hf_outputs_one_sequence_at_a_time(model, batch, temperature: float) -> dict[str, torch.Tensor]:
    """{"logprobs", "entropy"} at the batch's target positions (0 elsewhere) from ``model``'s plain forward of
    each sequence alone."""
    packed, _ = batch.packed()
    logits = torch.cat([model(torch.tensor([s])).logits[0] for s in batch.sequences]).float() / temperature
    logprobs = logits.log_softmax(-1)
    targets, tokens = packed.target_tokens()
    chosen, entropy = logprobs[targets, tokens], -(logprobs.exp() * logprobs).sum(-1)[targets]
    return {
        name: torch.zeros(len(logits)).index_put((targets,), v)
        for name, v in (("logprobs", chosen), ("entropy", entropy))
    }


@pytest.fixture
def group_of_one():
    """The default process group, of this process alone (made here and destroyed after where there is none)."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_logprob_head_takes_the_unfused_output_layers_gradients(dtype, group_of_one, monkeypatch):
    """The policy's output layer (the hidden states' logprobs 7 positions at a time, their logits recomputed in
    the backward pass) against the path it replaces: the output layer's whole [T, V] logits in the parameters'
    dtype, their float32 (or wider) log-softmax at each position's temperature, and autograd's gradients of the
    hidden states and the weight. In float64 to rounding; in bf16 (Megatron's mixed precision: the products in
    bf16, the log-softmax in float32) to a unit in bf16's last place of the largest entries."""
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * 300 * 7)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 1, 16, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(300, 16, generator=generator, dtype=torch.float64).to(dtype))
    targets = PassTargets(
        torch.randint(0, 300, (30,), generator=generator), 0.5 + torch.rand(30, 1, generator=generator)
    )
    upstream = torch.randn(30, generator=generator, dtype=torch.float64)
    fused, _ = LogprobHead(weight, group_of_one)(hidden, runtime_gather_output=targets)
    wide = torch.promote_types(dtype, torch.float32)
    whole = torch.log_softmax(F.linear(hidden[:, 0], weight).to(wide) / targets.temperatures, -1)
    unfused = whole.gather(-1, targets.tokens[:, None])[:, 0]
    torch.testing.assert_close(fused[:, 0, 0], unfused.detach())
    torch.testing.assert_close(fused[:, 0, 1], -(whole.exp() * whole).sum(-1).detach())
    for got, want in zip(
        torch.autograd.grad((fused[:, 0, 0] * upstream).sum(), (hidden, weight)),
        torch.autograd.grad((unfused * upstream).sum(), (hidden, weight)),
    ):
        assert got.dtype == dtype
        bf16_ulp = {} if dtype == torch.float64 else dict(rtol=0, atol=2**-7 * want.abs().max().item())
        torch.testing.assert_close(got, want, **bf16_ulp)


def test_llama3_rope_scaling_builds_the_frequencies_hf_uses(tiny_llama_dir):
    """The sequences above are too short for the scaled (low) frequencies to move a logprob past the
    tolerance: the frequencies themselves are compared, as GPTModel builds them from the converted shape."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    model = load_model(tiny_llama_dir)
    shape = ModelShape.from_hf(model.config)
    args = gpt_model_args(shape)
    rotary = RotaryEmbedding(
        kv_channels=shape.head_dim,
        rotary_percent=args["rotary_percent"],
        rotary_base=args["rotary_base"],
        rope_scaling=args["rope_scaling"],
        rope_scaling_factor=args["rope_scaling_factor"],
        use_cpu_initialization=True,
    )
    expected = model.model.rotary_emb.inv_freq
    assert args["rope_scaling"] and not torch.allclose(expected, 1 / shape.rope_base ** (torch.arange(0, 16, 2) / 16))
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "RoPE scaling 'yarn'"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "'original_max_position_embeddings': 32.0",
        ),
    ],
)
def test_rope_scalings_megatron_does_not_build_are_one_user_error(rope, message):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64, rope_parameters={"rope_theta": 1e4, **rope}
    )
    with pytest.raises(UserError, match=re.escape(message)):
        ModelShape.from_hf(config)


def assert_forward_equals_hf(world: int, options: tuple, model_dir, tmp_path) -> None:
    got = run_ranks(world, model_dir, tmp_path / "out.pt", *options, "temperature=0.7")
    assert_outputs_equal_hf(got, options, model_dir)


def assert_outputs_equal_hf(got: dict, options: tuple, model_dir, reference=None) -> None:
    """The outputs at T = 0.7 that ranks of layout ``options`` returned (``got``) are those of the HF model's
    packed forward (or of ``reference(model, batch, temperature)``)."""
    for rank in got["ranks"]:
        batch = seeded_batch(mixed_temperatures="temperatures=mixed" in options).select(rank["indices"])
        with torch.no_grad():
            if reference is None:
                expected = packed_policy_outputs(load_model(model_dir), batch.packed()[0], temperature=0.7)
            else:
                expected = reference(load_model(model_dir), batch, 0.7)
        assert [len(v) for v in rank["outputs"]["logprobs"]] == [len(s) for s in batch.sequences]
        for name, values in expected.items():
            torch.testing.assert_close(torch.cat(rank["outputs"][name]), values, rtol=1e-5, atol=1e-5, msg=name)


# layout name -> (processes, trainer overrides)
LAYOUTS = {
    "one_process": (1, ()),
    "tp2": (2, ("actor.parallel.tp=2",)),
    "pp2": (2, ("actor.parallel.pp=2",)),
    "dp2_uneven_microbatches": (2, ("actor.max_tokens_per_mb=16",)),
    "tp2xpp2": (4, ("actor.parallel.tp=2", "actor.parallel.pp=2")),
    "cp2": (2, ("actor.parallel.cp=2",)),
    "tp2xcp2_sequence_parallel": (
        4,
        ("actor.parallel.tp=2", "actor.parallel.cp=2", "actor.parallel.sequence_parallel=true"),
    ),
    "fsdp2": (2, ("actor.parallel.fsdp=true",)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ppo_update_equals_the_torch_engine_in_one_process(layout, tiny_model_dir, reference_folder, tmp_path):
    """The trainer's whole PPO update (proximal logprobs recomputed, two optimizer steps) on Megatron."""
    processes, overrides = LAYOUTS[layout]
    reference = single_process("torch", str(tiny_model_dir), reference_folder)
    ours = run_trainer_ranks(processes, tiny_model_dir, tmp_path / "out.pt", "actor.engine=megatron", *STEP, *overrides)
    assert_same_step(ours, reference)


@pytest.mark.distributed
def test_step_with_an_empty_share_and_checkpoint_round_trip(tiny_model_dir, reference, tmp_path):
    """tp2 x dp2 with one replica training on nothing, gradient clipping active, the log-softmax's
    gradient a few positions at a time; the checkpoint restores weights, Adam moments and the schedule, is a
    complete HF folder, and its weights load into pp2."""
    folder = tmp_path / "checkpoint"
    got = run_ranks(
        4, tiny_model_dir, tmp_path / "saved.pt", "tp=2", "dp=2", "empty=1", LOGITS_IN_CHUNKS, f"save={folder}"
    )
    assert_same_engine_step(in_reference_order(got, reference), reference)
    assert reference["stats"]["grad_norm"] > 0.5  # the clipping at 0.5 took part
    assert_checkpoint_round_trip(got, folder, tiny_model_dir, tmp_path, 2, "pp=2")
    assert_exports_as_trained(folder, got["weights"], tmp_path)  # `areal-hpc export` of it: plain transformers


@pytest.mark.distributed
def test_fsdp_step_with_an_empty_share_and_checkpoint_round_trip(tiny_model_dir, reference, tmp_path):
    """Megatron's FSDP2 wrapper over tp2 x dp2, one replica training on nothing, clipping active: the
    same step as one process; the checkpoint (optimizer moments as FSDP shards) restores the next step
    exactly and its weights load into tp2."""
    folder = tmp_path / "checkpoint"
    got = run_ranks(4, tiny_model_dir, tmp_path / "saved.pt", "tp=2", "dp=2", "fsdp=1", "empty=1", f"save={folder}")
    assert_same_engine_step(in_reference_order(got, reference), reference)
    assert_checkpoint_round_trip(got, folder, tiny_model_dir, tmp_path, 2, "tp=2")


def in_reference_order(got: dict, reference: dict) -> dict:
    """``got`` with its weights (in Megatron's order: fused q/k/v first) in the reference's order, once
    they are the same set."""
    assert got["weights"].keys() == reference["weights"].keys()
    return {**got, "weights": {name: got["weights"][name] for name in reference["weights"]}}


def assert_checkpoint_round_trip(got: dict, folder, model_dir, tmp_path, world: int, *options: str) -> None:
    """The checkpoint a ``save=folder`` run wrote restored its next step exactly, is a complete HF
    folder of the step's weights, and those weights load into ``world`` ranks of layout ``options``
    (without the optimizer state, which resumes only in the layout that saved it)."""
    assert got["ranks"][0]["restored_step_diff"] == 0.0
    plain = load_model(folder).state_dict()
    for name, tensor in got["weights"].items():
        assert torch.equal(plain[name], tensor), name
    weights_only = tmp_path / "weights"
    shutil.copytree(folder, weights_only, ignore=shutil.ignore_patterns(OPTIMIZER_SHARDS, TRAINING_STATE))
    loaded = run_ranks(world, model_dir, tmp_path / "loaded.pt", *options, f"load={weights_only}")["weights"]
    assert loaded.keys() == got["weights"].keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, plain[name]), name


FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}


def random_model(family: str, heads: int, kv_heads: int, layers: int, tied: bool, seed: int, vocab=48, **config):
    """A random model of ``family`` (``config``: more or other config fields) whose norm weights are drawn away
    from their initial 1 (Gemma's: 0), where a norm left out, applied as w rather than 1 + w, or converted under
    another's name would not show."""
    config_class, model_class = FAMILIES[family]
    shape = dict(hidden_size=8 * heads, intermediate_size=24, head_dim=8, max_position_embeddings=64)
    config = config_class(
        vocab_size=vocab,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        **shape | config,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
    return model


@settings(max_examples=25, deadline=None)
@given(
    family=st.sampled_from(list(FAMILIES)),
    kv_heads=st.sampled_from([1, 2, 4]),
    ratio=st.sampled_from([1, 2, 3]),
    layers=st.sampled_from([2, 4]),
    tied=st.booleans(),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    seed=st.integers(0, 100),
)
def test_hf_to_megatron_shards_and_back_is_exact(family, kv_heads, ratio, layers, tied, tp, pp, seed):
    model = random_model(family, kv_heads * ratio, kv_heads, layers, tied, seed)
    shape = ModelShape.from_hf(model.config)
    if kv_heads % tp:
        with pytest.raises(UserError, match=f"tp={tp} must divide the model's num_key_value_heads"):
            shape.check_layout(tp, pp)
        return
    shape.check_layout(tp, pp)
    hf = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    back = []
    for stage in range(pp):
        shards = [hf_to_megatron(hf, shape, rank, tp, stage, pp) for rank in range(tp)]
        assert all(list(s) == stage_names(shape, stage, pp) for s in shards)
        back += stage_to_hf(((name, [s[name] for s in shards]) for name in shards[0]), shape, stage, pp)
    assert sorted(name for name, _ in back) == sorted(hf)  # every tensor once (a tied one under both names)
    back = dict(back)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_interleaves_query_groups():
    """Megatron's row order, spelt out for 4 heads in 2 groups on 2 TP ranks: rank r holds group r's
    q heads, then its k head, then its v head."""
    model = random_model("qwen2", 4, 2, 2, True, 0)
    shape = ModelShape.from_hf(model.config)
    hf = model.state_dict()
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"].view(-1, 8, 32) for p in "qkv")
    for rank in range(2):
        fused = hf_to_megatron(hf, shape, rank, 2, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
        expected = torch.cat([q[2 * rank], q[2 * rank + 1], k[rank], v[rank]])
        assert torch.equal(fused, expected)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(tp=4), "tp=4 must divide the model's num_key_value_heads=2"),
        (dict(pp=3), "pp=3 must divide the model's num_hidden_layers=4"),
        (dict(dp=2, tp=2, fsdp=True, sequence_parallel=True), "not with pp=1 ep=1 sequence_parallel=true"),
        (dict(dp=2, pp=2, fsdp=True), "fsdp=true with dp, tp and cp, not with pp=2"),
    ],
)
def test_layouts_not_built_are_one_user_error(sizes, message, tiny_model_dir):
    shape = ModelShape.from_hf(load_model(tiny_model_dir).config)
    with pytest.raises(UserError, match=message) as error:
        check_layout(ParallelDims(**sizes), shape)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "refused, message",
    [
        (dict(final_logit_softcapping=30.0), "Gemma 3 with final_logit_softcapping=None, not 30.0"),
        (dict(attn_logit_softcapping=50.0), "Gemma 3 with attn_logit_softcapping=None, not 50.0"),
        (dict(use_bidirectional_attention=True), "Gemma 3 with use_bidirectional_attention=False, not True"),
        (dict(hidden_activation="gelu"), "Gemma 3 with hidden_activation=gelu_pytorch_tanh, not 'gelu'"),
        (
            dict(
                rope_parameters={
                    **GEMMA3["rope_parameters"],
                    "sliding_attention": GEMMA3["rope_parameters"]["full_attention"],
                }
            ),
            "Gemma 3's sliding-window layers without RoPE scaling, not 'linear'",
        ),
        ("critic", "cannot build a PPO critic of a Gemma 3 model"),
    ],
)
def test_what_megatron_does_not_build_of_gemma3_is_one_user_error(refused, message):
    changes = refused if isinstance(refused, dict) else {}
    config = Gemma3TextConfig(num_attention_heads=4, num_hidden_layers=2, **GEMMA3 | changes)
    with pytest.raises(UserError, match=re.escape(message)) as error:
        shape = ModelShape.from_hf(config)
        if refused == "critic":
            shape.critic()
    assert "\n" not in str(error.value)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, options",
    [(1, ()), (2, ("tp=2",)), (2, ("cp=2",)), (2, ("tp=2", "sp=1"))],
    ids=["one_process", "tp2", "cp2", "tp2_sequence_parallel"],
)
def test_critic_step_equals_the_torch_engine_in_one_process(world, options, tiny_model_dir, critic_reference, tmp_path):
    """The PPO critic (HF's token classifier: the body under a fresh one-output head) on Megatron."""
    got = run_ranks(world, tiny_model_dir, tmp_path / "out.pt", *options, "critic=1")
    assert_same_engine_step(in_reference_order(got, critic_reference), critic_reference)


@pytest.mark.distributed
def test_critic_checkpoint_on_the_last_pipeline_stage_restores_the_step(tiny_model_dir, critic_reference, tmp_path):
    """pp2: the value head lives on the last stage; the saved folder is a token classifier transformers
    loads, with the trained head and body, and a second engine loading it takes the same next step."""
    folder = tmp_path / "critic"
    got = run_ranks(2, tiny_model_dir, tmp_path / "out.pt", "pp=2", "critic=1", f"save={folder}")
    assert_same_engine_step(in_reference_order(got, critic_reference), critic_reference)
    assert got["ranks"][0]["restored_step_diff"] == 0.0
    saved = load_critic(folder).state_dict()
    assert saved.keys() == got["weights"].keys()
    for name, tensor in got["weights"].items():
        assert torch.equal(saved[name], tensor), name
