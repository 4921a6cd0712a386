"""One /generate per GRPO group: the first turns of a group's samples go to a rollout server as one
batched request (SGLang's list form, a sampling seed per sample), and generate what one request each
would; a batch cut short by a pause resumes each sample from its own output; the rewards of one turn
of the event loop are one call of the reward pool. An evaluation's examples go in batches of at most
``EVAL_BATCH``, and one the server refuses fails alone."""

import asyncio

import pytest

from areal_hpc.agents.engine import EpisodeSettings, SameTickCalls, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups
from areal_hpc.agents.rlvr import RLVRWorkflow
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.client import Generation, RolloutClient, ServerReplyError
from areal_hpc.train.evaluate import EVAL_BATCH, evaluate
from tests import rewards_for_tests
from tests.conftest import embedded_server
from tests.waiting import model_info, wait_until

PROMPTS = [[5, 17, 33, 2, 9], [5, 17, 33, 2, 9], [3, 4, 5]]


def test_a_batch_generates_what_its_requests_generate_one_by_one(tiny_model_dir, tmp_path):
    samplings = [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": seed} for seed in (11, 12, 13)]

    async def run(server):
        async with RolloutClient([server]) as client:
            batched = await client.generate_batch(PROMPTS, samplings)
            alone = [await client.generate(ids, sampling) for ids, sampling in zip(PROMPTS, samplings)]
            with pytest.raises(ServerReplyError, match="sampling_params is a list of 2; give one object, or one per"):
                await client.post(server, "/generate", {"input_ids": PROMPTS, "sampling_params": samplings[:2]})
            return batched, alone

    # one slot: a row's logits do not depend on what else is decoded with it; no prefix cache: nor on which
    # request computed its prompt's keys
    with embedded_server(tiny_model_dir, tmp_path, "rollout.max_running_requests=1", "rollout.prefix_cache_mb=0") as (
        _,
        server,
    ):
        batched, alone = asyncio.run(run(server))
    for b, a in zip(batched, alone):
        assert (b.input_ids, b.output_ids, b.logprobs, b.versions) == (
            a.input_ids,
            a.output_ids,
            a.logprobs,
            a.versions,
        )
        assert b.finish_reason == a.finish_reason and b.interruptions == 0
    assert batched[0].output_ids != batched[1].output_ids  # the same prompt, its own seed


def test_a_paused_batch_resumes_each_sample_from_its_own_output(tiny_model_dir, tmp_path):
    budget = 400

    async def run(server):
        async with RolloutClient([server]) as client:
            samplings = [{"max_new_tokens": budget, "ignore_eos": True, "sampling_seed": s} for s in range(3)]
            # the batch waits in the paused server's queue (a state that lasts) ...
            await client.post(server, "/pause_generation", {"mode": "abort"})
            batch = asyncio.create_task(client.generate_batch(PROMPTS, samplings))
            await wait_until(
                lambda: _waiting(server, 3),
                what="the batch to wait in the paused server's queue",
                seen=lambda: model_info(server),
            )
            # ... until it continues: two slots' samples are admitted and given first tokens before the
            # engine takes the client's pause, which returns those two with their tokens and the third
            await client.post(server, "/continue_generation", {})
            await client.pause()
            await client.resume()
            return await asyncio.wait_for(batch, timeout=120)

    with embedded_server(tiny_model_dir, tmp_path, "rollout.max_running_requests=2") as (_, server):
        generations = asyncio.run(run(server))
    assert [g.input_ids for g in generations] == PROMPTS
    assert all(len(g.output_ids) == len(g.logprobs) == len(g.versions) == budget for g in generations)
    assert all(g.finish_reason == "length" for g in generations)
    assert sum(g.interruptions for g in generations) >= 2  # the two decoding when it paused


async def _waiting(server: str, count: int) -> bool:
    return (await model_info(server))["waiting_requests"] == count


class BatchingClient:
    """A stand-in client that answers every generation with the same completion and counts requests."""

    def __init__(self, completion: list[int]):
        self.completion, self.requests = completion, []

    async def generate(self, input_ids, params) -> Generation:
        self.requests.append([params])
        return self._answer(input_ids)

    async def generate_batch(self, prompts, samplings) -> list[Generation]:
        self.requests.append(samplings)
        return [self._answer(ids) for ids in prompts]

    def _answer(self, input_ids) -> Generation:
        n = len(self.completion)
        return Generation(list(input_ids), list(self.completion), [-0.5] * n, [0] * n, "stop")


class CountingPool:
    def __init__(self, pool: RewardPool):
        self.pool, self.calls = pool, []

    def score(self, requests):
        self.calls.append(len(requests))
        return self.pool.score(requests)


@pytest.mark.parametrize("batched", [True, False])
def test_a_group_asks_one_request_and_one_reward_call_and_records_the_same(tiny_model_dir, batched):
    tokenizer = load_tokenizer(tiny_model_dir)
    completion = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]
    client = BatchingClient(completion)
    with RewardPool(rewards_for_tests.exact_answer) as pool:
        counting = CountingPool(pool)

        def settings(client_):
            return EpisodeSettings(
                client_.generate,
                tokenizer,
                Sampling(4),
                Scorer(counting),
                generate_batch=client_.generate_batch if batched else None,
            )

        groups = EpisodeGroups(RLVRWorkflow(), settings, 4, "arithmetic", seed=1)
        records = asyncio.run(groups.run(client, Example("e1", "What is 2+3?", answer="5")))
    assert [len(r) for r in client.requests] == ([4] if batched else [1, 1, 1, 1])
    seeds = [params["sampling_seed"] for request in client.requests for params in request]
    assert len(set(seeds)) == 4  # every sample its own seed, batched or not
    assert counting.calls == [4]  # the four rewards, answered together, in one call of the pool
    assert [r.reward for r in records] == [1.0] * 4 and all(r.group_id == records[0].group_id for r in records)
    assert [list(r.segments[-1].output_ids) for r in records] == [completion] * 4


