"""The prefix cache: its radix tree against a naive model of the same rules, the embedded engine's tokens and
logprobs with the cache against an engine without it (multi-turn, batched, interrupted, across weight
updates), and ``cached_tokens`` as a client sees it: /generate on loopback, the ``openai`` client's usage
through the proxy, and the rollout client's session affinity across two servers.

Tolerance: logprobs with the cache within 1e-5 of those without (float32; measured up to 5e-7 on the tiny
model). Not exact: a cached position's keys were computed by the pass that first ran it (a decode step, or
a prefill of another width), whose matmuls may round in another order. Greedy and seeded tokens are equal.
"""

import asyncio
import gc
import weakref
from concurrent.futures import Future

import openai
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from areal_hpc.agents.chat import ChatGateway
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, Result, SamplingParams
from areal_hpc.rollout.prefix_cache import PrefixTree, low_mark
from areal_hpc.rollout.server import build_app
from tests.proxy_helpers import serving
from tests.waiting import wait_for

TOLERANCE = 1e-5
USER = [41, 7, 19]  # the tokens of a user's message between turns


# -- the radix tree against a naive model -----------------------------------------------------------------
class NaiveCache:
    """The rules spelled out on every prefix: which are held, when each was last used, how many pins each
    has; eviction drops the least recently used unpinned prefix that nothing held extends, one token at a time."""

    def __init__(self, budget: int):
        self.budget, self.used, self.pins, self.clock = budget, {}, {}, 0

    def match(self, tokens: list[int]) -> int:
        self.clock += 1
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.used:
            n += 1
            self.used[tuple(tokens[:n])] = self.clock
        return n

    def insert(self, tokens: list[int]) -> None:
        self.match(tokens)
        for n in range(1, len(tokens) + 1):
            self.used[tuple(tokens[:n])] = self.clock

    def pin(self, prefix: tuple, by: int) -> None:
        for n in range(1, len(prefix) + 1):
            self.pins[prefix[:n]] = self.pins.get(prefix[:n], 0) + by

    def evict(self) -> None:
        if len(self.used) <= self.budget:
            return
        while len(self.used) > low_mark(self.budget):
            ends = [p for p in self.used if not self.pins.get(p) and not any(q[:-1] == p for q in self.used)]
            if not ends:
                return
            del self.used[min(ends, key=self.used.get)]


def held_prefixes(tree: PrefixTree) -> set[tuple]:
    """Every prefix the tree holds, read from its nodes."""
    out = set()
    for node in tree._nodes():
        path, above = list(node.tokens), node.parent
        while above is not None:
            path[:0] = above.tokens
            above = above.parent
        out.update(tuple(path[:n]) for n in range(1, len(path) + 1))
    return out


sequences = st.lists(st.integers(0, 2), max_size=6)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences),
        st.tuples(st.sampled_from(["match", "pin"]), st.one_of(sequences, st.integers(0, 10))),  # int: an inserted one
        st.tuples(st.just("unpin"), st.integers(0, 10)),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=300)
@given(budget=st.integers(1, 10), ops=operations)
@example(budget=2, ops=[("insert", [0]), ("insert", [1]), ("match", 0), ("insert", [2])])  # a match is a use
@example(budget=1, ops=[("insert", [0]), ("pin", 0), ("insert", [1])])  # the pinned one is older, and stays
def test_the_tree_holds_matches_and_evicts_as_the_naive_model(budget, ops):
    """Longest-prefix match over what was inserted and not evicted, least recently used evicted down to
    the low mark once past the budget, pinned prefixes never evicted; every matched prefix's payloads
    (each token's position and id) put back together spell it, across splits and trims."""
    tree = PrefixTree(budget, lambda payload, k: (payload[:k], payload[k:]))
    naive, pinned, inserted = NaiveCache(budget), [], []
    for op, arg in ops:
        if op == "insert":
            tree.insert(arg, lambda start, end, tokens=arg: [(i, tokens[i]) for i in range(start, end)])
            naive.insert(arg)
            inserted.append(arg)
            tree.evict()
            naive.evict()
        elif op in ("match", "pin") and (isinstance(arg, list) or inserted):
            arg = arg if isinstance(arg, list) else inserted[arg % len(inserted)]
            matched, node = tree.match(arg)
            assert matched == naive.match(arg)
            assert [x for _, payload in tree.segments(node) for x in payload] == list(enumerate(arg[:matched]))
            if op == "pin":
                tree.pin(node)
                naive.pin(tuple(arg[:matched]), 1)
                pinned.append((node, tuple(arg[:matched])))
        elif op == "unpin" and pinned:
            node, prefix = pinned.pop(arg % len(pinned))
            tree.unpin(node)
            naive.pin(prefix, -1)
        elif op == "clear":
            tree.clear()
            naive, pinned = NaiveCache(budget), []
        assert held_prefixes(tree) == set(naive.used) and tree.size == len(naive.used)
        assert all(prefix in naive.used for _, prefix in pinned if prefix)


