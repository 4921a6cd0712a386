"""RolloutClient: control traffic never queues behind generation, and version tags from servers that
report ``weight_version`` as a string (SGLang: "default" until an update names one)."""

import asyncio
import contextlib
import time

from aiohttp import web

from areal_hpc.rollout.client import RolloutClient
from tests.conftest import embedded_server
from tests.rollout.test_server import post
from tests.waiting import model_info, serve_on_loopback, wait_until

IN_FLIGHT = 150  # more than aiohttp's default pool of 100 connections
SLOTS = 96  # sequences the server decodes at once; the others wait in its queue


def test_pause_returns_within_a_second_with_more_than_100_requests_in_flight(tiny_model_dir, tmp_path):
    async def run(server):
        async with RolloutClient([server], max_requests=IN_FLIGHT) as client:
            body = {
                "input_ids": [3, 4, 5],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            }
            # The server paused holds every request in its queue, so all of them arrive before any can finish
            # (a poll for "every slot decoding" could miss that window on a loaded machine). Once continued,
            # the engine starts the first SLOTS decoding before it takes its next command: the pause below.
            await asyncio.to_thread(post, server, "/pause_generation", {"mode": "abort"})
            posts = [
                asyncio.create_task(client.post(server, "/generate", {**body, "rid": f"r{i}"}))
                for i in range(IN_FLIGHT)
            ]

            async def all_queued():
                return (await model_info(server))["waiting_requests"] == IN_FLIGHT

            await wait_until(
                all_queued, what=f"{IN_FLIGHT} requests queued on the paused server", seen=lambda: model_info(server)
            )
            await asyncio.to_thread(post, server, "/continue_generation")
            started = time.monotonic()
            healthy = await client.healthy(server)
            probed = time.monotonic() - started
            await client.pause()
            paused = time.monotonic() - started - probed
            replies = await asyncio.wait_for(asyncio.gather(*posts), timeout=30)
            await client.resume()
            return healthy, probed, paused, replies

    with embedded_server(tiny_model_dir, tmp_path, f"rollout.max_running_requests={SLOTS}") as (_, server):
        healthy, probed, paused, replies = asyncio.run(run(server))
    assert healthy and probed < 1.0
    assert paused < 1.0
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in replies)
    partial = [len(r["output_ids"]) for r in replies if r["output_ids"]]
    assert len(partial) == SLOTS and all(n < 1000 for n in partial)  # every running one came back with its tokens
    assert all(len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"]) for r in replies)


@contextlib.asynccontextmanager
async def sglang_like_server(reported_version):
    """SGLang's reply shape: no per-token versions, ``weight_version`` a string. A request running
    when /pause_generation comes returns with finish reason abort and 2 tokens; one that arrives
    while paused waits for /continue_generation, then generates all it was asked for."""
    state = {"paused": asyncio.Event(), "resumed": asyncio.Event(), "arrived": asyncio.Event(), "updates": 0}

    async def generate(request):
        budget = (await request.json())["sampling_params"]["max_new_tokens"]
        state["arrived"].set()  # in the same turn as the check below: a pause after this finds it running
        if not state["paused"].is_set():
            await state["paused"].wait()
            n, reason = 2, "abort"
        else:
            await state["resumed"].wait()
            n, reason = budget, "length"
        return web.json_response(
            {
                "output_ids": [7] * n,
                "meta_info": {
                    "finish_reason": {"type": reason},
                    "weight_version": reported_version(state["updates"]),
                    "output_token_logprobs": [[-1.0, 7, None]] * n,
                },
            }
        )

    def route(event=None, count=False):
        async def handler(request):
            if event:
                state[event].set()
            state["updates"] += count
            return web.json_response({"success": True})

        return handler

    app = web.Application()
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/pause_generation", route("paused")),
            web.post("/continue_generation", route("resumed")),
            web.post("/update_weights_from_disk", route(count=True)),
            web.get("/health", route()),
        ]
    )
    async with serve_on_loopback(app) as address:
        yield address, state


def run_interrupted_generation(reported_version):
    """The run's first push (version 3), then a request cut short by a pause, the weights updated to
    version 4, and the request finished after the resume."""

    async def run():
        async with sglang_like_server(reported_version) as (server, state), RolloutClient([server]) as client:
            await client.update_weights_from_disk("/models/v3", 3)
            request = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 5}))
            # at the server, not only sent: the pause goes on another connection and could overtake it
            await asyncio.wait_for(state["arrived"].wait(), 30)
            await client.pause()
            await client.update_weights_from_disk("/models/v4", 4)
            await client.resume()
            return await asyncio.wait_for(request, timeout=30)

    return asyncio.run(run())


def test_default_string_version_is_tagged_with_the_version_pushed_last():
    """SGLang says "default" until an update names a version (and an SGLang that ignores the name
    keeps saying it): tokens are tagged with the version the client pushed and resumed the server on."""
    generation = run_interrupted_generation(lambda updates: "default")
    assert generation.output_ids == [7] * 5 and generation.finish_reason == "length"
    assert generation.versions == [3, 3, 4, 4, 4] and generation.interruptions == 1


def test_integer_string_versions_reported_by_the_server_are_used():
    generation = run_interrupted_generation(lambda updates: str(10 + updates))
    assert generation.versions == [11, 11, 12, 12, 12]  # the server's word wins
