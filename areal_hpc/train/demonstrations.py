"""A tool agent's SFT demonstrations, rendered as the agent's requests are at rollout time: by the proxy's renderer
(``proxy.chat_template``, what the login-node proxy and the in-process chat client run), with the row's ``tools``,
so a demonstration's prompt is token for token what the agent's request becomes. A demonstration trains its
``target``, else the model's turns in its messages (assistant messages in OpenAI's form, ``tool_calls`` included,
as the family's template writes them; ``weight`` 0 makes one context only, as in OpenAI's fine-tuning data).
"""

from __future__ import annotations

from pathlib import Path

from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.models.chat import PROBE
from areal_hpc.proxy.chat_template import ChatTokenizer, TemplateRenderError
from areal_hpc.proxy.openai_api import APIError, tools_of

PROBE_TOOL = {"type": "function", "function": {"name": PROBE, "parameters": {"type": "object", "properties": {}}}}


def is_agent_demo(example: Example) -> bool:
    """Whether ``example`` renders as a chat client's request: it offers tools, or its messages hold the turns
    to train (no target)."""
    return bool(example.tools) or not example.target


def model_turns(example: Example) -> list[int]:
    """The indices of the messages trained when the example has no target: its assistant messages but those
    of weight 0."""
    return [i for i, m in enumerate(example.messages) if m["role"] == "assistant" and m.get("weight", 1)]


def chat_sequences(chat: ChatTokenizer, example: Example) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of a demonstration as the proxy records an agent that says it: each model turn
    (the target, else each of ``model_turns``) follows the prompt the proxy renders and encodes of the
    messages before it and the tools; the turn is its text as the template writes it, through the
    end-of-turn token (mask 1), and the next prompt goes on from there. Where the template writes the
    conversation anew (Qwen3's drops an empty or earlier reasoning once a turn is followed), the proxy starts
    a record of its own, and so does this: one sequence per record."""
    messages = [{k: v for k, v in m.items() if k != "weight"} for m in example.chat_messages()]
    tools, eos = list(example.tools) or None, chat.special["eos_token"]
    if eos is None:
        raise UserError("the model's tokenizer_config.json names no eos_token: SFT cannot tell where a model turn ends")
    sequences: list[tuple[list[int], list[int]]] = []
    written = ""
    for end in [len(messages)] if example.target else model_turns(example):
        try:
            prompt, typed = chat.render_prompt(messages[:end], tools)
        except TemplateRenderError as exc:
            raise UserError(f"{example.uid}: {exc}") from None
        turn = example.target + eos if example.target else _written_turn(chat, messages, end, tools, prompt, eos)
        if turn is None:
            raise UserError(
                f"{example.uid}: the chat template does not write message {end} (an assistant message) after the "
                f"prompt of the messages before it, ended by {eos}: it is no model turn to train"
            )
        if not (sequences and prompt.startswith(written)):
            sequences.append(([], []))
            written = ""
        start = len(written)
        context = chat.encode(prompt[start:], [(a - start, b - start) for a, b in typed if a >= start])
        turn_ids = chat.encode(turn)
        ids, mask = sequences[-1]
        ids += context + turn_ids
        mask += [0] * len(context) + [1] * len(turn_ids)
        written = prompt + turn
    return sequences


def _written_turn(chat: ChatTokenizer, messages: list[dict], end: int, tools, prompt: str, eos: str) -> str | None:
    """The text the template writes for the model's turn ``messages[end]`` after ``prompt`` (the one it makes of
    the messages before), through its end-of-turn token (what follows that is the environment's); None when
    it writes no such turn there."""
    through, closing = chat.reply_rendering(messages[:end], tools, messages[end])
    if not (through.startswith(prompt) and closing.startswith(eos)):
        return None
    return through[len(prompt) : len(through) - len(closing)] + eos


def check_demonstrations(examples: list[Example], folder: str | Path) -> ChatTokenizer | None:
    """The proxy's renderer of the model ``folder`` when some of ``examples`` are agents' demonstrations (None
    when none is), once each is one SFT can train: a target or a model turn to train, tools that are a list
    of function tools as the proxy takes them, and a template that writes tools when any example offers some."""
    for example in examples:
        if not (example.target or model_turns(example)):
            raise UserError(
                f"config key 'dataset.target_field': SFT trains on reference completions; {example.uid} has none "
                "(name the column that holds them, or end its messages with the model's turn: an assistant message)"
            )
        try:
            tools_of({"tools": list(example.tools) or None})
        except APIError as exc:
            raise UserError(f"{example.uid}: column 'tools': {exc.message}") from None
    if not any(is_agent_demo(example) for example in examples):
        return None
    chat = ChatTokenizer(folder)
    offering = next((example for example in examples if example.tools), None)
    if offering is not None:
        try:
            written = PROBE in chat.render([{"role": "user", "content": "?"}], [PROBE_TOOL])
        except TemplateRenderError:
            written = False
        if not written:
            raise UserError(
                f"{offering.uid} offers tools, but the chat template of {folder} leaves them out of the prompt (the "
                "model would never see them): use a model whose template writes tools (Qwen3's, Llama 3's, "
                "Gemma 3's; areal-hpc init-model --template qwen3 writes a tiny one), or data without a tools column"
            )
    return chat
