"""Chat families: each template writes what the hub's template writes (the strings below are the model
cards' formats, spelled out; Gemma 3 also against its own hub template), a tokenizer of each family survives
save and load and the proxy's renderer agrees with transformers on it, and each family's tool-call parser
reads back every call its template writes (hypothesis) and leaves anything else as text."""

from __future__ import annotations

import functools
import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from areal_hpc.models.chat_families import FAMILIES, chat_family, family_of_template
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.models.tokenizer import VOCAB_MULTIPLE, build_tokenizer
from areal_hpc.proxy.chat_template import ChatTokenizer

CORPUS = ["What is 2+3?", "It is 5.", "Add two numbers."]
ARCHITECTURES = {"chatml": Qwen2Config, "qwen3": Qwen3Config, "llama3": LlamaConfig, "gemma3": Gemma3TextConfig}
# how each family opens and closes a model turn: what a test reads a rendered conversation's model turns by
MODEL_TURN = {
    "chatml": ("<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "gemma3": ("<start_of_turn>model\n", "<end_of_turn>"),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]
HUB_RENDERINGS = {
    "qwen3": "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    '<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
    '{"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 5.<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge "
    "Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
    "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n'
    + json.dumps(TOOLS[0], indent=4)
    + "\n\nWhat is 2+3?<|eot_id|>"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
    '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 5.<|eot_id|>",
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nTools (functions) are available. If you decide to invoke one or "
    "more of the tools, you must respond with a python list of the function calls.\nExample Format: "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] \nDo not use "
    "variables. DO NOT USE MARKDOWN SYNTAX. You SHOULD NOT include any other text in the response if you call a "
    "function. If none of the functions can be used, point it out. If you lack the parameters required by the "
    "function, also point it out.\nHere is a list of functions in JSON format that you can invoke.\n"
    + json.dumps(TOOLS, indent=4)
    + "\n\nWhat is 2+3?<end_of_turn>\n"
    "<start_of_turn>model\n[add(a=2, b=3)]<end_of_turn>\n"
    "<start_of_turn>user\n<tool_response>\n5</tool_response><end_of_turn>\n"
    "<start_of_turn>model\nIt is 5.<end_of_turn>\n",
}
# Gemma 3's template as the hub ships it (no tools): the gemma3 family must render tool-less chats as it does
GEMMA3_HUB_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}'
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)


@functools.lru_cache
def tokenizer_of(family: str):
    return build_tokenizer(CORPUS, family=family)


@pytest.mark.parametrize("family", sorted(HUB_RENDERINGS))
def test_each_familys_template_writes_what_the_hubs_template_writes(family):
    tokenizer = tokenizer_of(family)
    assert tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == HUB_RENDERINGS[family]


