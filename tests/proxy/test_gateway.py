"""The login-node proxy against a real embedded rollout server on loopback, driven by the real
``openai`` client: completions (whole and streamed), sessions whose turns become exact records in the
shards, tenant isolation, bad input, a backend dying mid-turn, and a bounded load test.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import numpy as np
import openai
import pytest
import yaml

from areal_hpc.data.shards import TrajectoryStore
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.proxy.tenants import hash_key
from tests.conftest import REPO, embedded_server
from tests.proxy_helpers import call, proxy_config, running_proxy, start_session, write_keys
from tests.rollout.test_server import in_background, paused, wait_queued

ALICE, BOB, LIMITED, LOAD = "tk-alice", "tk-bob", "tk-limited", "tk-load"
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("runs")) as (_, address):
        yield address


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_keys(
        path,
        {
            "alice": {"keys": [ALICE]},
            "bob": {"keys": [BOB]},
            "limited": {"keys": [LIMITED], "requests_per_minute": 2},
            "load": {"keys": [LOAD], "requests_per_minute": 0, "tokens_per_minute": 0},
        },
    )
    return path


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, server, keys_file, tmp_path_factory):
    cfg = proxy_config(
        tiny_model_dir,
        tmp_path_factory.mktemp("proxy"),
        [server],
        keys_file,
        "proxy.discount=0.5",
        "proxy.max_request_bytes=65536",
    )
    with running_proxy(cfg) as (base, state, run):
        yield base, state, run


def records(proxy_state) -> dict:
    with TrajectoryStore(proxy_state.sink.writer.directory) as store:
        return {t.id: t for t in store.trajectories()}


@pytest.mark.smoke
def test_openai_client_sync_async_and_streaming_get_the_servers_tokens(proxy, tiny_model_dir):
    base, state, _ = proxy
    _, key = start_session(base, ALICE)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True)
    turn = state.by_key[hash_key(key)].turns[-1]
    tokenizer = load_tokenizer(tiny_model_dir)  # transformers' own template rendering is the reference
    assert turn.prompt_ids == tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert whole.id == turn.interaction_id and whole.choices[0].message.content == tokenizer.decode(
        turn.output_ids, skip_special_tokens=True
    )
    assert [t.logprob for t in whole.choices[0].logprobs.content] == pytest.approx(turn.logprobs)
    assert whole.usage.prompt_tokens == len(turn.prompt_ids) and whole.usage.completion_tokens == len(turn.output_ids)

    streamed = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def async_calls():
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        replies = await asyncio.gather(
            *(
                aclient.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0)
                for _ in range(4)
            )
        )
        await aclient.close()
        return replies

    assert {r.choices[0].message.content for r in asyncio.run(async_calls())} == {whole.choices[0].message.content}

    text = client.completions.create(model="tiny", prompt="2+3=", max_tokens=4, temperature=0, logprobs=0)
    by_ids = client.completions.create(model="tiny", prompt=tokenizer("2+3=")["input_ids"], max_tokens=4, temperature=0)
    assert text.choices[0].text == by_ids.choices[0].text and len(text.choices[0].logprobs.token_logprobs) == 4


def test_multi_turn_session_with_late_reward_is_one_exact_record(proxy, server):
    base, state, _ = proxy
    session_id, key = start_session(base, ALICE, metadata={"agent": "test"})
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    messages, ids = list(QUESTION), []
    for turn_no in range(3):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        ids.append(reply.id)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"and then {turn_no}?"},
        ]
    assert call(base, "/rl/set_reward", {"reward": 0.25, "interaction_id": ids[0]}, key)[0] == 200
    status, ended, _ = call(base, "/rl/end_session", {}, key)
    assert status == 200 and ended["records"][0]["interaction_ids"] == ids
    status, late, _ = call(base, "/rl/set_reward", {"reward": 1.0}, key)  # the last interaction, after the end
    assert status == 200 and late["late"] and late["interaction_id"] == ids[-1]
    assert call(base, f"/rl/sessions/{session_id}", key=key)[1]["records"][0]["returns"] == [0.5, 0.5, 1.0]

    record = records(state)[f"{session_id}-0"]
    assert (record.tenant, record.session_id, record.metadata["agent"]) == ("alice", session_id, "test")
    assert record.metadata["interaction_ids"] == ids and record.metadata["discount"] == 0.5
    full = np.concatenate([np.concatenate([s.input_ids, s.output_ids]) for s in record.segments]).tolist()
    for n, segment in enumerate(record.segments):  # each turn is what the rollout server gives for its prompt
        prompt = np.concatenate(
            [np.concatenate([s.input_ids, s.output_ids]) for s in record.segments[:n]] + [segment.input_ids]
        ).tolist()
        status, direct, _ = call(
            f"http://{server}",
            "/generate",
            {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [2]},
            },
        )
        assert segment.output_ids.tolist() == direct["output_ids"]
        assert segment.output_logprobs == pytest.approx(
            [e[0] for e in direct["meta_info"]["output_token_logprobs"]], abs=1e-4
        )
        assert segment.output_versions.tolist() == [0] * len(direct["output_ids"])
    assert len(full) == record.n_tokens and all(len(s.input_ids) for s in record.segments)
    assert sorted((r.step, r.value) for r in record.rewards) == [(0, 0.25), (2, 1.0)]
    assert record.reward == 0.5  # what is trained: the first turn's discounted return, returns[0]


def test_tenants_cannot_read_end_or_reward_each_others_sessions(proxy):
    base, _, _ = proxy
    alice_id, alice_key = start_session(base, ALICE)
    other_alice_id, _ = start_session(base, ALICE)
    bob_id, bob_key = start_session(base, BOB)
    openai.OpenAI(base_url=f"{base}/v1", api_key=alice_key, max_retries=0).chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=2
    )
    for key in (bob_key, BOB):  # another tenant: the session does not exist for them
        for route, body in [
            ("/rl/set_reward", {"reward": 1, "session_id": alice_id}),
            ("/rl/end_session", {"session_id": alice_id}),
        ]:
            status, reply, _ = call(base, route, body, key)
            assert status == 404 and reply["error"]["code"] == "session_not_found"
        assert call(base, f"/rl/sessions/{alice_id}", key=key)[0] == 404
    status, reply, _ = call(base, "/rl/set_reward", {"reward": 1, "session_id": other_alice_id}, alice_key)
    assert status == 403 and reply["error"]["type"] == "permission_error"  # same tenant, another session's key
    assert call(base, f"/rl/sessions/{alice_id}", key=ALICE)[0] == 200  # the tenant key reads its own sessions
    assert call(base, f"/rl/sessions/{bob_id}", key=bob_key)[1]["interactions"] == []


def test_bad_input_gets_openai_json_errors_and_the_proxy_keeps_serving(proxy, keys_file):
    base, _, _ = proxy
    _, key = start_session(base, ALICE)
    chat = {"model": "tiny", "messages": QUESTION, "max_tokens": 2}
    cases = [
        (call(base, "/v1/chat/completions", raw=b'{"model": "tiny", "messages": [', key=key), 400, "invalid_json"),
        (call(base, "/v1/chat/completions", {"model": "tiny"}, key), 400, "invalid_value"),
        (call(base, "/v1/chat/completions", {**chat, "max_tokens": -1}, key), 400, "invalid_value"),
        (call(base, "/v1/chat/completions", {**chat, "model": "gpt-4"}, key), 404, "model_not_found"),
        (
            call(base, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 70000}]}, key),
            413,
            "request_too_large",
        ),
        (call(base, "/v1/chat/completions", chat), 401, "missing_api_key"),
        (call(base, "/v1/chat/completions", chat, "sk-not-a-key"), 401, "invalid_api_key"),
        (call(base, "/v1/chat/completions", chat, ALICE), 403, "session_required"),
        (call(base, "/rl/end_session", {"session_id": "nope"}, ALICE), 404, "session_not_found"),
        (call(base, "/rl/set_reward", {"reward": 1, "interaction_id": "nope"}, key), 404, "interaction_not_found"),
        (call(base, "/rl/set_reward", {"reward": "high"}, key), 400, "invalid_value"),
        (call(base, "/v1/nothing", {}, key), 404, None),
    ]
    for (status, reply, _), expected, code in cases:
        assert status == expected and reply["error"]["code"] == code, reply
        assert set(reply["error"]) == {"message", "type", "param", "code"}

    _, limited = start_session(base, LIMITED)  # 2 requests per minute: opening the session is one of them
    statuses = [call(base, "/v1/chat/completions", chat, limited) for _ in range(2)]
    assert [s for s, _, _ in statuses] == [200, 429]
    assert statuses[1][1]["error"]["type"] == "rate_limit_error" and int(statuses[1][2]["Retry-After"]) >= 1

    _, bob_key = start_session(base, BOB)
    tree = yaml.safe_load(keys_file.read_text())
    keys_file.write_text(yaml.safe_dump({**tree, "revoked": [hash_key(BOB)]}))  # re-read at the next call:
    try:  # its size changed (the proxy compares size, mtime and inode), however fine the clock
        assert call(base, "/rl/start_session", {}, BOB)[1]["error"]["code"] == "invalid_api_key"
        assert call(base, "/v1/chat/completions", chat, bob_key)[0] == 401  # its sessions' keys go with it
    finally:
        keys_file.write_text(yaml.safe_dump(tree))
    assert call(base, "/v1/chat/completions", chat, key)[0] == 200  # still serving


def test_sessions_wait_with_429_while_the_trainer_has_no_room_for_their_records(
    tiny_model_dir, server, keys_file, tmp_path
):
    """One proxy record per trainer step, staleness 0: one session per weight version."""
    cfg = proxy_config(
        tiny_model_dir, tmp_path, [server], keys_file, "rl.proxy_records_per_step=1", "rollout.max_head_offpolicyness=0"
    )
    with running_proxy(cfg) as (base, state, run):
        _, key = start_session(base, ALICE)
        status, reply, headers = call(base, "/rl/start_session", {}, ALICE)
        assert status == 429 and reply["error"]["code"] == "staleness_capacity" and int(headers["Retry-After"]) >= 1
        assert call(base, "/rl/end_session", {}, key)[0] == 200
        assert call(base, "/rl/start_session", {}, ALICE)[0] == 429  # its record is not trained yet
        try:  # the trainer's next version reaches the server: room for one more session
            assert (
                call(
                    f"http://{server}",
                    "/update_weights_from_disk",
                    {"model_path": str(tiny_model_dir), "weight_version": 1},
                )[0]
                == 200
            )
            run(state.router.refresh())
            assert state.router.version == 1 and call(base, "/rl/start_session", {}, ALICE)[0] == 200
        finally:  # the module's server is shared: leave it at version 0
            assert (
                call(
                    f"http://{server}",
                    "/update_weights_from_disk",
                    {"model_path": str(tiny_model_dir), "weight_version": 0},
                )[0]
                == 200
            )


@pytest.mark.slow
def test_a_turn_paused_by_a_weight_update_resumes_and_is_one_turn(proxy, server):
    base, state, _ = proxy
    _, key = start_session(base, ALICE)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    before = state.router.interrupted
    # greedy: the tiny model's reply to QUESTION has no end-of-turn token in 150, so the turn ends by length
    with paused(server):  # the turn waits in the server's queue until it continues, then decodes ...
        asker, result = in_background(
            client.chat.completions.create, model="tiny", messages=QUESTION, max_tokens=150, temperature=0.0
        )
        wait_queued(server, 1, "the turn to wait in the paused server's queue")
    with paused(server):  # ... when this pause (a weight update's) is taken: it returns with its first tokens
        wait_queued(server, 1, "the turn to be sent again and wait")
    asker.join(timeout=60)
    turn = state.by_key[hash_key(key)].turns[-1]
    reply = result["result"]
    assert state.router.interrupted == before + 1 and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == len(turn.output_ids) == len(turn.logprobs) == len(turn.versions) == 150


@pytest.mark.slow
def test_a_backend_that_dies_mid_turn_is_replaced_and_nothing_is_lost(tiny_model_dir, server, keys_file, tmp_path):
    with embedded_server(tiny_model_dir, tmp_path / "victim") as (victim, victim_address):
        cfg = proxy_config(tiny_model_dir, tmp_path, [victim_address, server], keys_file)
        with running_proxy(cfg) as (base, state, _):
            session_id, key = start_session(base, ALICE)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            # paused, the victim holds the turn in its queue until the kill (decoding, it could end first)
            assert call(f"http://{victim_address}", "/pause_generation", {"mode": "abort"})[0] == 200
            asker, result = in_background(
                client.chat.completions.create, model="tiny", messages=QUESTION, max_tokens=150, temperature=1.0
            )
            wait_queued(victim_address, 1, "the turn to wait in the victim's queue")
            victim.send_signal(signal.SIGKILL)
            asker.join(timeout=120)
            reply = result["result"]
            assert state.router.interrupted == 1 and state.router.healthy == [server]
            assert call(base, "/rl/end_session", {}, key)[0] == 200
            (record,) = records(state).values()  # the victim's tokens, then the survivor's: one turn
            assert record.session_id == session_id and len(record.segments) == 1
            assert record.metadata["interaction_ids"] == [reply.id]
            assert len(record.segments[0].output_ids) == reply.usage.completion_tokens


@pytest.mark.slow
def test_200_concurrent_sessions_become_200_records_none_duplicated(tiny_model_dir, server, keys_file, tmp_path):
    cfg = proxy_config(tiny_model_dir, tmp_path, [server], keys_file)
    with running_proxy(cfg) as (base, state, _):

        async def one(http: aiohttp.ClientSession, client: openai.AsyncOpenAI) -> str:
            async with http.post(f"{base}/rl/start_session", json={}, headers={"Authorization": f"Bearer {LOAD}"}) as r:
                opened = await r.json()
            session = client.with_options(api_key=opened["session_key"])
            await session.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
            auth = {"Authorization": f"Bearer {opened['session_key']}"}
            async with http.post(f"{base}/rl/set_reward", json={"reward": 1.0}, headers=auth) as r:
                assert r.status == 200
            async with http.post(f"{base}/rl/end_session", json={}, headers=auth) as r:
                assert r.status == 200
            return opened["session_id"]

        async def load():
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                ids = await asyncio.wait_for(asyncio.gather(*(one(http, client) for _ in range(200))), timeout=60)
            await client.close()
            return ids

        started = time.monotonic()
        ids = asyncio.run(load())
        seconds = time.monotonic() - started
        stored = list(records(state).values())
        print(f"200 sessions in {seconds:.1f} s; {len(stored)} records")
        assert len(set(ids)) == 200 and state.ended == 200 and len(stored) == 200
        assert sorted(t.session_id for t in stored) == sorted(ids) and all(t.reward == 1.0 for t in stored)


PROBE = """
import asyncio, json, sys
import aiohttp
from aiohttp import web
from areal_hpc.config import load_config
from areal_hpc.data.shards import TrajectoryStore
from areal_hpc.proxy.app import build_app
from areal_hpc.proxy.serve import build_proxy