class Payload:
    """The tokens of a node's run, in an object a weak reference can watch."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens


def test_a_cleared_trees_payloads_are_freed_at_once_but_those_of_a_held_node():
    """With the cyclic garbage collector off, clearing frees every payload nothing else refers to (a
    server's keys and values must not wait for a collection), while a node a caller still holds keeps
    the payloads of its path, which ``segments`` reads."""
    tree = PrefixTree(100, lambda payload, k: (Payload(payload.tokens[:k]), Payload(payload.tokens[k:])))
    for tokens in ([1, 2, 3, 4], [1, 2, 5], [6, 7]):
        tree.insert(tokens, lambda start, end, tokens=tokens: Payload(tokens[start:end]))
    _, held = tree.match([1, 2, 3])
    watched = {tuple(node.payload.tokens): weakref.ref(node.payload) for node in tree._nodes()}
    gc.disable()
    try:
        tree.clear()
        alive = sorted(tokens for tokens, ref in watched.items() if ref() is not None)
    finally:
        gc.enable()
    assert alive == [(1, 2), (3,)]
    assert [payload.tokens for _, payload in tree.segments(held)] == [[1, 2], [3]]
    assert tree.match([1, 2, 3]) == (0, tree._root)


# -- the engine with and without the cache ----------------------------------------------------------------
def engine_of(model_dir, cache_mb: float) -> EmbeddedGenerator:
    return EmbeddedGenerator(
        load_model(model_dir), slots=4, context_length=256, eos_token_ids=[], prefix_cache_mb=cache_mb
    )


@pytest.fixture
def engines(tiny_model_dir):
    """(an engine with a prefix cache, one without), on the same weights."""
    pair = engine_of(tiny_model_dir, 16), engine_of(tiny_model_dir, 0)
    yield pair
    for engine in pair:
        engine.stop()


def submit(engine: EmbeddedGenerator, prompt: list[int], params: SamplingParams, rid: str = "r") -> Future:
    """Queue one request; its ``Result`` comes in the future."""
    future: Future = Future()
    engine.submit(Request(rid, prompt, params, future.set_result))
    return future


def run_together(engine: EmbeddedGenerator, prompts: list[list[int]], params: list[SamplingParams]) -> list[Result]:
    """The prompts admitted in one prefill (queued while the engine is paused), their results in order."""
    engine.pause().result()
    futures = [submit(engine, p, s, f"r{i}") for i, (p, s) in enumerate(zip(prompts, params))]
    engine.resume().result()
    return [f.result(60) for f in futures]


def assert_same(cached: list[Result], plain: list[Result]) -> None:
    for a, b in zip(cached, plain):
        assert a.error is None and b.error is None and a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOLERANCE, rtol=0)


SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=3)


def test_a_multi_turn_batch_with_the_cache_generates_what_one_without_does(engines):
    """Four conversations of four turns, each turn's prompts prefilled together: two sampled with one seed (the
    same prompts, run once and copied into both rows), one with another seed and shorter answers, one greedy.
    The cached prefix of each later turn is the conversation so far but its last generated token."""
    cached_engine, plain_engine = engines
    params = [
        SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=1),
        SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=1),
        SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=2),
        SamplingParams(max_new_tokens=7, temperature=0.0),
    ]
    contexts = [[5, 17, 33, 2, 9, 44] for _ in params]
    for turn in range(4):
        cached, plain = (run_together(engine, contexts, params) for engine in engines)
        assert_same(cached, plain)
        expected = [0 if turn == 0 else len(context) - len(USER) - 1 for context in contexts]
        assert [r.cached_tokens for r in cached] == expected and [r.cached_tokens for r in plain] == [0] * 4
        contexts = [context + r.output_ids + USER for context, r in zip(contexts, cached)]
    assert cached[0].output_ids == cached[1].output_ids != cached[2].output_ids
    assert cached_engine.prompt_tokens["prefilled"] < plain_engine.prompt_tokens["prefilled"] / 2


def perturbed_state(model_dir) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = load_model(model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model, model.state_dict()


@pytest.mark.parametrize("path", ["disk", "distributed"])
def test_a_weight_update_empties_the_cache(engines, tiny_model_dir, tmp_path, path):
    """Whichever way new weights arrive (a checkpoint folder, or buckets of tensors), the next turn takes
    nothing from the cache and generates as an engine without one does on the new weights; the turn after
    takes the new weights' keys from it again."""
    model, state = perturbed_state(tiny_model_dir)
    if path == "disk":
        folder = save_model(model, load_tokenizer(tiny_model_dir), tmp_path / "new")
    context = [5, 17, 33, 2, 9]
    for turn in range(4):
        if turn == 2:
            for engine in engines:
                update = (
                    engine.update_weights_from_disk(folder)
                    if path == "disk"
                    else engine.update_weights(state, None, complete=False)
                )
                update.result()
        cached, plain = (submit(engine, context, SAMPLED).result(60) for engine in engines)
        assert_same([cached], [plain])
        assert cached.weight_version == (1 if turn >= 2 else 0)
        assert (cached.cached_tokens > 0) == (turn in (1, 3))
        context += cached.output_ids + USER


