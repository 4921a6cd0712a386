"""Staleness gate (property test), server failover, and the controller driving real embedded servers."""

import asyncio
import heapq
import re
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.agents.engine import Sampling
from areal_hpc.agents.multi_turn_math import MultiTurnMathWorkflow
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.controller import Episode, RolloutController
from areal_hpc.rollout.staleness import ReadyQueue, StalenessGate
from tests import rewards_for_tests
from tests.conftest import embedded_server
from tests.waiting import model_info, wait_until
from tests.workflow_helpers import episode_groups


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 6),
    eta=st.integers(0, 3),
    concurrent=st.integers(1, 40),
    steps=st.integers(1, 6),
    seed=st.integers(0, 10**6),
    durations=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=50),
)
def test_no_trained_episode_lags_more_than_eta_versions(batch, eta, concurrent, steps, seed, durations):
    """Event simulation of the controller's bookkeeping: episodes finish in random order after random
    times; the trainer fills each batch from the ready queue (oldest first, too-stale ones dropped),
    trains for a random time and moves to the next version."""
    gate, ready = StalenessGate(batch, eta, concurrent), ReadyQueue()
    clock, running, filling, trained, dropped = 0.0, [], [], [], 0  # running: heap of (finish, id, version)
    next_id, train_done = 0, None
    while len(trained) < steps * batch:
        while gate.capacity() > 0:
            gate.start()
            heapq.heappush(running, (clock + durations[(next_id * 7 + seed) % len(durations)], next_id, gate.version))
            next_id += 1
        assert gate.running <= concurrent
        if train_done is None:
            taken, stale = ready.take(batch - len(filling), gate.version, eta)
            n_dropped = len(stale)
            filling, dropped = filling + taken, dropped + n_dropped
            gate.drop(n_dropped)
            if len(filling) == batch:
                trained += [(gate.version, started) for started in filling]
                filling, train_done = [], clock + durations[(gate.version + seed) % len(durations)]
            if n_dropped:
                continue  # places opened: start episodes before time moves on
        clock = min(t for t in (running[0][0] if running else None, train_done) if t is not None)
        if clock == train_done:
            gate.set_version(gate.version + 1)
            train_done = None
        else:
            _, _, started = heapq.heappop(running)
            gate.finish(accepted=True)
            ready.put(started, started)
    assert all(0 <= version - started <= eta for version, started in trained)
    if eta == 0:  # synchronous: every batch comes from the weights it is trained on, nothing wasted
        assert dropped == 0 and all(version == started for version, started in trained)


def test_resumed_gate_counts_earlier_batches_as_accepted():
    gate = StalenessGate.resumed(batch_size=4, max_staleness=1, max_concurrent=100, version=3)
    assert gate.accepted == 12 and gate.capacity() == (1 + 3 + 1) * 4 - 12


async def waiting_requests(server: str) -> int:
    """Requests waiting in the server's queue (while it is paused, they stay there)."""
    return (await model_info(server))["waiting_requests"]


def test_requests_survive_a_server_killed_mid_run(tiny_model_dir, tmp_path):
    async def run(addresses, victim):
        async with RolloutClient(addresses) as client:
            victim_address = addresses[0]
            # paused, the victim holds its share in its queue until the kill (decoding, they could end first)
            await client.post(victim_address, "/pause_generation", {"mode": "abort"})
            jobs = [
                asyncio.create_task(client.generate([3, 4, 5, i], {"max_new_tokens": 1000, "ignore_eos": True}))
                for i in range(8)
            ]

            async def all_there() -> bool:
                return 0 < client.outstanding[victim_address] == await waiting_requests(victim_address)

            async def seen() -> str:
                return f"{client.outstanding[victim_address]} sent to the victim, {await model_info(victim_address)}"

            await wait_until(all_there, what="the victim's share of the requests to wait in its queue", seen=seen)
            victim.send_signal(signal.SIGKILL)
            return await asyncio.gather(*jobs), client.alive

    with embedded_server(tiny_model_dir, tmp_path) as (first, a), embedded_server(tiny_model_dir, tmp_path) as (_, b):
        generations, alive = asyncio.run(run([a, b], first))
    assert alive == [b]
    assert all(len(g.output_ids) == 1000 and g.finish_reason == "length" for g in generations)
    moved = [g for g in generations if g.interruptions]
    assert moved and all(g.server == b for g in moved)  # the dead server's requests finished on the other


