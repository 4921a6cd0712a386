"""The proxy on loopback serving a model of each chat family to the real ``openai`` client: a reply that calls
a tool in the family's format (Qwen3's also thinking first) comes back as ``tool_calls`` (and
``reasoning_content``), whole and streamed; the agent's next request, the tool's reply added, extends the
turn token for token (its history writes the call as the model wrote it, arguments as objects where
the template wants them); the record trains exactly the model's tokens, the template's text between them
context. The model says scripted turns (a random tiny model writes no calls); the rest is the proxy's own."""

from __future__ import annotations

import contextlib
import json

import openai
import pytest

from areal_hpc.agents.chat import ClientRouter
from areal_hpc.models.chat import completion_ids
from areal_hpc.proxy.app import build_app
from areal_hpc.proxy.serve import build_proxy
from areal_hpc.proxy.tenants import hash_key
from areal_hpc.train.trajectory_batch import trajectory_sequence
from tests.models.test_chat import Says, saved
from tests.models.test_chat_families import TOOLS
from tests.proxy_helpers import proxy_config, serving, start_session, write_keys

ALICE = "tk-alice"
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
# family: (the model's call as it writes it, its reasoning, the template's text from the call's end to the answer)
CALLS = {
    "qwen3": (
        '<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "Add them.",
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    "llama3": (
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        None,
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    ),
    "gemma3": (
        "[add(a=2, b=3)]",
        None,
        "\n<start_of_turn>user\n<tool_response>\n5</tool_response><end_of_turn>\n<start_of_turn>model\n",
    ),
}


class ScriptedRouter(ClientRouter):
    """The proxy's router over a ``generate`` of the test's (the model that says scripted turns)."""

    async def start(self) -> None:
        """Nothing to probe."""

    async def close(self) -> None:
        """Nothing to close."""


@contextlib.contextmanager
def scripted_proxy(folder, turns: list[list[int]], root):
    """The proxy of the model in ``folder`` on loopback, its model saying ``turns``; yields (a client of a
    new session, the proxy, the session)."""
    write_keys(root / "keys.yaml", {"alice": {"keys": [ALICE]}})
    cfg = proxy_config(folder, root / "runs", ["127.0.0.1:9"], root / "keys.yaml")
    proxy = build_proxy(cfg)
    proxy.router = ScriptedRouter(Says(turns))
    with serving(build_app(proxy, cfg.proxy.max_request_bytes)) as (base, _):
        _, key = start_session(base, ALICE)
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0), proxy, proxy.by_key[hash_key(key)]


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_reply_in_the_familys_format_comes_back_as_tool_calls_and_trains_only_the_models_tokens(family, tmp_path):
    said, reasoning, between = CALLS[family]
    tokenizer = saved(family, tmp_path / "model")
    turns = [completion_ids(tokenizer, said), completion_ids(tokenizer, said), completion_ids(tokenizer, "It is 5.")]
    with scripted_proxy(tmp_path / "model", turns, tmp_path) as (client, proxy, session):
        whole = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS)
        message = whole.choices[0].message
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
        assert message.content is None and getattr(message, "reasoning_content", None) == reasoning
        assert whole.choices[0].finish_reason == "tool_calls"

        chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, stream=True))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert [getattr(d, "reasoning_content", None) for d in deltas if getattr(d, "reasoning_content", None)] == (
            [reasoning] if reasoning else []
        )
        assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["add"]

        tool_reply = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        following = [*QUESTION, message.model_dump(exclude_none=True), tool_reply]
        assert said in proxy.tokenizer.render(following, TOOLS)  # the history writes the call as the model did
        answer = client.chat.completions.create(model="tiny", messages=following, tools=TOOLS)
        assert answer.choices[0].message.content == "It is 5."
        (record,) = [r for r in session.trajectories(1.0) if len(r.segments) == 2]

    first, second = record.segments
    assert first.output_ids.tolist() == turns[0] and second.output_ids.tolist() == turns[2]
    assert tokenizer.decode(second.input_ids, skip_special_tokens=False) == between
    _, mask, _, _ = trajectory_sequence(record, 1.0)
    assert sum(mask) == len(turns[0]) + len(turns[2])


def test_qwen3_with_thinking_off_has_the_empty_think_block_in_its_prompt_never_trained(tmp_path):
    """``chat_template_kwargs`` reach the template (as vLLM and SGLang take them): Qwen3's
    ``enable_thinking: false`` writes an empty think block after the assistant header, which is prompt."""
    tokenizer = saved("qwen3", tmp_path / "model")
    answer = completion_ids(tokenizer, "It is 5.")
    with scripted_proxy(tmp_path / "model", [answer], tmp_path) as (client, _, session):
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, extra_body=off)
        message = reply.choices[0].message
        assert message.content == "It is 5." and getattr(message, "reasoning_content", None) is None
        for wrong, words in [(1, "an object of template variables"), ({"messages": []}, "without messages")]:
            with pytest.raises(openai.BadRequestError, match=words):
                client.chat.completions.create(
                    model="tiny", messages=QUESTION, extra_body={"chat_template_kwargs": wrong}
                )
        ((segment,),) = [r.segments for r in session.trajectories(1.0)]
    prompt = tokenizer.decode(segment.input_ids, skip_special_tokens=False)
    assert prompt.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert segment.output_ids.tolist() == answer and segment.loss_mask.tolist() == [1] * len(answer)