def test_an_interrupted_generation_leaves_only_keys_of_the_weights_it_continues_with(engines, tiny_model_dir):
    """A generation cut short by a pause leaves its partial output's keys, and its continuation (prompt and
    partial output) takes all of them and generates as it would without the cache; a generation that runs
    across a weight update leaves nothing (its keys mix two versions): what continues it prefills all."""
    cached_engine = engines[0]
    long = SamplingParams(max_new_tokens=200, temperature=1.0, sampling_seed=5)  # far more than a pause lets it

    def interrupted(prompt: list[int], meanwhile=lambda: None) -> Result:
        running = submit(cached_engine, prompt, long)
        wait_for(lambda: cached_engine.running, "the request running")
        meanwhile()
        cached_engine.pause().result()
        cached_engine.resume().result()
        result = running.result(60)
        assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 200
        return result

    prompt = [5, 17, 33, 2, 9]
    resumed = prompt + interrupted(prompt).output_ids
    rest = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=5)
    cached, plain = (submit(engine, resumed, rest).result(60) for engine in engines)
    assert cached.cached_tokens == len(resumed) - 1 and plain.cached_tokens == 0
    assert_same([cached], [plain])

    def update() -> None:
        cached_engine.update_weights(perturbed_state(tiny_model_dir)[1], None, complete=False).result()
        passes = cached_engine.forward_passes
        wait_for(lambda: cached_engine.forward_passes > passes + 1, "tokens of the new weights")

    other = [9, 3, 27, 14]
    across = interrupted(other, update)
    assert set(across.versions) == {0, 1}
    after = submit(cached_engine, other + across.output_ids + USER, SAMPLED).result(60)
    assert after.cached_tokens == 0


# -- what clients see ----------------------------------------------------------------------------------------
def test_cached_tokens_reach_generate_replies_and_the_openai_clients_usage(engines, tiny_model_dir):
    """``meta_info.cached_tokens`` on /generate of a server on loopback (0 again after /flush_cache), and the
    same count as ``usage.prompt_tokens_details.cached_tokens`` of a conversation's second turn through the
    proxy's chat route, as the real ``openai`` client parses it."""
    engine = engines[0]
    with serving(build_app(engine, str(tiny_model_dir), load_tokenizer(tiny_model_dir))) as (base, run):
        address = base.removeprefix("http://")

        async def talk():
            async with (
                RolloutClient([address]) as client,
                ChatGateway(client.generate, tiny_model_dir, default_max_tokens=6) as chat,
            ):
                prompt, sampling = [5, 17, 33, 2, 9], {"max_new_tokens": 6, "temperature": 0.0}

                async def generate(input_ids):
                    body = {"input_ids": input_ids, "sampling_params": sampling}
                    return await client.post(address, "/generate", body)

                first = await generate(prompt)
                then = prompt + first["output_ids"] + USER
                second = await generate(then)
                await client.post(address, "/flush_cache", {})
                third = await generate(then)
                counts = [reply["meta_info"]["cached_tokens"] for reply in (first, second, third)]
                assert counts == [0, len(prompt) + len(first["output_ids"]) - 1, 0]

                agent = chat.client({})
                messages = [{"role": "user", "content": "What is 2+3?"}]
                replies = []
                for _ in range(2):
                    reply = await agent.chat.completions.create(
                        model=chat.model_name, messages=messages, max_tokens=6, temperature=0
                    )
                    replies.append(reply)
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                    messages += [{"role": "user", "content": "Try again."}]
                [turn1, turn2] = agent.session.turns
                assert isinstance(replies[1].usage, openai.types.CompletionUsage)
                assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [
                    0,
                    len(turn1.prompt_ids) + len(turn1.output_ids) - 1,
                ]
                assert turn2.prompt_ids[: len(turn1.full_ids)] == turn1.full_ids

        run(talk())


def test_a_conversations_next_turn_goes_to_the_server_that_holds_it(tiny_model_dir):
    """Two servers: two conversations started together go one to each (fewest outstanding requests); each
    next turn, sent alone (both idle, where the fewest-outstanding rule alone picks the first server), goes to
    the server that ran the conversation and finds it in its cache."""
    engines = [engine_of(tiny_model_dir, 16) for _ in range(2)]
    apps = [build_app(engine, str(tiny_model_dir)) for engine in engines]
    try:
        with serving(apps[0]) as (base0, run), serving(apps[1]) as (base1, _):
            servers = [base.removeprefix("http://") for base in (base0, base1)]

            async def talk():
                async with RolloutClient(servers) as client:
                    sampling = {"max_new_tokens": 6, "temperature": 0.0}
                    prompts = [[5, 17, 33, 2, 9], [8, 1, 40, 22]]
                    firsts = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                    assert sorted(g.server for g in firsts) == sorted(servers)
                    for prompt, first in zip(prompts, firsts):
                        then = await client.generate(prompt + first.output_ids + USER, sampling)
                        assert then.server == first.server
                        assert then.cached_tokens == len(prompt) + len(first.output_ids) - 1

            run(talk())
    finally:
        for engine in engines:
            engine.stop()