def test_same_tick_batch_runs_one_call_per_turn_and_shares_its_outcome():
    runs = []

    async def run(items):
        runs.append(list(items))
        await asyncio.sleep(0)
        if "bad" in items:
            raise ValueError("bad item")
        return [item * 2 for item in items]

    async def main():
        batch = SameTickCalls(run)
        together = await asyncio.gather(batch("a"), batch("b"), batch("c"))
        later = await batch("d")
        failed = await asyncio.gather(batch("x"), batch("bad"), return_exceptions=True)
        return together, later, failed

    together, later, failed = asyncio.run(main())
    assert runs == [["a", "b", "c"], ["d"], ["x", "bad"]]
    assert together == ["aa", "bb", "cc"] and later == "dd"
    assert all(isinstance(e, ValueError) for e in failed)


def test_same_tick_batch_is_cancelled_when_every_caller_left():
    started, gone, cancelled = asyncio.Event(), asyncio.Event(), []

    async def run(items):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(items)
            gone.set()
            raise

    async def main():
        batch = SameTickCalls(run)
        callers = [asyncio.create_task(batch(i)) for i in range(3)]
        await started.wait()
        callers[0].cancel()
        await asyncio.sleep(0.01)
        assert not cancelled  # two callers still wait for it
        for caller in callers[1:]:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await asyncio.wait_for(gone.wait(), 30)  # by the batch itself, not by asyncio.run's final clean-up

    asyncio.run(main())
    assert cancelled == [[0, 1, 2]]


def test_same_tick_batch_cuts_a_turn_into_batches_and_an_exception_returned_fails_its_own_call():
    runs = []

    async def run(items):
        runs.append(list(items))
        return [ValueError(f"bad {item}") if item == "bad" else item * 2 for item in items]

    async def main():
        batch = SameTickCalls(run, max_items=2)
        return await asyncio.gather(*(batch(item) for item in ["a", "bad", "c", "d", "e"]), return_exceptions=True)

    results = asyncio.run(main())
    assert runs == [["a", "bad"], ["c", "d"], ["e"]]
    assert results[0] == "aa" and isinstance(results[1], ValueError) and results[2:] == ["cc", "dd", "ee"]


