"""The proxy's parts without servers: turn linking by token prefix and the records it makes (property
tests), discounting, chat templates rendered as transformers renders them (tools included), keys files,
request bodies whose text is not Unicode.
"""

import asyncio
import json
import shutil
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.cli import main
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.proxy.app import parse_json
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.openai_api import APIError, reply_message
from areal_hpc.proxy.sessions import Session, Turn, discounted_returns, keep_reply
from areal_hpc.proxy.tenants import Quota, QuotaMeter, TenantKeys, hash_key

tokens = st.lists(st.integers(0, 50), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), tokens, tokens, st.booleans()), min_size=1, max_size=12))
def test_turns_linked_by_prefix_make_records_that_are_exactly_each_conversation(steps):
    """Each step extends an earlier turn (picked by number) with new tokens, or starts afresh; every record
    concatenates to its last turn's prompt and output, and every turn is in a record."""
    session = Session(tenant="t", tenant_key_hash="h", key_hash="k")
    for n, (pick, new, output, extend) in enumerate(steps):
        base = session.turns[pick % len(session.turns)].full_ids if extend and session.turns else []
        prompt = base + new
        parent = session.parent_by_ids(prompt)
        assert parent is None or prompt[: len(parent.full_ids)] == parent.full_ids
        if base:  # the longest prefix is found: at least as long as the turn extended
            assert len(parent.full_ids) >= len(base)
        session.turns.append(
            Turn(f"i{n}", prompt, output, [-1.0] * len(output), [n] * len(output), "stop", 1.0, parent)
        )
    records = session.trajectories(discount=1.0)
    leaves = session.leaves()
    assert len(records) == len(leaves)
    for leaf, record in zip(leaves, records):
        joined = np.concatenate([np.concatenate([s.input_ids, s.output_ids]) for s in record.segments])
        assert joined.tolist() == leaf.full_ids
        assert record.metadata["interaction_ids"] == [t.interaction_id for t in leaf.chain()]
    assert {i for r in records for i in r.metadata["interaction_ids"]} == {t.interaction_id for t in session.turns}


@given(st.dictionaries(st.integers(0, 7), st.floats(-10, 10)), st.integers(1, 8), st.floats(0, 1))
def test_discounted_returns_are_each_turns_reward_plus_the_discounted_next_return(rewards, n, discount):
    rewards = {k: v for k, v in rewards.items() if k < n}
    returns = discounted_returns(rewards, n, discount)
    assert returns[-1] == pytest.approx(rewards.get(n - 1, 0.0))
    for j in range(n - 1):
        assert returns[j] == pytest.approx(rewards.get(j, 0.0) + discount * returns[j + 1])
    if set(rewards) <= {n - 1}:  # one reward at the end reaches turn j as discount ** (n - 1 - j) of it
        assert returns == pytest.approx([discount ** (n - 1 - j) * rewards.get(n - 1, 0.0) for j in range(n)])


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}},
    }
]


@pytest.fixture
def tool_model(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return folder


def test_a_megabyte_of_tools_is_rendered_and_tokenised_off_the_event_loop(tool_model):
    """Small prompts are rendered and tokenised on the event loop; a short question offered a megabyte of
    tools renders to a megabyte of prompt, which is tokenised on a thread while the loop keeps ticking
    (with everything on the loop, it stalls for the whole second)."""
    from areal_hpc.agents.chat import ChatGateway
    from areal_hpc.rollout.client import Generation

    tools = [
        {"type": "function", "function": {"name": f"add{i}", "description": "What is 2+3? " * 40}} for i in range(2000)
    ]
    assert len(json.dumps(tools)) > 1_000_000

    async def generate(input_ids, params):
        return Generation(list(input_ids), [1], [-0.5], [0], "stop")

    async def run():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        async with ChatGateway(generate, tool_model) as chat:
            ticking = asyncio.create_task(ticker())
            started = time.monotonic()
            await chat.client({}).chat.completions.create(
                model=chat.model_name, messages=[{"role": "user", "content": "What is 2+3?"}], tools=tools
            )
            took = time.monotonic() - started
            done.set()
            await ticking
        return took, max(gaps)

    took, longest_gap = asyncio.run(run())
    assert took > 0.3, took  # a megabyte's tokenising: the case this test is about
    assert longest_gap < took / 3, (longest_gap, took)


def test_chat_template_renders_and_tokenises_as_transformers_does_tools_included(tool_model):
    ours, theirs = ChatTokenizer(tool_model), load_tokenizer(tool_model)
    tools = TOOLS
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3? ünï"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4+4?"},
    ]
    for kwargs in [dict(tools=tools), dict(tools=None)]:
        text = ours.render(messages, **kwargs)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert '"name": "add"' in ours.render(messages, tools)
    ids = ours.encode("ünï 2+3")
    assert "".join(ours.pieces(ids)) == ours.decode(ids) and ours.eos_token_ids == [theirs.eos_token_id]


