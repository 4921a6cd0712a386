"""Token ids of chat prompts and completions: one place decides how a task turns into tokens."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages rendered by the tokenizer's chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    """The environment's turn after the model's output ``after_output``: the end-of-turn token when the
    output was cut off before it, then ``content`` as a ``role`` message and the assistant header."""
    ended = after_output[-1:] == [tokenizer.eos_token_id]
    message = tokenizer.apply_chat_template(
        [{"role": role, "content": content}], tokenize=False, add_generation_prompt=True
    )
    text = ("" if ended else tokenizer.eos_token) + "\n" + message
    return tokenizer(text, add_special_tokens=False)["input_ids"]
