"""Token ids of chat prompts and completions: one place decides how a task turns into tokens, through the
tokenizer's own chat template, whatever its family (``models.chat_families``).

A model turn is what the model generates: its reply and the end-of-turn token (``eos_token``). Everything
else the template writes is the environment's, in the prompt, never trained: headers, the newline ChatML
and Gemma put after a turn's end, Llama 3's next header, Qwen3's empty think block when thinking is off.
"""

from __future__ import annotations

from jinja2 import TemplateError

from areal_hpc.errors import UserError

REPLY = "\x00reply\x00"  # stands for the model's reply where the template's text around it is wanted
PROBE = "areal0probe"  # stands for a message whose content the template must write


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages rendered by the tokenizer's chat template, ending with the assistant header (one line
    naming the tokenizer's folder when it has no template or the template refuses the messages)."""
    try:
        text = _apply(tokenizer, messages)
    except TemplateError as exc:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise UserError(
            f"the chat template of {_where(tokenizer)} cannot render messages of roles {roles}: {exc}"
        ) from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _apply(tokenizer, messages: list[dict]) -> str:
    """The template's text of ``messages`` and the assistant header after them."""
    if not tokenizer.chat_template:
        raise UserError(
            f"the tokenizer of {_where(tokenizer)} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template); give the model folder one (areal-hpc init-model writes one)"
        )
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def _where(tokenizer) -> str:
    return tokenizer.name_or_path or "this tokenizer"  # the folder it was loaded from ("" when built in memory)


def prompt_ids(tokenizer, user_text: str) -> list[int]:
    """The user turn rendered by the tokenizer's chat template, ending with the assistant header."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": user_text}])


def example_prompt_ids(tokenizer, example) -> list[int]:
    """An example's prompt: its chat ``messages`` when it has them, else its text as one user turn."""
    return chat_prompt_ids(tokenizer, example.messages) if example.messages else prompt_ids(tokenizer, example.prompt)


def completion_ids(tokenizer, text: str) -> list[int]:
    """A completion closed with the end-of-turn token, as the model should generate it."""
    return tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]


def next_turn_ids(tokenizer, role: str, content: str, after_output: list[int]) -> list[int]:
    """The environment's turn after the model's output ``after_output``: what the template writes from the
    end of a model turn's reply to the next assistant header with ``content`` as a ``role`` message between,
    less the end-of-turn token when the output ends with it (a turn cut off before it gets it here)."""
    text = _after_reply(tokenizer, role, content)
    if after_output[-1:] == [tokenizer.eos_token_id] and text.startswith(tokenizer.eos_token):
        text = text[len(tokenizer.eos_token) :]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _after_reply(tokenizer, role: str, content: str) -> str:
    """The template's text after an assistant reply followed by a ``role`` message holding ``content``, or one
    line when the template cannot write such a message there (Gemma 3's own template has no tool role)."""
    history = [{"role": "user", "content": PROBE}, {"role": "assistant", "content": REPLY}]
    try:
        probe = _apply(tokenizer, [*history, {"role": role, "content": PROBE}]).partition(REPLY)[2]
        written = PROBE in probe
        reason = "it leaves the message out"
    except TemplateError as exc:
        written, reason = False, str(exc)
    if not written:
        raise UserError(
            f"the chat template of {_where(tokenizer)} cannot write a {role!r} message after the model's turn "
            f"({reason}); give the model a template that has that role, or send the environment's reply in one "
            "it has (a user message)"
        )
    return _apply(tokenizer, [*history, {"role": role, "content": content}]).partition(REPLY)[2]