def test_a_tool_call_comes_back_as_tool_calls_and_the_next_turn_extends_it_though_the_template_rewrites_it(tool_model):
    """The model writes its call with the keys in another order than the template does: the next request's
    text does not start with the sampled tokens, yet it extends the turn through the template's writing."""
    tok = ChatTokenizer(tool_model)
    messages = [{"role": "user", "content": "Add 1 and 2."}]
    prompt = tok.encode(tok.render(messages, TOOLS))
    sampled = 'Adding.<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>'
    output = tok.encode(sampled) + tok.eos_token_ids
    turn = Turn(
        "i0",
        prompt,
        output,
        [-1.0] * len(output),
        [0] * len(output),
        "stop",
        1.0,
        text=tok.decode(prompt + output, skip_special_tokens=False),
    )
    keep_reply(turn, tok, messages, TOOLS)
    (call,) = turn.reply["tool_calls"]
    assert turn.reply["content"] == "Adding." and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    session = Session(tenant="t", tenant_key_hash="h", key_hash="k", turns=[turn])
    following = messages + [turn.reply, {"role": "tool", "content": "3"}]
    text = tok.render(following, TOOLS)
    assert not text.startswith(turn.text)  # the template writes the call its own way
    parent, bridge, start = session.extension(text)
    rest = bridge + text[start:]
    assert parent is turn and turn.bridge == ""  # this template closes a message with <|im_end|>: the model's own
    assert rest.startswith("<|im_start|>tool\n3") and text.endswith(
        tok.decode(tok.encode(rest), skip_special_tokens=False)
    )
    assert reply_message("no call here", True) == {"role": "assistant", "content": "no call here"}
    assert reply_message('<tool_call>{"name": "add"}</tool_call>', False)["content"].startswith("<tool_call>")


def test_keys_file_hashes_revocation_and_refusals(tmp_path, capsys):
    keys = tmp_path / "keys.yaml"
    assert main(["proxy-key", "--keys-file", str(keys), "--tenant", "alice"]) == 0
    key = capsys.readouterr().out.strip()
    assert key not in keys.read_text() and hash_key(key) in keys.read_text() and keys.stat().st_mode & 0o777 == 0o600
    book = TenantKeys(keys, Quota(10, 100))
    assert book.tenant(hash_key(key)) == "alice" and book.quota("alice") == Quota(10, 100)
    keys.write_text(keys.read_text() + f"revoked: ['{hash_key(key)}']\n")
    book.reload()
    assert book.tenant(hash_key(key)) is None
    for text, words in [
        ("tenants: {alice: {keys: [plain-key]}}", "never keys"),
        ("tenants: {'a b': {keys: []}}", "tenant name"),
        ("tenants: {a: {keys: [], tokens_per_minute: -1}}", "tokens_per_minute"),
        ("users: {}", "mapping with 'tenants'"),
    ]:
        keys.write_text(text)
        with pytest.raises(UserError, match=words):
            TenantKeys(keys, Quota(0, 0))


def test_quota_meter_admits_up_to_the_rate_reserves_tokens_and_says_how_long_to_wait():
    meter, quota = QuotaMeter(), Quota(requests_per_minute=3, tokens_per_minute=50)
    assert [meter.admit("t", quota) for _ in range(3)] == [0, 0, 0]
    assert 0 < meter.admit("t", quota) <= 20
    assert meter.admit("other", quota) == 0  # tenants do not share buckets
    assert meter.reserve("other", quota, 30) == 0
    assert 0 < meter.reserve("other", quota, 30) <= 60 * 10 / 50 + 0.1  # 20 left: never overdrawn
    assert meter.admit("other", quota, tokens=30) > 0  # nor admitted while the bucket cannot hold its least
    meter.refund("other", quota, 25)  # the first used 5 of its 30
    assert meter.reserve("other", quota, 30) == 0
    meter.refund("other", quota, 1000)
    assert meter.reserve("other", quota, 51) > 0  # a refund never fills the bucket past its size


