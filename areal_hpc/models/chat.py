"""Token ids of chat prompts and completions: one place decides how a task turns into tokens."""

from __future__ import annotations


def prompt_ids(tokenizer, user_text: str) -> list[int]:
    """The user turn rendered by the tokenizer's chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_ids(tokenizer, text: str) -> list[int]:
    """A completion closed with the end-of-turn token, as the model should generate it."""
    return tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
