"""Rollouts that keep failing stop the run with one line naming the cause and the last error.

The four failures seen in real runs, each against real parts: a server answering 500 to everything
(a small aiohttp app on loopback), a full disk in the shard commit (a writer whose flush raises
ENOSPC, wired by ``build_controller``), prompts longer than the context (a real embedded server
with a short context), a reward raising (or hanging) on every input (real reward workers). Also:
the budget itself (property test), counts by kind with the first message of each (a workflow's with the
user's file and line), DAPO-rejected groups, and the shard writer and consumer closed when the driver ends
without the close hiding why it ended.
"""

import asyncio
import contextlib
import errno
import os
from pathlib import Path

import h5py
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.agents.engine import Sampling
from areal_hpc.config import load_config
from areal_hpc.data.prompts import PromptStream
from areal_hpc.data.registry import build_task
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.shards.writer import TrajectoryShardWriter
from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.client import NoServerError, RolloutClient, RolloutError
from areal_hpc.rollout.controller import FAILURE_KINDS, FailureBudget, FailureLog, RolloutController, RolloutFailure
from areal_hpc.rollout.staleness import StalenessGate
from areal_hpc.train.build import build_controller
from areal_hpc.train.rl_run import shards
from tests import rewards_for_tests
from tests.conftest import embedded_server
from tests.waiting import serve_on_loopback, wait_until
from tests.workflow_helpers import episode_groups

# -- the budget and the log ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    outcomes=st.lists(st.booleans(), max_size=120),
    max_consecutive=st.integers(0, 8),
    window=st.integers(1, 20),
    max_rate=st.floats(0.05, 1.0),
)
def test_budget_is_spent_exactly_when_a_limit_is_crossed(outcomes, max_consecutive, window, max_rate):
    budget, in_a_row = FailureBudget(max_consecutive, window, max_rate), 0
    for i, failed in enumerate(outcomes):
        budget.record(failed)
        in_a_row = in_a_row + 1 if failed else 0
        expected = (max_consecutive > 0 and in_a_row >= max_consecutive) or (
            i + 1 >= window and sum(outcomes[i + 1 - window : i + 1]) > max_rate * window
        )
        assert (budget.spent() is not None) == expected
    if max_rate == 1.0 and max_consecutive == 0:
        assert budget.spent() is None  # both limits off: never spent


def test_failure_log_keeps_counts_the_first_of_each_kind_and_a_few_one_line_messages():
    log = FailureLog()
    for i in range(10_000):
        log.add("server_error" if i % 3 else "store", f"e{i}: line one\nline two")
    assert log.total == 10_000 and log.counts["store"] == 3334 and log.counts["server_error"] == 6666
    assert len(log.recent) <= 8 and all("\n" not in m for m in log.recent)
    assert log.recent[-1] == "store: e9999: line one line two"
    assert log.first == {"store": "e0: line one line two", "server_error": "e1: line one line two"}
    assert log.summary() == "server_error 6666, store 3334"


# -- helpers ---------------------------------------------------------------------------------------


def examples(n: int, prompt: str = "{i} + {i} = ?") -> list[Example]:
    return [Example(f"e{i}", prompt.format(i=i), str(2 * i), str(2 * i)) for i in range(n)]


async def until_stopped(controller: RolloutController, timeout: float = 120) -> RolloutError:
    """Run the controller until rollouts stop for good; the error ``prepare_batch`` raised."""
    await controller.start()
    try:
        with pytest.raises(RolloutError) as raised:
            await asyncio.wait_for(controller.prepare_batch(10_000), timeout)
        await wait_until(
            lambda: not (controller.submitting or controller.gate.running),
            30,
            "the submit loop to end (nothing new starts) and the last episodes to finish",
            seen=lambda: f"submitting: {controller.submitting}, running: {controller.gate.running}",
        )
        return raised.value
    finally:
        await controller.stop()


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and len(message) < 1200
    return message


