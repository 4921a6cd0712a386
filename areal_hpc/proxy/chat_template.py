"""A model folder's tokenizer and chat template without transformers or torch: ``tokenizers`` for the
byte-level BPE, jinja2 for the template, rendered the way transformers renders it (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and a ``tojson`` filter).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from areal_hpc.errors import UserError


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
            raise UserError(f"cannot load a tokenizer from {folder}: {exc} (a Hugging Face model folder with "
                            "tokenizer.json and tokenizer_config.json)") from None
        jinja = folder / "chat_template.jinja"
        source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if not isinstance(source, str):
            raise UserError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json's "
                            "chat_template); the proxy renders chats with the model's own template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.template = env.from_string(source)
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        eos = self.special["eos_token"]
        self.eos_token_ids = [self.tokenizer.token_to_id(eos)] if eos and self.tokenizer.token_to_id(eos) is not None \
            else []

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text the model's template makes of ``messages`` (and ``tools``, for templates that use them)."""
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **{k: v for k, v in self.special.items() if v is not None})
        except TemplateRenderError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise TemplateRenderError(f"the chat template cannot render these messages: {exc}") from None

    def reply_rendering(self, messages: list[dict], tools: list[dict] | None, reply: dict) -> tuple[str, str]:
        """How the template writes ``reply`` once it is history: (the conversation through the reply, the
        text it closes the reply with, e.g. ``<|im_end|>\n``). ("", "") when the template does not write
        the reply after the prompt it made (it rewrites earlier history)."""
        sentinel = f"\x00{id(reply)}\x00"
        try:
            through = self.render(messages + [reply], tools, add_generation_prompt=False)
            marked = self.render(messages + [{"role": "assistant", "content": sentinel}], tools,
                                 add_generation_prompt=False)
        except TemplateRenderError:
            return "", ""
        closing = marked.partition(sentinel)[2]
        return (through, closing) if sentinel in marked and through.endswith(closing) else ("", "")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: list[int]) -> list[str]:
        """The reply's text cut token by token for streaming: the pieces join to ``decode(ids)``; a token
        that ends inside a multi-byte character is held back until the character is whole."""
        pieces, sent = [], ""
        for end in range(1, len(ids) + 1):
            text = self.decode(ids[:end])
            if end < len(ids) and text.endswith("\ufffd"):
                continue
            pieces.append(text[len(sent):] if text.startswith(sent) else text)
            sent = text
        return pieces

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for per-token logprobs); a token inside a multi-byte character may be partial."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like dict."""
    return value.get("content") if isinstance(value, dict) else value