def examples(n: int) -> list[Example]:
    return [Example(f"e{i}", f"{i} + {i} = ?", str(2 * i), str(2 * i)) for i in range(n)]


def perturbed_weights(model_dir: Path, out: Path, versions: int) -> list[Path]:
    """Folders of weights for versions 1..``versions``, each clearly different from the last."""
    tokenizer, folders = load_tokenizer(model_dir), [model_dir]
    for version in range(1, versions + 1):
        model = load_model(model_dir)
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
        folders.append(save_model(model, tokenizer, out / f"v{version}"))
    return folders


@torch.no_grad()
def teacher_forced(folder: Path, input_ids: list[int], output_ids: list[int]) -> list[float]:
    """Logprobs of ``output_ids`` after ``input_ids`` under the weights in ``folder`` (temperature 1)."""
    model = load_model(folder).eval()
    logits = model(torch.tensor([input_ids + output_ids])).logits[0, len(input_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def test_weight_updates_interrupt_generation_and_later_tokens_come_from_the_new_weights(tiny_model_dir, tmp_path):
    """Three updates to weights that really differ. At most 4 episodes run at once, so when the first
    batch is taken two more have just started: the first update must interrupt them, and their tokens
    carry two versions, each with the logprobs of that version's weights (teacher-forced)."""
    tokenizer, weights = load_tokenizer(tiny_model_dir), perturbed_weights(tiny_model_dir, tmp_path / "w", 3)
    eta, batch = 1, 3

    async def run(address):
        async with RolloutClient([address]) as client:
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                workflow = episode_groups(tokenizer, pool, Sampling(max_new_tokens=200), n_samples=2)
                gate = StalenessGate(batch, eta, max_concurrent=4)
                written: list[Episode] = []
                controller = RolloutController(client, workflow, gate, examples(20), on_accept=written.extend)
                await controller.start()
                consumed = []
                for version in range(3):
                    episodes = await controller.prepare_batch(batch)
                    consumed += [(version, e) for e in episodes]
                    if version == 0:  # the episodes started since wait in the paused server's queue ...
                        await client.post(address, "/pause_generation", {"mode": "abort"})
                        await wait_until(
                            lambda: waiting_requests(address),
                            what="generation in flight",
                            seen=lambda: model_info(address),
                        )
                        # ... until it continues: they are admitted and given first tokens (of version 0)
                        # before the engine takes the pause below, which interrupts them
                        await client.post(address, "/continue_generation", {})
                    await controller.pause()
                    await client.update_weights_from_disk(str(weights[version + 1]), version + 1)
                    controller.set_version(version + 1)
                    await controller.resume()

                def two_versions():
                    return [t for e in written for t in e.trajectories if len(set(t.segments[0].output_versions)) > 1]

                mixed = await wait_until(two_versions, what="an interrupted episode to finish")
                await controller.stop()
                return consumed, written, mixed, controller.failures

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        consumed, written, mixed, failures = asyncio.run(run(address))
    assert failures.total == 0
    assert len(consumed) == 3 * batch and len(written) >= len(consumed)
    for version, episode in consumed:
        assert version - episode.version <= eta
        assert len(episode.trajectories) == 2 and len({t.group_id for t in episode.trajectories}) == 1
        for traj in episode.trajectories:
            tokens = [v for s in traj.segments for v in s.output_versions]
            assert min(tokens) >= episode.version and traj.reward in (0.0, 1.0)
            assert len(traj.segments[0].output_logprobs) == len(traj.segments[0].output_ids) > 0
    segment = mixed[0].segments[0]
    assert mixed[0].metadata["interruptions"] >= 1
    versions, ids, logprobs = list(segment.output_versions), list(segment.output_ids), list(segment.output_logprobs)
    assert versions == sorted(versions)  # old tokens first, then the new weights'
    expected = {v: teacher_forced(weights[v], list(segment.input_ids), ids) for v in set(versions)}
    for i, version in enumerate(versions):
        assert logprobs[i] == pytest.approx(expected[version][i], abs=2e-3)
    switch = versions.index(versions[-1])
    assert any(abs(expected[versions[0]][i] - expected[versions[-1]][i]) > 0.05 for i in range(switch, len(ids)))


def test_multi_turn_episode_is_token_in_token_out_with_turn_rewards(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)

    async def run(address):
        async with RolloutClient([address]) as client:
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                groups = episode_groups(
                    tokenizer, pool, Sampling(max_new_tokens=6, temperature=0.0), 1, MultiTurnMathWorkflow(max_turns=3)
                )
                return await groups.run(client, examples(2)[1])

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        [traj] = asyncio.run(run(address))
    assert [r.step for r in traj.rewards] == list(range(len(traj.segments)))
    assert len(traj.segments) == 3 and all(r.value == 0.0 for r in traj.rewards)  # untrained model: wrong x3
    retry = tokenizer.decode(traj.segments[1].input_ids)
    assert "not correct" in retry and retry.rstrip().endswith("assistant")


class CannedWorkflow:
    """A workflow (a user extension point) that returns records without generating."""

    async def run(self, client, example):
        await asyncio.sleep(0)
        return [Trajectory([Segment([1], [2], [-0.5], [0])], group_id=example.uid)]


def test_a_failing_on_accept_does_not_leak_a_gate_place():
    """The first store fails (a full disk): each episode it held is a store failure, queued for nothing,
    and their places go back to the gate, so batches still fill."""
    failed = []

    def sink(episodes):
        if not failed:
            failed.extend(episodes)
            raise OSError("disk full")

    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted by this workflow
            gate = StalenessGate(2, 0, 4)
            controller = RolloutController(client, CannedWorkflow(), gate, examples(8), on_accept=sink)
            await controller.start()
            batch = await asyncio.wait_for(controller.prepare_batch(2), timeout=30)
            await controller.stop()
            return batch, controller.failures

    batch, failures = asyncio.run(run())
    assert len(batch) == 2 and failures.total == failures.counts["store"] == len(failed) >= 1
    lost = {t.group_id for e in failed for t in e.trajectories}
    # the sink is this file's code, so the message names its line, as it would a user's own store
    shown = r"store: (\w+): OSError: disk full \(tests/rollout/test_controller\.py:\d+\)"
    assert sorted(re.fullmatch(shown, message).group(1) for message in failures.recent) == sorted(lost)
    assert not lost & {t.group_id for e in batch for t in e.trajectories}


class OneRewardTimesOut:
    """A workflow whose episodes score two samples, the second's reward timed out (as it does when Slurm's
    signal ends the reward worker scoring it)."""

    async def run(self, client, example):
        await asyncio.sleep(0)
        failed = {"reward_error_kind": ["timeout"], "reward_error": ["reward timed out after 5s"]}
        return [
            Trajectory([Segment([1], [2], [-0.5], [0])], group_id=example.uid, rewards=[Reward(1.0)]),
            Trajectory([Segment([1], [3], [-0.5], [0])], group_id=example.uid, rewards=[Reward(0.0)], metadata=failed),
        ]


@pytest.mark.parametrize("stopping", [False, True])
def test_after_the_stop_signal_an_episode_with_a_failed_reward_is_neither_counted_nor_trained(stopping):
    """Before the run's stop signal, the episode trains (the failed sample scoring 0) and its failure is
    counted; after it, the failure is the stop's doing: the episode is dropped, nothing counted."""
    stored = []

    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted by this workflow
            signal_seen = asyncio.Event()
            if stopping:
                signal_seen.set()
            controller = RolloutController(
                client,
                OneRewardTimesOut(),
                StalenessGate(1, 8, 1),
                examples(4),
                on_accept=stored.extend,
                stopping=signal_seen,
            )
            await controller.start()
            await wait_until(lambda: controller.started >= 3, 30, "three episodes started")
            await controller.stop()
            return controller.failures

    failures = asyncio.run(run())
    if stopping:
        assert stored == [] and failures.total == 0
    else:
        assert stored and failures.counts["reward_timeout"] == len(stored)
