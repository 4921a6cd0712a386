"""The torch-native trainer: data parallelism over real gloo processes equals one process, and the
weight sync (disk and distributed) leaves a real rollout server with exactly the trainer's weights,
also after the distributed sync reconnects (which destroys its previous group first)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.errors import UserError
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.runtime.name_resolve import bind
from areal_hpc.train import weight_push
from areal_hpc.train.weight_push import DiskWeightSync, DistributedWeightSync
from tests.conftest import embedded_server
from tests.trainer_processes import run_ranks


@pytest.mark.distributed
# The PPO critic's step and the two-minibatch step with Adam's eps raised, as in test_parallel_layouts.py:
# at eps=1e-8 Adam turns the float32 rounding of its near-zero gradients (summed in another order over
# two ranks) into lr-sized steps (seen here: a critic weight off by 1.2e-6 after one step, the losses equal
# to 1e-9; on another host's CPU, the actor's v_proj off by 1.2e-6 after two minibatches, 7e-9 at eps=1e-4).
# M2PO's trust region is one bound over the whole batch: two ranks must mask the tokens one process does
# (the synthetic batch's behaviour logprobs are ~4 nats off the random model's: a bound of 16 keeps 35 of 79).
@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("actor.ppo_n_minibatches=2", "actor.aggregation=seq-mean-token-mean", "optimizer.eps=1e-4"),
        ("actor.adv_estimator=ppo", "optimizer.eps=1e-4"),
        ("actor.policy_loss=m2po", "actor.m2_threshold=16"),
    ],
)
def test_two_data_parallel_ranks_take_the_same_step_as_one_process(tiny_model_dir, tmp_path, overrides):
    single = run_ranks(1, tiny_model_dir, tmp_path / "one.pt", *overrides)
    double = run_ranks(2, tiny_model_dir, tmp_path / "two.pt", *overrides)
    start = load_model(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], single["weights"]["actor"][k]) for k in start)  # the step changed the model
    assert single["weights"].keys() == ({"actor", "critic"} if "actor.adv_estimator=ppo" in overrides else {"actor"})
    for engine, weights in single["weights"].items():  # the actor, and for PPO the critic
        for name, tensor in weights.items():
            torch.testing.assert_close(double["weights"][engine][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("actor/loss_tokens", "actor/kept_tokens"):
        assert double["stats"][key] == single["stats"][key]
    if "actor.policy_loss=m2po" in overrides:
        assert 0 < single["stats"]["actor/kept_tokens"] < single["stats"]["actor/loss_tokens"]
    assert double["stats"]["actor/loss"] == pytest.approx(single["stats"]["actor/loss"], abs=1e-6)


def perturbed_engine(model_dir, seed: int = 0) -> TorchTrainEngine:
    generator = torch.Generator().manual_seed(seed)
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return TorchTrainEngine(model, packed_policy_outputs, tokenizer=load_tokenizer(model_dir))


def assert_served_by(engine: TorchTrainEngine, generation, version: int) -> None:
    """The server generated with the engine's weights: its logprobs are the engine's on the same tokens."""
    assert generation.versions == [version] * len(generation.output_ids)
    batch = SequenceBatch(
        [generation.input_ids + generation.output_ids],
        [[0] * len(generation.input_ids) + [1] * len(generation.output_ids)],
    )
    expected = engine.forward(batch)["logprobs"][0][len(generation.input_ids) - 1 : -1]
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)


SAMPLING = {"max_new_tokens": 6, "temperature": 1.0}


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_weight_sync_leaves_the_server_with_the_trainers_weights(tiny_model_dir, tmp_path, mode):
    engine = perturbed_engine(tiny_model_dir)
    prompt = prompt_ids(engine.tokenizer, "What is 3 + 4?")

    async def sync_and_generate(address):
        async with RolloutClient([address]) as client:
            sync = DiskWeightSync(tmp_path / "weights") if mode == "disk" else DistributedWeightSync("gloo", 1 << 16)
            await sync.connect(client)
            stats = await sync.push(engine, client, version=7)
            return stats, await client.generate(prompt, SAMPLING)

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        stats, generation = asyncio.run(sync_and_generate(address))
    assert_served_by(engine, generation, 7)
    if mode == "disk":  # what the servers read
        assert stats["sync/bytes"] == sum(
            f.stat().st_size for f in (tmp_path / "weights" / "v000007").iterdir() if f.suffix == ".safetensors"
        )
    else:  # every tensor of the state dict, tied ones under both names
        assert stats["sync/bytes"] == sum(t.numel() * 4 for t in engine.model.state_dict().values())


def test_disk_sync_writes_the_weights_before_the_pause_and_never_loads_an_earlier_incarnations(
    tiny_model_dir, tmp_path
):
    engine, stale = perturbed_engine(tiny_model_dir, seed=1), perturbed_engine(tiny_model_dir, seed=2)
    prompt = prompt_ids(engine.tokenizer, "What is 3 + 4?")
    folder = tmp_path / "weights"
    stale.save(folder / "v000003", optimizer=False)  # version 3 as a killed earlier run wrote it

    async def staged_then_pushed(address):
        async with RolloutClient([address]) as client:
            sync = DiskWeightSync(folder)
            staged = await sync.stage(engine, 4)  # while the server still generates with what it has
            assert (await client.generate(prompt, SAMPLING)).versions[-1] == 0
            written = (folder / "v000004" / "model.safetensors").stat().st_mtime_ns
            pushed = await sync.push(engine, client, version=4)
            assert (folder / "v000004" / "model.safetensors").stat().st_mtime_ns == written  # loaded, not rewritten
            assert set(staged) == {"sync/stage_seconds"} and pushed["sync/bytes"] > 0
            await sync.push(engine, client, version=3)  # never staged by this run: written again, then loaded
            return await client.generate(prompt, SAMPLING)

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        generation = asyncio.run(staged_then_pushed(address))
    assert_served_by(engine, generation, 3)


def port_is_listened_on(port: int) -> bool:
    try:
        bind("127.0.0.1", port).close()
        return False
    except UserError:
        return True


def test_reconnecting_the_distributed_sync_destroys_the_previous_group_first(tiny_model_dir, tmp_path, monkeypatch):
    """A second ``connect`` (e.g. after a server restart) releases the first group's store and sockets
    before the new group forms, and pushes then reach the server through the new group."""
    masters, still_listening = [], []
    join_update_group = weight_push.join_update_group

    def join_and_record(backend, host, port, *rest):  # the trainer's side of each new group
        still_listening.append([old for old in masters if port_is_listened_on(old)])
        masters.append(port)
        return join_update_group(backend, host, port, *rest)

    monkeypatch.setattr(weight_push, "join_update_group", join_and_record)
    first, second = perturbed_engine(tiny_model_dir, seed=1), perturbed_engine(tiny_model_dir, seed=2)
    prompt = prompt_ids(first.tokenizer, "What is 3 + 4?")

    async def connect_push_reconnect_push(address):
        async with RolloutClient([address]) as client:
            sync = DistributedWeightSync("gloo", 1 << 16)
            await sync.connect(client)
            await sync.push(first, client, version=1)
            before = await client.generate(prompt, SAMPLING)
            await sync.connect(client)
            await sync.push(second, client, version=2)
            after = await client.generate(prompt, SAMPLING)
            sync.destroy_group()
            return before, after

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        before, after = asyncio.run(connect_push_reconnect_push(address))
    assert still_listening == [[], []]  # the first group's store was gone when the second group formed
    assert not port_is_listened_on(masters[1])  # and destroy_group releases the second one's
    assert_served_by(first, before, 1)
    assert_served_by(second, after, 2)
