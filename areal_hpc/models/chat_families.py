"""Chat families, one row each: a model's special tokens, its chat template (``models.chat_templates``), and
how a reply written in its format becomes an OpenAI message (tool calls, and reasoning for Qwen3).

``tokenizer.build_tokenizer(corpus, family=...)`` builds a tokenizer of a family; the proxy and the agents'
in-process chat recognise a model folder's family from its chat template (``family_of_template``), so a real
checkpoint's replies are read in its own format too. Plain Python only: the login-node proxy imports it
without transformers or torch.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from areal_hpc.errors import UserError
from areal_hpc.models import chat_templates

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
JSON_NAMES = {"true": True, "false": False, "null": None}  # what ``tojson`` writes inside a Python call


def hermes_calls(text: str) -> tuple[str, list[dict]]:
    """(the text left, the calls): every ``<tool_call>{"name", "arguments"}</tool_call>`` block of the reply
    (Qwen's and Hermes' format); a block that is not such JSON stays text."""
    calls, kept = [], text
    for block in TOOL_CALL_BLOCK.finditer(text):
        try:
            call = json.loads(block.group(1))
        except (ValueError, RecursionError):
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
            kept = kept.replace(block.group(0), "", 1)
    return kept, calls


def json_call(text: str) -> tuple[str, list[dict]]:
    """Llama 3's format: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``
    (``"arguments"`` is read too, as vLLM reads it); anything else is text."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return text, []
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return text, []
    arguments = call.get("parameters", call.get("arguments", {}))
    return ("", [{"name": call["name"], "arguments": arguments}]) if isinstance(arguments, dict) else (text, [])


def python_calls(text: str) -> tuple[str, list[dict]]:
    """The Gemma 3 tool template's format (vLLM's ``pythonic``): the whole reply is a Python list of calls
    with keyword arguments of literal values, ``[get_weather(city="Paris", days=2)]``; anything else is
    text. The values are read, never run (``true``, ``false`` and ``null`` as JSON's)."""
    source = text.strip()
    if not (source.startswith("[") and source.endswith("]")):
        return text, []
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = [_python_call(node) for node in tree.elts]
        json.dumps(calls)  # the values must be JSON's (no sets, bytes or complex numbers)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return "", calls


def _python_call(node: ast.expr) -> dict:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        raise ValueError("not a call of a function by name with keyword arguments")
    if any(keyword.arg is None for keyword in node.keywords):
        raise ValueError("**arguments")
    return {"name": node.func.id, "arguments": {k.arg: _literal(k.value) for k in node.keywords}}


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [key for key in node.keys if key is not None]
        if len(keys) < len(node.keys):
            raise ValueError("**mapping")
        return {_literal(key): _literal(value) for key, value in zip(keys, node.values)}
    return ast.literal_eval(node)


def think_split(text: str) -> tuple[str | None, str]:
    """(the reasoning, the reply) of a Qwen3 reply, split where Qwen3's template splits it: the reasoning is
    what comes before ``</think>`` (after ``<think>``, newlines around it dropped); (None, text) without
    ``</think>``."""
    if "</think>" not in text:
        return None, text
    return text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), text.split("</think>")[-1].lstrip(
        "\n"
    )


@dataclass(frozen=True)
class ChatFamily:
    """One chat format. ``specials``: its special tokens, in id order (``bos``, ``eos``, ``pad`` among them);
    ``text_tokens``: tokens of their own that decode as text (Qwen3's tags, which the proxy parses)."""

    name: str
    summary: str
    template: str
    eos: str  # the end-of-turn token: what a model turn ends with, and the rollout servers' stop token
    pad: str
    bos: str | None
    specials: tuple[str, ...]
    role_words: tuple[str, ...]  # words the tokenizer is trained on besides the corpus (the template's roles)
    markers: tuple[str, ...] = ()  # text only this family's templates hold; () for the fallback family
    text_tokens: tuple[str, ...] = ()
    reserved: str = "<|reserved_{}|>"  # the tokens that fill the vocabulary up to a multiple of 16
    parse_calls: Callable[[str], tuple[str, list[dict]]] = hermes_calls
    thinks: bool = False  # replies open with <think>...</think>: returned apart as reasoning_content
    object_arguments: bool = False  # the template writes tool-call arguments with tojson: give it objects

    def reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, the reply without it)."""
        return think_split(text) if self.thinks else (None, text)


IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHATML = ChatFamily(
    name="chatml",
    summary="ours (the default): <|im_start|>role ... <|im_end|> for every role, no tools",
    template=chat_templates.CHATML,
    eos=IM_END,
    pad=ENDOFTEXT,
    bos=None,
    specials=(ENDOFTEXT, IM_START, IM_END),
    role_words=("system", "user", "assistant"),
)

FAMILIES: dict[str, ChatFamily] = {
    family.name: family
    for family in (
        CHATML,
        replace(
            CHATML,
            name="qwen3",
            summary="Qwen3's: ChatML with <think> reasoning, <tool_call> JSON and <tool_response> results",
            template=chat_templates.QWEN3,
            text_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
            markers=(IM_START, "<think>"),
            thinks=True,
        ),
        ChatFamily(
            name="llama3",
            summary='Llama 3.1\'s: header turns ended by <|eot_id|>, {"name", "parameters"} JSON calls, '
            "ipython results",
            template=chat_templates.LLAMA3,
            eos="<|eot_id|>",
            pad="<|finetune_right_pad_id|>",
            bos="<|begin_of_text|>",
            specials=(
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|finetune_right_pad_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "<|python_tag|>",
            ),
            role_words=("system", "user", "assistant", "ipython"),
            markers=("<|start_header_id|>",),
            reserved="<|reserved_special_token_{}|>",
            parse_calls=json_call,
            object_arguments=True,
        ),
        ChatFamily(
            name="gemma3",
            summary="Gemma 3's: <start_of_turn>user/model turns, system text in the first user turn, "
            "Python-list tool calls, results as user turns",
            template=chat_templates.GEMMA3,
            eos="<end_of_turn>",
            pad="<pad>",
            bos="<bos>",
            specials=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
            role_words=("user", "model"),
            markers=("<start_of_turn>",),
            reserved="<unused{}>",
            parse_calls=python_calls,
            object_arguments=True,
        ),
    )
}
DEFAULT_FAMILY = CHATML.name


def chat_family(name: str) -> ChatFamily:
    """The family called ``name``, or one line naming the valid ones."""
    if name not in FAMILIES:
        raise UserError(f"chat template family {name!r} is not one of ours; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_template(source: str) -> ChatFamily:
    """The family whose marks ``source`` (a chat template) holds; ours (``chatml``, whose replies are read as
    Qwen/Hermes ``<tool_call>`` blocks) for any other template."""
    return next(
        (f for f in FAMILIES.values() if f.markers and all(mark in source for mark in f.markers)),
        FAMILIES[DEFAULT_FAMILY],
    )


def with_object_arguments(messages: list[dict]) -> list[dict]:
    """``messages`` with each tool call's ``arguments`` JSON string read into the object it holds (copies):
    templates that write arguments with ``tojson`` expect objects (Hugging Face's convention) where OpenAI
    clients send a string; vLLM reads them the same way. A string that is no JSON object stays as it is."""
    return [
        {**m, "tool_calls": [_object_call(call) for call in m["tool_calls"]]}
        if isinstance(m.get("tool_calls"), list)
        else m
        for m in messages
    ]


def _object_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call
