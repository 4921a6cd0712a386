"""LoRA on the torch engine (``actor.lora``): only the adapters train and sit in the optimizer, the
weight push (disk and distributed) leaves a real rollout server serving the merged model, checkpoints
hold the adapters in peft's format and resume exactly (one process, and FSDP over two gloo ranks, which
also equal one process), and what LoRA does not support is one line with exit code 2 before a run starts."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from areal_hpc.config import LoRAConfig, OptimizerConfig, load_config
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.lora import ADAPTER_WEIGHTS, check_lora, is_adapter
from areal_hpc.engines.torch.outputs import PolicyOutputs
from areal_hpc.errors import UserError
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.resolve import Host, resolve
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.checkpoint import load_checkpoint, save_checkpoint
from areal_hpc.train.weight_push import DiskWeightSync, DistributedWeightSync
from tests.conftest import embedded_server, run_cli
from tests.train.test_trainer import SAMPLING, assert_served_by
from tests.trainer_processes import run_ranks

LORA = LoRAConfig(rank=4, alpha=8.0)
TARGETS = len(LORA.target_modules)
BATCH = SequenceBatch([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]], [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1]])


def lora_engine(model_dir, lora: LoRAConfig = LORA, seed: int = 0, compute_dtype: str = "float32") -> TorchTrainEngine:
    torch.manual_seed(seed)  # the adapters' initialisation
    return TorchTrainEngine(
        load_model(model_dir),
        PolicyOutputs(),
        optimizer=OptimizerConfig(),
        lr=1e-2,
        total_steps=10,
        tokenizer=load_tokenizer(model_dir),
        compute_dtype=compute_dtype,
        lora=lora,
    )


def likelihood(outputs, packed, fields):
    return -outputs["logprobs"].sum() / 10, {}


def merged_weights(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.rollout_weights(1 << 20) for name, tensor in bucket}


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])  # bfloat16: under autocast, as the quickstart
def test_only_the_adapters_are_in_the_optimizer_and_a_step_changes_only_them(tiny_model_dir, compute_dtype):
    engine = lora_engine(tiny_model_dir, compute_dtype=compute_dtype)
    adapters = {name: p for name, p in engine.model.named_parameters() if is_adapter(name)}
    layers = engine.model.config.num_hidden_layers
    assert len(adapters) == 2 * TARGETS * layers  # A and B of each target in each layer
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapters.values()}
    assert all(p.requires_grad == is_adapter(name) for name, p in engine.model.named_parameters())
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    base = load_model(tiny_model_dir).state_dict()
    assert merged_weights(engine).keys() == base.keys()  # the base model's names, nothing of the adapters
    engine.train_step(BATCH, likelihood)
    changed = {name for name, p in engine.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= set(adapters)  # B moved from 0 (A gets no gradient while B is 0)
    merged = merged_weights(engine)
    moved = {name for name in base if not torch.equal(merged[name], base[name])}
    assert moved == {
        f"model.layers.{i}.{part}.{target}.weight"
        for i in range(layers)
        for part, targets in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for target in (f"{t}_proj" for t in targets)
    }


def test_both_pushes_leave_the_server_serving_the_merged_model(tiny_model_dir, tmp_path):
    engine = lora_engine(tiny_model_dir)
    base = TorchTrainEngine(load_model(tiny_model_dir), PolicyOutputs())
    prompt = prompt_ids(engine.tokenizer, "What is 3 + 4?")

    async def train_push_and_generate(address, sync, version):
        for _ in range(3):
            engine.train_step(BATCH, likelihood)
        adapted, unadapted = engine.forward(BATCH)["logprobs"][0], base.forward(BATCH)["logprobs"][0]
        assert (adapted - unadapted).abs().max() > 1e-2  # the adapters changed what the model computes
        async with RolloutClient([address]) as client:
            await sync.connect(client)
            await sync.push(engine, client, version=version)
            return await client.generate(prompt, SAMPLING)

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        generation = asyncio.run(train_push_and_generate(address, DiskWeightSync(tmp_path / "weights"), 3))
        assert_served_by(engine, generation, 3)
        distributed = DistributedWeightSync("gloo", 1 << 16)
        generation = asyncio.run(train_push_and_generate(address, distributed, 6))
        distributed.destroy_group()
        assert_served_by(engine, generation, 6)


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir, tmp_path):
    from peft import PeftModel

    engine = lora_engine(tiny_model_dir)
    engine.train_step(BATCH, likelihood)
    folder = save_checkpoint(tmp_path, 1, {"actor": engine}, {"version": 1}) / "actor"
    assert {f.name for f in folder.iterdir()} == {ADAPTER_WEIGHTS, "adapter_config.json", "training_state.pt"}
    # peft's own loader reads it: the base model with the adapters computes what the engine does
    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), folder).base_model.model
    torch.testing.assert_close(
        TorchTrainEngine(peft_model, PolicyOutputs()).forward(BATCH)["logprobs"][0],
        engine.forward(BATCH)["logprobs"][0],
        rtol=0,
        atol=1e-6,
    )

    resumed = lora_engine(tiny_model_dir, seed=1)  # other initial adapters: the checkpoint's replace them
    assert load_checkpoint(folder.parent, {"actor": resumed}) == {"step": 1, "version": 1}
    stats = [each.train_step(BATCH, likelihood) for each in (engine, resumed)]
    assert stats[0] == stats[1] and resumed.scheduler.last_epoch == 2  # the schedule went on from step 1
    for name, tensor in merged_weights(engine).items():
        torch.testing.assert_close(merged_weights(resumed)[name], tensor, rtol=0, atol=0, msg=name)

    with pytest.raises(UserError, match="rank 4 .* actor.lora.rank=8"):
        lora_engine(tiny_model_dir, LoRAConfig(rank=8)).load(folder)


@pytest.mark.distributed
def test_fsdp_over_two_ranks_trains_and_resumes_as_one_process(tiny_model_dir, tmp_path):
    lora = ["actor.lora.rank=4", "actor.lora.alpha=8"]
    one = run_ranks(
        1, tiny_model_dir, tmp_path / "one.pt", "save", str(tmp_path / "one"), *lora, module="tests.lora_ranks"
    )
    two = run_ranks(
        2,
        tiny_model_dir,
        tmp_path / "two.pt",
        "save",
        str(tmp_path / "two"),
        *lora,
        "actor.parallel.fsdp=true",
        module="tests.lora_ranks",
    )
    resumed = run_ranks(
        2,
        tiny_model_dir,
        tmp_path / "resumed.pt",
        "resume",
        str(tmp_path / "two"),
        *lora,
        "actor.parallel.fsdp=true",
        module="tests.lora_ranks",
    )
    start = load_model(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], one["weights"][k]) for k in start)  # the steps changed the model
    assert (tmp_path / "two" / "optimizer").is_dir() and not (tmp_path / "two" / "model.safetensors").exists()
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(resumed["weights"][name], two["weights"][name], rtol=0, atol=0, msg=name)
    assert two["stats"]["actor/loss"] == pytest.approx(one["stats"]["actor/loss"], abs=1e-6)


def test_bad_target_modules_are_one_line_with_exit_code_2_before_the_run_starts(tmp_path):
    out = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"cluster.fileroot={tmp_path}",
        "actor.lora.rank=4",
        "actor.lora.target_modules=[q_proj,nope]",
    )
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "actor.lora.target_modules: nope not among" in out.stderr and "it has q_proj, k_proj" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rl.trainer_processes=2", "actor.parallel.tp=2"], "actor.parallel.tp=2 (tensor parallelism); set tp=1"),
        (["rl.trainer_processes=2", "actor.parallel.cp=2"], "actor.parallel.cp=2 (context parallelism); set cp=1"),
        (["actor.engine=megatron"], "needs actor.engine=torch, got actor.engine=megatron"),
        (["actor.tree_training=dta"], "does not train with actor.tree_training=dta"),
        (["model.preset=tiny-moe", "actor.lora.target_modules=[gate_proj]"], "gate_proj not among"),
    ],
)
def test_what_lora_does_not_support_is_refused_in_one_line(overrides, words):
    with pytest.raises(UserError, match=re.escape(words)) as refused:
        check_lora(resolve(load_config("configs/quickstart.yaml", ["actor.lora.rank=4", *overrides]), Host("cpu")).cfg)
    assert "\n" not in str(refused.value)