@contextlib.asynccontextmanager
async def answering_500(health_status: int):
    """A server that answers 500 to every /generate (and ``health_status`` to /health)."""
    calls = {"generate": 0}

    async def generate(request):
        calls["generate"] += 1
        return web.json_response(
            {"error": {"message": "CUDA error: an illegal memory access", "code": 500}}, status=500
        )

    async def health(request):
        return web.json_response({}, status=health_status)

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/health", health)])
    async with serve_on_loopback(app) as address:
        yield address, calls


# -- the four observed failures ----------------------------------------------------------------------


def test_a_server_answering_500_to_generate_spends_the_budget(tiny_model_dir):
    async def run():
        async with answering_500(health_status=200) as (server, calls), RolloutClient([server]) as client:
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                workflow = episode_groups(load_tokenizer(tiny_model_dir), pool, Sampling(4), 2)
                controller = RolloutController(
                    client, workflow, StalenessGate(2, 0, 4), examples(8), budget=FailureBudget(max_consecutive=5)
                )
                return await until_stopped(controller), controller, calls["generate"]

    error, controller, generate_calls = asyncio.run(run())
    assert isinstance(error, RolloutFailure)
    message = one_line(error)
    assert message.startswith("rollouts keep failing: 5 episodes in a row failed (server_error ")
    assert "/generate answered 500: CUDA error: an illegal memory access" in message
    assert (
        controller.failures.counts["server_error"] >= 5
        and controller.failures.total == controller.failures.counts["server_error"]
    )
    assert generate_calls <= controller.failures.total * 2  # no retry storm: a live server's 500 is not retried


def test_a_server_answering_500_to_everything_is_dropped_and_rollouts_stop(tiny_model_dir):
    async def run():
        async with answering_500(health_status=500) as (server, _), RolloutClient([server]) as client:
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                workflow = episode_groups(load_tokenizer(tiny_model_dir), pool, Sampling(4), 2)
                controller = RolloutController(client, workflow, StalenessGate(2, 0, 4), examples(8))
                return await until_stopped(controller), client.alive

    error, alive = asyncio.run(run())
    assert isinstance(error, NoServerError) and alive == []
    assert one_line(error).startswith("every rollout server is unhealthy or unreachable (last: 127.0.0.1:")
    assert "answered 500: CUDA error" in str(error)


class FullDiskWriter(TrajectoryShardWriter):
    """A shard writer on a full disk: every commit fails as HDF5 would, with ENOSPC."""

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_in_the_shard_commit_spends_the_budget(tiny_model_dir, tmp_path):
    cfg = load_config(
        None,
        [
            f"cluster.fileroot={tmp_path}",
            "dataset.train_size=32",
            "generation.n_samples=2",
            "generation.max_new_tokens=4",
            "rollout.consumer_batch_size=2",
            "rollout.failure_budget.max_consecutive=4",
        ],
    )
    task = build_task(cfg.dataset)

    async def run(server):
        async with RolloutClient([server]) as client:
            with RewardPool(task.reward) as pool:
                groups = episode_groups(load_tokenizer(tiny_model_dir), pool, Sampling(4), 2, task_name=task.name)
                controller = build_controller(
                    cfg,
                    client,
                    groups,
                    PromptStream(task.train, 0, 0),
                    FullDiskWriter(tmp_path / "shards", "rollout"),
                    0,
                    on_drop=None,
                )
                return await until_stopped(controller), controller

    with embedded_server(tiny_model_dir, tmp_path) as (_, server):
        error, controller = asyncio.run(run(server))
    assert isinstance(error, RolloutFailure)
    assert one_line(error).startswith("rollouts keep failing: 4 episodes in a row failed (store ")
    assert "OSError: [Errno 28] No space left on device" in str(error)
    assert controller.failures.counts["store"] >= 4