def test_proxy_records_for_training_are_rewarded_of_the_proxies_writers_and_too_stale_ones_are_consumed(tmp_path):
    from areal_hpc.config import load_config
    from areal_hpc.data.shards import TrajectoryShardWriter
    from areal_hpc.data.trajectory import Reward, Segment, Trajectory
    from areal_hpc.train.build import open_proxy_records, take_proxy_records

    def record(name: str, version: int, rewarded: bool = True) -> Trajectory:
        return Trajectory(
            [Segment([1, 2], [3], [-0.5], [version])],
            id=name,
            tenant="alice",
            rewards=[Reward(1.0)] if rewarded else [],
        )

    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "rl.proxy_records_per_step=8"])
    with TrajectoryShardWriter(cfg.run_dir / "shards", "proxy-host-7", fsync=False) as proxy:
        for r in [record("old", 0), record("new", 5), record("waiting", 5, rewarded=False)]:
            proxy.append(r)
    with TrajectoryShardWriter(cfg.run_dir / "shards", "rollout0", fsync=False) as own:
        own.append(record("own", 5))
    assert open_proxy_records(load_config(None, [f"cluster.fileroot={tmp_path}"]), None) is None
    with open_proxy_records(cfg, None) as consumer:
        fresh, stale = take_proxy_records(consumer, 8, version=5, eta=2)
        assert [t.id for t in fresh] == ["new"] and [t.id for t in stale] == ["old"]
        assert take_proxy_records(consumer, 8, version=5, eta=2) == ([], [])  # each once; "waiting" waits


def test_the_run_token_is_made_once_0600_shared_and_given_to_sglang_too(tmp_path):
    from areal_hpc.config import load_config
    from areal_hpc.rollout.sglang_server import sglang_command
    from areal_hpc.runtime.rollout_token import needs_token, rollout_token, server_token

    assert rollout_token(tmp_path) is None
    token = rollout_token(tmp_path, create=True)
    assert len(token) >= 32 and (tmp_path / "rollout_token").stat().st_mode & 0o777 == 0o600
    assert rollout_token(tmp_path, create=True) == rollout_token(tmp_path) == token  # the second server reads it
    assert [p.name for p in tmp_path.iterdir()] == ["rollout_token"]  # no staging file left behind
    assert [needs_token(h) for h in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "10.1.2.3", "node7")] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    assert server_token(tmp_path, "127.0.0.1") is None and server_token(tmp_path, "0.0.0.0") == token
    (tmp_path / "rollout_token").write_text("")
    with pytest.raises(UserError, match="is empty"):  # never serve the network without a token
        server_token(tmp_path, "0.0.0.0")
    command = sglang_command(load_config(None, ["model.path=/m", "rollout.host=0.0.0.0"]), 1, token=token)
    assert command[-2:] == ["--api-key", token]


def test_a_streamed_reply_that_calls_tools_sends_its_text_then_the_calls():
    from areal_hpc.proxy.openai_api import chat_chunks

    reply = reply_message('Adding.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', True)
    events = list(chat_chunks("id", "tiny", [reply["content"]], "stop", None, reply["tool_calls"]))
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1] == {"content": "Adding."} and deltas[2]["tool_calls"][0]["function"]["name"] == "add"
    assert deltas[2]["tool_calls"][0]["index"] == 0 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())  # half pairs too
text_with_surrogates = st.lists(st.characters() | surrogates, max_size=6).map("".join)  # st.text drops them
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | text_with_surrogates,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text_with_surrogates, inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(text_with_surrogates, json_values, max_size=4), st.booleans())
def test_a_body_is_refused_exactly_when_its_text_is_not_unicode(body, ascii_escapes):
    """The oracle: Python's own UTF-8 encoder of the body the JSON decodes to (JSON's escapes of a pair decode
    to one character). Sent as escapes, or as raw UTF-8 where it can be (raw UTF-8 cannot carry a surrogate)."""
    try:
        raw = json.dumps(body, ensure_ascii=ascii_escapes).encode()
    except UnicodeEncodeError:
        raw = json.dumps(body).encode()
    received = json.loads(raw)
    try:
        json.dumps(received, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(APIError) as refused:
            parse_json(raw)
        assert refused.value.status == 400 and "lone UTF-16 surrogate" in refused.value.message
    else:
        assert parse_json(raw) == received