def test_an_evaluation_batches_its_examples_and_a_prompt_the_server_refuses_fails_alone(tiny_model_dir, tmp_path):
    """Through a real server with a 48-token context (one slot: rows decode as they would alone): every
    example but the one whose prompt is over the context scores what it scores asked one at a time, in
    ceil(n / EVAL_BATCH) batched requests plus the refused batch's requests one by one."""
    tokenizer = load_tokenizer(tiny_model_dir)
    examples = [Example(f"e{i}", f"What is {i}+{i}?", answer=str(2 * i)) for i in range(EVAL_BATCH + 6)]
    examples[EVAL_BATCH + 2] = Example("long", "What is " + "1+" * 40 + "1?", answer="41")

    async def run(server, batched: bool):
        async with RolloutClient([server]) as client:
            counted = CountingClient(client)
            with RewardPool(rewards_for_tests.exact_answer, workers=0) as pool:
                settings = EpisodeSettings(
                    counted.generate,
                    tokenizer,
                    Sampling(4),
                    Scorer(pool),
                    generate_batch=counted.generate_batch if batched else None,
                )
                result = await evaluate(settings, RLVRWorkflow(), examples)
            return result, counted.sizes

    with embedded_server(
        tiny_model_dir,
        tmp_path,
        "rollout.max_running_requests=1",
        "rollout.context_length=48",
        "rollout.prefix_cache_mb=0",
    ) as (_, server):
        (batched, sizes), (alone, _) = asyncio.run(run(server, True)), asyncio.run(run(server, False))
    assert sizes == [EVAL_BATCH, 6] + [1] * 6  # the second batch, refused, asked again one by one
    assert batched.episode_failures == alone.episode_failures == 1
    failed = [e for e in batched.episodes if "error" in e]
    assert [e["example"] for e in failed] == ["long"] and "context" in failed[0]["error"]
    assert [(e["completion"], e["reward"]) for e in batched.episodes] == [
        (e["completion"], e["reward"]) for e in alone.episodes
    ]


class CountingClient:
    """A real ``RolloutClient`` that records how many generations each request it sends holds."""

    def __init__(self, client: RolloutClient):
        self.client, self.sizes = client, []

    async def generate(self, input_ids, params):
        self.sizes.append(1)
        return await self.client.generate(input_ids, params)

    async def generate_batch(self, prompts, samplings):
        self.sizes.append(len(prompts))
        return await self.client.generate_batch(prompts, samplings)


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_merged_groups_that_start_together_ask_one_request_per_server(tiny_model_dir, servers):
    """``rollout.merge_group_requests``: five groups of 4 started in one turn are one /generate per server
    (equal shares of whole samples), each group still its own records, seeds and rewards; unmerged,
    one per group."""
    tokenizer = load_tokenizer(tiny_model_dir)
    completion = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]
    examples = [Example(f"e{i}", "What is 2+3?", answer="5") for i in range(5)]
    outcomes = {}
    for merged in (True, False):
        client = BatchingClient(completion)
        client.alive = [f"server{k}" for k in range(servers)]
        with RewardPool(rewards_for_tests.exact_answer) as pool:

            def settings(client_):
                return EpisodeSettings(
                    client_.generate, tokenizer, Sampling(4), Scorer(pool), generate_batch=client_.generate_batch
                )

            groups = EpisodeGroups(RLVRWorkflow(), settings, 4, "arithmetic", seed=1, merge_groups=merged)

            async def run():
                return await asyncio.gather(*(groups.run(client, e) for e in examples))  # noqa: B023 - called within this iteration

            outcomes[merged] = client.requests, asyncio.run(run())
    (merged_requests, merged_groups), (requests, groups_alone) = outcomes[True], outcomes[False]
    assert [len(r) for r in requests] == [4] * 5
    assert sorted(len(r) for r in merged_requests) == sorted(20 // servers + (k < 20 % servers) for k in range(servers))
    for merged_records, records in zip(merged_groups, groups_alone):
        assert len({r.group_id for r in merged_records}) == 1 and len(merged_records) == 4
        assert [r.reward for r in merged_records] == [r.reward for r in records] == [1.0] * 4
    seeds = sorted(params["sampling_seed"] for request in merged_requests for params in request)
    assert seeds == sorted(params["sampling_seed"] for request in requests for params in request)
    assert len(set(seeds)) == 20


def test_a_turn_whose_callers_all_left_runs_nothing_and_raises_nothing():
    runs, errors = [], []

    async def run(items):
        runs.append(list(items))
        return items

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        batch = SameTickCalls(run, parts=lambda: 2)
        caller = asyncio.create_task(batch(1))
        await asyncio.sleep(0)  # it is waiting; the flush comes after this turn
        caller.cancel()
        await asyncio.sleep(0.01)
        return caller.cancelled()

    assert asyncio.run(main()) and runs == [] and errors == []
