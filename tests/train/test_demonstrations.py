"""A tool agent's SFT demonstration (OpenAI messages with ``tool_calls``, and ``tools``) with each chat family that
writes tools is, token for token and mask for mask, the records the in-process chat client (the proxy's routes)
makes of an agent that sends the same messages and tools and hears the model say the demonstration's turns: one
sequence per record (Qwen3 without reasoning writes a called turn anew, so two). Where that is one record, its
tokens are the conversation as transformers renders it with the tools and its loss mask exactly the model's turns
(found from the rendered text's character spans). Bad demonstrations are one line naming the example."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_hpc.agents.chat import ChatGateway
from areal_hpc.config import load_config
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.demonstrations import check_demonstrations
from areal_hpc.train.sft import run_sft, sft_sequences
from areal_hpc.train.trajectory_batch import trajectory_sequence
from tests.conftest import REPO
from tests.models.test_chat import Says, conversation, model_turns, saved
from tests.models.test_chat_families import TOOLS


def openai_form(messages: list[dict], reasoning: bool = True) -> list[dict]:
    """``messages`` as an OpenAI client sends them: tool calls' arguments as JSON text, with an id the tool's
    reply names (and without ``reasoning_content`` unless ``reasoning``)."""
    sent = []
    for message in messages:
        if "tool_calls" in message:
            calls = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        if message["role"] == "tool":
            message = {**message, "tool_call_id": "call_1"}
        sent.append({k: v for k, v in message.items() if reasoning or k != "reasoning_content"})
    return sent


def trained_turns(ids: list[int], mask: list[int]) -> list[tuple[list[int], list[int]]]:
    """(the context, the model's turn) of each trained run of a sequence."""
    starts = [t for t in range(len(mask)) if mask[t] and not (t and mask[t - 1])]
    ends = [t for t in range(1, len(mask) + 1) if mask[t - 1] and (t == len(mask) or not mask[t])]
    return [(ids[:start], ids[start:end]) for start, end in zip(starts, ends, strict=True)]


def agent_records(folder, turns: list[list[int]], messages: list[dict]) -> list:
    """The records of an agent on the in-process chat client that sends ``messages[:2]`` and the tools, gets the
    model's call (the model says ``turns``), sends the tool's reply ``messages[3]`` and gets the answer."""

    async def run():
        async with ChatGateway(Says(turns), folder) as gateway:
            client = gateway.client({})
            sent = messages[:2]
            for tool_reply in [messages[3], None]:
                reply = await client.chat.completions.create(model=gateway.model_name, messages=sent, tools=TOOLS)
                sent.append(reply.choices[0].message.model_dump(exclude_none=True))
                if tool_reply is not None:
                    sent.append(tool_reply)
            return client.records()

    return asyncio.run(run())


@pytest.mark.parametrize("family, reasoning", [("gemma3", True), ("llama3", True), ("qwen3", True), ("qwen3", False)])
def test_a_demonstration_is_the_chat_clients_records_of_an_agent_saying_it(family, reasoning, tmp_path):
    tokenizer = saved(family, tmp_path)
    chat = conversation(family)
    demo = Example("demos.jsonl/0", "", messages=tuple(openai_form(chat, reasoning)), tools=tuple(TOOLS))
    sequences = sft_sequences(tokenizer, demo, check_demonstrations([demo], tmp_path))
    said = [turn for ids, mask in sequences for _, turn in trained_turns(ids, mask)]
    records = agent_records(tmp_path, said, openai_form(chat, reasoning))
    assert [trajectory_sequence(record, 1.0)[:2] for record in records] == sequences
    assert len(sequences) == (1 if reasoning else 2)
    if reasoning:  # one record: the conversation as transformers writes it with the tools, the model's turns trained
        text = tokenizer.apply_chat_template(chat, tools=TOOLS, tokenize=False)
        spans = model_turns(family, text)
        text = text[: spans[-1][1]]  # what follows the last turn's end is the environment's
        expected = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        trained = [int(any(a <= start and stop <= b for a, b in spans)) for start, stop in expected["offset_mapping"]]
        assert sequences == [(expected["input_ids"], trained)]


def test_weight_0_makes_a_model_turn_context_and_a_target_is_trained_after_the_tools_prompt(tmp_path):
    tokenizer = saved("qwen3", tmp_path)
    chat = openai_form(conversation("qwen3"))
    [(full, full_mask)] = sft_sequences(tokenizer, Example("d/0", "", messages=tuple(chat), tools=tuple(TOOLS)))
    first_turn_end = full_mask.index(0, full_mask.index(1))
    chat[2] = {**chat[2], "weight": 0}
    [(ids, mask)] = sft_sequences(tokenizer, Example("d/1", "", messages=tuple(chat), tools=tuple(TOOLS)))
    assert ids == full and mask == [0] * first_turn_end + full_mask[first_turn_end:]
    # the last turn as a target after the messages before it: the same tokens, the same mask
    answer = tokenizer.decode(full[mask.index(1) :], skip_special_tokens=False).removesuffix(tokenizer.eos_token)
    target = Example("d/2", "", target=answer, messages=tuple(chat[:4]), tools=tuple(TOOLS))
    assert sft_sequences(tokenizer, target) == [(ids, mask)]


def test_bad_demonstrations_are_one_line_naming_the_example(tmp_path):
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    saved("qwen3", qwen3)
    asked = ({"role": "user", "content": "What is 2+3?"},)
    cases = [
        (Example("d.jsonl/3", "", messages=asked), r"d.jsonl/3 has none \(name the column"),
        (
            Example("d.jsonl/4", "", target="5", messages=asked, tools=({"type": "code"},)),
            r"^d.jsonl/4: column 'tools': tools\[0\].type = 'code'; it must be 'function'",
        ),
        (
            Example("d.jsonl/5", "", target="5", messages=asked, tools=({"type": "function", "function": {}},)),
            r"^d.jsonl/5: column 'tools': tools\[0\].function.name = None; it must be given",
        ),
    ]
    for example, words in cases:
        with pytest.raises(UserError, match=words) as error:
            check_demonstrations([example], qwen3)
        assert "\n" not in str(error.value)

    chatml = tmp_path / "chatml"
    chatml.mkdir()
    saved("chatml", chatml)
    with pytest.raises(UserError, match=f"^d.jsonl/6 offers tools, but the chat template of {chatml} leaves them out"):
        check_demonstrations([Example("d.jsonl/6", "", target="5", messages=asked, tools=tuple(TOOLS))], chatml)


def test_sft_refuses_tools_its_models_template_leaves_out_before_it_starts(tmp_path, tiny_model_dir):
    """The tiny model's template (ours, ChatML) writes no tools: SFT on demonstrations that offer some stops
    before training, with one line (the CLI's exit code 2), its run folder left as it was."""
    data = tmp_path / "demos.jsonl"
    row = {"messages": [{"role": "user", "content": "What is 2+3?"}], "target": "5", "answer": "5", "tools": TOOLS}
    data.write_text(json.dumps(row) + "\n")
    overrides = [
        f"model.path={tiny_model_dir}",
        "dataset.task=custom",
        f"dataset.path={data}",
        f"dataset.eval_path={data}",
        f"reward.fn={REPO / 'tests/rewards_for_tests.py'}:exact_answer",
        f"cluster.fileroot={tmp_path / 'runs'}",
    ]
    cfg = resolve(load_config(str(REPO / "configs/sft_tiny.yaml"), overrides), Host.probe()).cfg
    with pytest.raises(UserError, match=f"^demos.jsonl/0 offers tools, but the chat template of {tiny_model_dir} "):
        run_sft(cfg)
    assert not list((tmp_path / "runs").rglob("*.yaml"))
