"""The torch-native trainer: data parallelism over real gloo processes equals one process, and the
weight sync (disk and distributed) leaves a real rollout server with exactly the trainer's weights."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from areal_hpc.algo.packing import pack
from areal_hpc.launch.name_resolve import free_port
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.engine import TorchTrainEngine
from areal_hpc.train.logprobs import packed_token_logprobs
from areal_hpc.train.weight_push import DiskWeightSync, DistributedWeightSync

from .conftest import REPO, embedded_server


def run_ranks(world: int, model, out, *overrides: str) -> dict:
    port = str(free_port("127.0.0.1"))
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.trainer_processes", str(model), str(out), *overrides],
                              cwd=REPO, env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    try:
        assert [p.wait(timeout=300) for p in ranks] == [0] * world
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    return torch.load(out, weights_only=False)


@pytest.mark.distributed
@pytest.mark.parametrize("overrides", [(), ("actor.ppo_n_minibatches=2", "actor.aggregation=seq-mean-token-mean"),
                                       ("actor.adv_estimator=ppo",)])
def test_two_data_parallel_ranks_take_the_same_step_as_one_process(tiny_model_dir, tmp_path, overrides):
    single = run_ranks(1, tiny_model_dir, tmp_path / "one.pt", *overrides)
    double = run_ranks(2, tiny_model_dir, tmp_path / "two.pt", *overrides)
    start = load_model(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], single["weights"]["actor"][k]) for k in start)  # the step changed the model
    assert single["weights"].keys() == ({"actor", "critic"} if "actor.adv_estimator=ppo" in overrides else {"actor"})
    for engine, weights in single["weights"].items():  # the actor, and for PPO the critic
        for name, tensor in weights.items():
            torch.testing.assert_close(double["weights"][engine][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert double["stats"]["actor/loss_tokens"] == single["stats"]["actor/loss_tokens"]
    assert double["stats"]["actor/loss"] == pytest.approx(single["stats"]["actor/loss"], abs=1e-6)


def perturbed_engine(model_dir) -> TorchTrainEngine:
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return TorchTrainEngine(model, packed_token_logprobs, tokenizer=load_tokenizer(model_dir))


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_weight_sync_leaves_the_server_with_the_trainers_weights(tiny_model_dir, tmp_path, mode):
    torch.manual_seed(0)
    engine = perturbed_engine(tiny_model_dir)
    prompt = prompt_ids(engine.tokenizer, "What is 3 + 4?")

    async def sync_and_generate(address):
        async with RolloutClient([address]) as client:
            sync = DiskWeightSync(tmp_path / "weights") if mode == "disk" else DistributedWeightSync("gloo", 1 << 16)
            await sync.connect(client)
            stats = await sync.push(engine, client, version=7)
            generation = await client.generate(prompt, {"max_new_tokens": 6, "temperature": 1.0})
            return stats, generation

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        stats, generation = asyncio.run(sync_and_generate(address))
    assert stats["sync/bytes"] == sum(t.numel() * 4 for t in engine.model.state_dict().values())
    assert generation.versions == [7] * len(generation.output_ids)
    packed = pack([generation.input_ids + generation.output_ids],
                  [[0] * len(generation.input_ids) + [1] * len(generation.output_ids)])
    with torch.no_grad():
        expected = packed_token_logprobs(engine.model, packed)[packed.target_mask]
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
