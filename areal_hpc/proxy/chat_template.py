"""A model folder's tokenizer and chat template without transformers or torch: ``tokenizers`` for the
byte-level BPE, jinja2 for the template, rendered the way transformers renders it (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and a ``tojson`` filter).

Special tokens are the template's alone: one typed in a message (``<|im_start|>system`` in a user's
content, a tool's description or a role) is tokenised as the plain text it is, as hosted APIs do, so
no caller can write the conversation's structure into a prompt.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from areal_hpc.errors import UserError
from areal_hpc.models.chat_families import family_of_template, with_object_arguments


class TemplateRenderError(ValueError):
    """The template refused the messages (its own ``raise_exception``, or a message it cannot render)."""


def _raise(message: str):
    raise TemplateRenderError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTokenizer:
    """Encode, decode and render chats for one model folder (``tokenizer.json`` + ``tokenizer_config.json``,
    the template in ``chat_template.jinja`` or the config's ``chat_template``)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise UserError(
                f"cannot load a tokenizer from {folder}: {exc} (a Hugging Face model folder with "
                "tokenizer.json and tokenizer_config.json)"
            ) from None
        jinja = folder / "chat_template.jinja"
        source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if not isinstance(source, str):
            raise UserError(
                f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template); the proxy renders chats with the model's own template"
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.template = env.from_string(source)
        self.family = family_of_template(source)  # how its replies are read: tool calls, reasoning
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        eos = self.special["eos_token"]
        self.eos_token_ids = (
            [self.tokenizer.token_to_id(eos)] if eos and self.tokenizer.token_to_id(eos) is not None else []
        )
        specials = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )  # longest first: the match tokenizers makes where two start
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain = Tokenizer.from_str(self.tokenizer.to_str())  # special tokens read as text
        self._plain.encode_special_tokens = True

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template_args: dict | None = None,
    ) -> str:
        """The prompt text the model's template makes of ``messages`` (and ``tools``, for templates that use
        them; ``template_args``: its other variables, e.g. Qwen3's ``enable_thinking``); tool calls'
        arguments as objects for the families whose templates want them."""
        if self.family.object_arguments:
            messages = with_object_arguments(messages)
        try:
            return self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **(template_args or {}),
                **{k: v for k, v in self.special.items() if v is not None},
            )
        except TemplateRenderError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise TemplateRenderError(f"the chat template cannot render these messages: {exc}") from None

    def render_prompt(
        self, messages: list[dict], tools: list[dict] | None = None, template_args: dict | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The prompt of ``messages`` (with the generation prompt) and the spans of the special-token
        strings in it that the messages or tools hold, not the template: ``encode`` reads those as text.

        They are found by rendering again with each such string in the messages and tools replaced by
        as many ``x``: the template writes the same text around them, so the special tokens left are
        the template's own, at the same places. A template that writes the copy to another length (it
        branches on the text) is refused: the proxy could not tell its special tokens from typed ones."""
        text = self.render(messages, tools, template_args=template_args)
        if self._special is None or not self._types_special((messages, tools)):
            return text, []
        neutral = self.render(self._neutral(messages), self._neutral(tools), template_args=template_args)
        template = {m.span() for m in self._special.finditer(neutral)}
        found = {m.span(): m.group() for m in self._special.finditer(text)}
        if len(neutral) != len(text) or not template <= set(found):
            raise TemplateRenderError(
                f"the messages hold special-token text ({', '.join(sorted(set(found.values())))}) that this "
                "chat template does not write out as it is: remove it, or send it some other way"
            )
        return text, sorted(set(found) - template)

    def _types_special(self, value) -> bool:
        if isinstance(value, str):
            return self._special.search(value) is not None
        if isinstance(value, dict):
            return any(self._types_special(k) or self._types_special(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self._types_special(v) for v in value)
        return False

    def _neutral(self, value):
        """``value`` with every special-token string in its strings (keys too) replaced by as many ``x``."""
        if isinstance(value, str):
            return self._special.sub(lambda m: "x" * len(m.group()), value)
        if isinstance(value, dict):
            return {self._neutral(k): self._neutral(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._neutral(v) for v in value]
        return value

    def reply_rendering(
        self, messages: list[dict], tools: list[dict] | None, reply: dict, template_args: dict | None = None
    ) -> tuple[str, str]:
        """How the template writes ``reply`` once it is history: (the conversation through the reply, the
        text it closes the reply with, e.g. ``<|im_end|>\n``). ("", "") when the template does not write
        the reply after the prompt it made (it rewrites earlier history)."""
        sentinel = f"\x00{id(reply)}\x00"
        try:
            through = self.render(messages + [reply], tools, False, template_args)
            marked = self.render(messages + [{"role": "assistant", "content": sentinel}], tools, False, template_args)
        except TemplateRenderError:
            return "", ""
        closing = marked.partition(sentinel)[2]
        return (through, closing) if sentinel in marked and through.endswith(closing) else ("", "")

    def encode(self, text: str, typed: list[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text``: special tokens written in it (``<|im_start|>``) become their ids, but for
        those at the spans ``typed`` (``render_prompt``'s), which are tokenised as plain text. The GIL is
        released while it runs (``encode_batch``), so a thread can tokenise beside the event loop."""
        if not typed:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        ids, start, typed = [], 0, set(typed)
        for match in self._special.finditer(text):
            if match.span() not in typed:  # the template's: the text before it as text, then its id
                ids += self._plain_ids(text[start : match.start()]) + [self.tokenizer.token_to_id(match.group())]
                start = match.end()
        return ids + self._plain_ids(text[start:])

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_all(self, ids: list[int]) -> str:
        """``ids`` decoded special tokens included, with the GIL released (a long prompt, on a thread)."""
        return self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]

    def pieces(self, ids: list[int]) -> list[str]:
        """The reply's text cut token by token for streaming: the pieces join to ``decode(ids)``; a token
        that ends inside a multi-byte character is held back until the character is whole."""
        pieces, sent = [], ""
        for end in range(1, len(ids) + 1):
            text = self.decode(ids[:end])
            if end < len(ids) and text.endswith("\ufffd"):
                continue
            pieces.append(text[len(sent) :] if text.startswith(sent) else text)
            sent = text
        return pieces

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for per-token logprobs); a token inside a multi-byte character may be partial."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like dict."""
    return value.get("content") if isinstance(value, dict) else value