async def main():
    cfg = load_config(None, sys.argv[1:])
    runner = web.AppRunner(build_app(build_proxy(cfg), cfg.proxy.max_request_bytes))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/rl/start_session", json={}, headers={"Authorization": "Bearer %s"}) as r:
            key = (await r.json())["session_key"]
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(20):
            async with http.post(base + "/v1/chat/completions", json=body, headers=auth) as r:
                assert r.status == 200, await r.text()
        async with http.post(base + "/rl/end_session", json={}, headers=auth) as r:
            assert r.status == 200
        async with http.post(base + "/rl/start_session", json={}, headers={"Authorization": "Bearer %s"}) as r:
            auth = {"Authorization": f"Bearer {(await r.json())['session_key']}"}
        async with http.post(base + "/v1/chat/completions", json=body, headers=auth) as r:  # never ended
            assert r.status == 200
    await runner.cleanup()  # shutting down ends and writes the open session
    with TrajectoryStore(cfg.run_dir / "shards") as store:
        records = len(store)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                      "rss_kb": int(status["VmHWM"].split()[0]), "records": records}))

asyncio.run(main())
""" % (ALICE, ALICE)  # noqa: UP031 (the script is full of braces: % fills its two keys without escaping them)


def test_the_proxy_runs_without_importing_torch_stays_small_and_writes_open_sessions_at_shutdown(
    tiny_model_dir, server, keys_file, tmp_path
):
    cfg = [
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        f"proxy.keys_file={keys_file}",
        f"proxy.backends={server}",
        "proxy.model_name=tiny",
    ]
    done = subprocess.run([sys.executable, "-c", PROBE, *cfg], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"proxy peak RSS after 21 turns: {probe['rss_kb'] / 1024:.1f} MiB")
    assert not probe["torch"] and not probe["transformers"] and probe["rss_kb"] < 150 * 1024
    # the ended session's 20 turns repeat one prompt (20 conversations, 20 records), and the one open at shutdown
    assert probe["records"] == 21


def test_proxy_cli_refuses_a_config_without_keys_in_one_line(tiny_model_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "areal_hpc", "proxy", f"model.path={tiny_model_dir}", f"cluster.fileroot={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "proxy.keys_file" in done.stderr


@pytest.mark.slow
def test_servers_beyond_loopback_need_the_run_token_which_the_proxy_finds_with_them(
    tiny_model_dir, keys_file, tmp_path
):
    with embedded_server(tiny_model_dir, tmp_path, "host=0.0.0.0") as (_, address):
        (run_dir,) = (tmp_path / "quickstart").iterdir()
        token = (run_dir / "rollout_token").read_text()
        assert (run_dir / "rollout_token").stat().st_mode & 0o777 == 0o600 and len(token) >= 32
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert call(f"http://{address}", "/generate", body)[0] == 401
        assert call(f"http://{address}", "/generate", body, "wrong")[0] == 401
        assert call(f"http://{address}", "/generate", body, token)[0] == 200
        assert call(f"http://{address}", "/health")[0] == 200  # probes need no token
        cfg = proxy_config(tiny_model_dir, tmp_path, [], keys_file, f"experiment.trial={run_dir.name}")
        with running_proxy(cfg) as (base, state, _):  # servers from the run's name-resolve, the run's token
            assert state.router.healthy == [address]
            _, key = start_session(base, ALICE)
            reply = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0).chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=3
            )
            assert reply.usage.completion_tokens >= 1