def test_qwen3_without_thinking_and_gemma3_without_tools_render_as_their_hubs_do():
    question = CONVERSATION[:2]
    no_thinking = tokenizer_of("qwen3").apply_chat_template(
        question, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chat = [*question, {"role": "assistant", "content": " 5 "}, {"role": "user", "content": "And 4+4?"}]
    gemma = tokenizer_of("gemma3")
    ours = gemma.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours == gemma.apply_chat_template(
        chat, chat_template=GEMMA3_HUB_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n5<end_of_turn>\n"
        "<start_of_turn>user\nAnd 4+4?<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_tokenizer_survives_save_and_load_and_the_proxy_renders_it_as_transformers_does(family, tmp_path):
    built = tokenizer_of(family)
    ARCHITECTURES[family](vocab_size=len(built)).save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    loaded, ours = load_tokenizer(tmp_path), ChatTokenizer(tmp_path)
    chat = chat_family(family)
    assert len(loaded) % VOCAB_MULTIPLE == 0 and loaded.get_vocab() == built.get_vocab()
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == (chat.eos, chat.pad, chat.bos)
    assert ours.family is chat and ours.eos_token_ids == [loaded.eos_token_id]
    tools = TOOLS if family != "chatml" else None
    text = ours.render(CONVERSATION[:4], tools)
    assert text == loaded.apply_chat_template(CONVERSATION[:4], tools=tools, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(text)
    assert ids == loaded(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text
    # special tokens are single tokens and leave a reply's text; Qwen3's tags stay in it (the proxy parses them)
    assert all(len(loaded(t, add_special_tokens=False)["input_ids"]) == 1 for t in chat.specials + chat.text_tokens)
    assert ours.decode(loaded(chat.eos + "".join(chat.text_tokens), add_special_tokens=False)["input_ids"]) == "".join(
        chat.text_tokens
    )


def test_a_template_is_read_as_its_family_and_any_other_as_ours():
    assert [family_of_template(f.template).name for f in FAMILIES.values()] == list(FAMILIES)
    assert family_of_template(GEMMA3_HUB_TEMPLATE).name == "gemma3"
    assert family_of_template("{{ messages }}").name == "chatml"


def written_call(family: str, name: str, arguments: dict) -> str:
    """The model turn the family's template writes for one call (between its turn's opening and end)."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    chat = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tokenizer_of(family).apply_chat_template(chat, tokenize=False)
    opening, end = MODEL_TURN[family]
    return text.rpartition(opening)[2].partition(end)[0]


IDENTIFIERS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
TEXT = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(["qwen3", "llama3", "gemma3"]),
    name=IDENTIFIERS,
    arguments=st.dictionaries(IDENTIFIERS, VALUES, max_size=4),
)
def test_each_familys_parser_reads_back_every_call_its_template_writes(family, name, arguments):
    chat = chat_family(family)
    reasoning, reply = chat.reasoning(written_call(family, name, arguments))  # Qwen3 writes an empty think block
    kept, calls = chat.parse_calls(reply)
    assert calls == [{"name": name, "arguments": arguments}] and not kept.strip() and not reasoning


@pytest.mark.parametrize(
    "family, text, arguments",
    [
        ("qwen3", "<tool_call>not json</tool_call>", None),
        ("qwen3", 'Adding. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', {"a": 1}),
        ("llama3", 'It is {"name": "add", "parameters": {"a": 1}}', None),  # a call is the whole reply
        ("llama3", '{"name": "add", "parameters": [1]}', None),
        ("llama3", ' {"name": "add", "arguments": {"a": 1}}\n', {"a": 1}),
        ("gemma3", "[add(a=true, b=null, c=[-1.5, {'k': 'v'}])]", {"a": True, "b": None, "c": [-1.5, {"k": "v"}]}),
        ("gemma3", "Call [add(a=1)]", None),
        ("gemma3", '[os.system("ls")]', None),  # only a function by name
        ("gemma3", '[add(__import__("os"))]', None),  # keyword arguments only
        ("gemma3", '[add(a=open("x"))]', None),  # values are read, never run
        ("gemma3", "[add(a={1, 2})]", None),  # and must be JSON's
        ("gemma3", "[add(**kw)]", None),
        ("gemma3", "[" * 400 + "]" * 400, None),
    ],
)
def test_a_reply_is_a_call_only_in_the_familys_format(family, text, arguments):
    kept, calls = chat_family(family).parse_calls(text)
    if arguments is None:
        assert (kept, calls) == (text, [])
    else:
        assert [c["arguments"] for c in calls] == [arguments] and "add" not in kept


def test_qwen3_reasoning_is_split_where_its_template_splits_it():
    qwen3, chatml = chat_family("qwen3"), chat_family("chatml")
    assert qwen3.reasoning("<think>\nHm.\n\n</think>\n\nIt is 5.") == ("Hm.", "It is 5.")
    assert qwen3.reasoning("It is 5.") == (None, "It is 5.")
    assert chatml.reasoning("<think>Hm.</think>5") == (None, "<think>Hm.</think>5")