def test_prompts_longer_than_the_context_spend_the_budget(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    long_prompt = "Tom has {i} apples and " + "gives one to a friend, then " * 20 + "how many are left?"

    async def run(server):
        async with RolloutClient([server]) as client:
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                workflow = episode_groups(tokenizer, pool, Sampling(4), 2)
                controller = RolloutController(
                    client,
                    workflow,
                    StalenessGate(2, 0, 4),
                    examples(8, long_prompt),
                    budget=FailureBudget(max_consecutive=3),
                )
                return await until_stopped(controller), controller

    with embedded_server(tiny_model_dir, tmp_path, "rollout.context_length=48") as (_, server):
        error, controller = asyncio.run(run(server))
    message = one_line(error)
    assert message.startswith("rollouts keep failing: 3 episodes in a row failed (rejected ")
    assert "/generate answered 400: too many tokens" in message and "> context length 48" in message
    assert controller.failures.counts["rejected"] >= 3


@pytest.mark.parametrize(
    "reward_fn, kind, other, words",
    [
        (
            rewards_for_tests.raises_always,
            "reward_exception",
            "reward_timeout",
            "reward raised ValueError: reward code",
        ),
        (rewards_for_tests.hangs_always, "reward_timeout", "reward_exception", "reward timed out after 1s"),
    ],
)
def test_a_reward_failing_on_every_input_spends_the_budget(tiny_model_dir, tmp_path, reward_fn, kind, other, words):
    """Today such a run trained on all-zero rewards and never said so. Raising and hanging are
    counted apart (a count per reward call); an episode whose every reward failed is not trained."""

    async def run(server):
        async with RolloutClient([server]) as client:
            with RewardPool(reward_fn, timeout_s=1.0) as pool:
                workflow = episode_groups(load_tokenizer(tiny_model_dir), pool, Sampling(4), 2)
                accepted = []
                controller = RolloutController(
                    client,
                    workflow,
                    StalenessGate(2, 0, 2),
                    examples(8),
                    on_accept=accepted.extend,
                    budget=FailureBudget(max_consecutive=2),
                )
                return await until_stopped(controller, timeout=180), controller, accepted

    with embedded_server(tiny_model_dir, tmp_path) as (_, server):
        error, controller, accepted = asyncio.run(run(server))
    message = one_line(error)
    assert message.startswith("rollouts keep failing: 2 episodes in a row failed (")
    assert "every reward failed" in message and words in message
    assert controller.failures.counts[kind] >= 4 and controller.failures.counts[other] == 0
    assert accepted == []  # nothing was queued for training (or stored)


# -- partial failures and filtered groups keep the run going --------------------------------------------


class ScriptedWorkflow:
    """A workflow (user extension point) returning canned groups: ``failed(uid)`` rewards of each fail (as
    ``kind``: "exception", "timeout" or "invalid"); the episode of each uid in ``raises_on`` raises."""

    def __init__(self, failed, kind: str = "exception", raises_on: tuple[str, ...] = ()):
        self.failed, self.kind, self.raises_on = failed, kind, raises_on

    async def run(self, client, example):
        await asyncio.sleep(0)
        if example.uid in self.raises_on:
            raise KeyError("no answer field")  # RAISED HERE
        group = [
            Trajectory([Segment([1], [2], [-0.5], [0])], group_id=example.uid, rewards=[Reward(float(i % 2), step=0)])
            for i in range(4)
        ]
        n_failed = self.failed(example.uid)
        for trajectory in group[:n_failed]:
            trajectory.rewards = [Reward(0.0, step=0)]
            trajectory.metadata.update(reward_error=["reward raised KeyError: 'x'"], reward_error_kind=[self.kind])
        return group


def test_an_episode_with_some_failed_rewards_is_trained_and_its_failures_counted():
    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted by this workflow
            controller = RolloutController(
                client,
                ScriptedWorkflow(lambda uid: 3),
                StalenessGate(2, 0, 4),
                examples(8),
                budget=FailureBudget(max_consecutive=1),
            )
            await controller.start()
            batch = await asyncio.wait_for(controller.prepare_batch(2), timeout=30)
            await controller.stop()
            return batch, controller

    batch, controller = asyncio.run(run())
    assert len(batch) == 2 and controller.budget.consecutive == 0
    assert controller.failures.counts["reward_exception"] >= 3 * 2 and controller.failures.total % 3 == 0
    assert controller.counters()["rollout/failures/reward_exception"] == controller.failures.counts["reward_exception"]


def test_invalid_rewards_and_a_raising_workflow_are_counted_by_kind_and_the_first_names_the_users_line():
    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted by this workflow
            workflow = ScriptedWorkflow(lambda uid: 1, "invalid", raises_on=("e3",))
            controller = RolloutController(client, workflow, StalenessGate(4, 0, 8), examples(8))
            await controller.start()
            await asyncio.wait_for(controller.prepare_batch(4), timeout=30)
            await wait_until(lambda: controller.failures.counts["workflow"], 30, "e3's episode to fail")
            await controller.stop()
            return controller

    controller = asyncio.run(run())
    line = 1 + next(i for i, text in enumerate(Path(__file__).read_text().splitlines()) if "# RAISED HERE" in text)
    where = f"{os.path.relpath(__file__)}:{line}"
    assert controller.failures.first["workflow"] == f"e3: KeyError: 'no answer field' ({where})"
    assert controller.failures.first["reward_invalid"].endswith(": reward raised KeyError: 'x'")
    counters = controller.counters()
    assert counters["rollout/failures/reward_invalid"] == controller.failures.counts["reward_invalid"] >= 4
    assert counters["rollout/failures/workflow"] >= 1 and counters["rollout/failures/reward_exception"] == 0


def test_dapo_rejected_groups_are_counted_not_failed():
    def informative(group):  # DAPO's filter on e0, e2, ...: all-equal rewards
        return int(group[0].group_id[1:]) % 2 == 1

    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:
            controller = RolloutController(
                client,
                ScriptedWorkflow(lambda uid: 0),
                StalenessGate(4, 0, 8),
                examples(8),
                accept=informative,
                budget=FailureBudget(max_consecutive=1),
            )
            await controller.start()
            batch = await asyncio.wait_for(controller.prepare_batch(4), timeout=30)
            await wait_until(
                lambda: not controller.gate.running,
                30,
                "e0, e2, e4, e6 (started before e7) to end",
                seen=lambda: f"{controller.gate.running} episodes running",
            )
            await controller.stop()
            return batch, controller

    batch, controller = asyncio.run(run())
    assert all(int(e.trajectories[0].group_id[1:]) % 2 == 1 for e in batch)
    assert controller.filtered >= 4 and controller.failures.total == 0
    counters = controller.counters()
    assert counters["rollout/filtered_total"] == controller.filtered
    assert {f"rollout/failures/{kind}" for kind in FAILURE_KINDS} <= counters.keys()


# -- the driver's shards -----------------------------------------------------------------------------


def open_hdf5_files() -> int:
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


def test_the_driver_closes_its_shard_writer_and_store(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}"])
    before = open_hdf5_files()
    with shards(cfg, {}) as (writer, consumer):
        writer.append(Trajectory([Segment([1], [2], [-0.5], [0])], group_id="g"))
        writer.flush()
        assert len(consumer.pending()) == 1 and open_hdf5_files() > before
    assert open_hdf5_files() == before
    assert [p.name for p in (cfg.run_dir / "shards").glob("*.h5")] == ["rollout-000000.h5"]  # finalised


def test_a_writer_that_cannot_commit_at_the_end_does_not_hide_why_the_run_stopped(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}"])
    with pytest.raises(RolloutFailure, match="rollouts keep failing"), shards(cfg, {}) as (writer, consumer):
        writer.append(Trajectory([Segment([1], [2], [-0.5], [0])], group_id="g"))
        writer.flush()
        assert len(consumer.pending()) == 1
        writer.append(Trajectory([Segment([1], [3], [-0.5], [0])], group_id="h"))
        writer.flush = FullDiskWriter.flush.__get__(writer)  # the disk filled up: the last commit fails
        raise RolloutFailure("rollouts keep failing: 4 episodes in a row failed (store 4)")
