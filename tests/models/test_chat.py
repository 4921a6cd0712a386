"""A multi-turn tool conversation recorded the way the workflows record one (``TokenEpisode``: the model's
turns, then ``observe_message`` for the tool's reply) and an SFT example of it: with every chat family the
tokens are the template's rendering of the conversation, and the loss mask covers exactly the model's turns
(their end-of-turn token included), found independently from the rendered text's character spans. Bad
input: a tokenizer without a chat template, and a template that cannot write a tool's reply, are one line
naming the folder."""

from __future__ import annotations

import asyncio

import pytest

from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.models.chat import chat_prompt_ids, next_turn_ids
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.client import Generation
from areal_hpc.train.sft import sft_sequences
from areal_hpc.train.trajectory_batch import trajectory_sequence
from tests.models.test_chat_families import ARCHITECTURES, CALL, GEMMA3_HUB_TEMPLATE, MODEL_TURN, tokenizer_of


def conversation(family: str) -> list[dict]:
    """A question, a tool call (a structured call where the family's template writes one), the tool's reply,
    and the answer, with reasoning for Qwen3."""
    call = {"content": "<calc>2+3</calc>"} if family == "chatml" else {"content": "", "tool_calls": [CALL]}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "reasoning_content": "Use the tool.", **call},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5.", "reasoning_content": "Done."},
    ]


def model_turns(family: str, text: str) -> list[tuple[int, int]]:
    """The character spans of the model's turns in ``text``: after each opening of a model turn, through
    its end-of-turn token."""
    opening, end = MODEL_TURN[family]
    spans, start = [], text.find(opening)
    while start >= 0:
        start += len(opening)
        stop = text.index(end, start) + len(end)
        spans.append((start, stop))
        start = text.find(opening, stop)
    return spans


class Says:
    """A model that says the given token ids, turn by turn (a turn without its end-of-turn token was cut off)."""

    def __init__(self, outputs: list[list[int]]):
        self.outputs = iter(outputs)

    async def __call__(self, input_ids, params):
        output = next(self.outputs)
        return Generation(list(input_ids), output, [-0.1] * len(output), [0] * len(output), "stop")


@pytest.mark.parametrize("cut", [False, True], ids=["ended", "first-turn-cut"])
@pytest.mark.parametrize("family", sorted(MODEL_TURN))
def test_the_loss_mask_is_exactly_the_model_turns_of_the_rendered_conversation(family, cut):
    tokenizer = tokenizer_of(family)
    chat = conversation(family)
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    spans = model_turns(family, text)
    text = text[: spans[-1][1]]  # what follows the last turn's end is the next turn's
    expected = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    eos = tokenizer.eos_token_id
    # the model says what the template writes for its turns; a cut-off first turn stops before its end
    outputs = [tokenizer(text[a:b], add_special_tokens=False)["input_ids"] for a, b in spans]
    if cut:
        outputs[0] = outputs[0][:-1]
        spans[0] = (spans[0][0], spans[0][1] - len(tokenizer.eos_token))  # its end-of-turn token is context

    async def record():
        engine = EpisodeContext(EpisodeSettings(Says(outputs), tokenizer, Sampling(64), None, None))
        episode = engine.episode(prompt_ids=chat_prompt_ids(tokenizer, chat[:2]))
        await episode.generate()
        episode.observe_message("5", role="tool")
        await episode.generate()
        return episode.trajectory()

    tokens, mask, _, _ = trajectory_sequence(asyncio.run(record()), 1.0)
    trained = [any(a <= start and stop <= b for a, b in spans) for start, stop in expected["offset_mapping"]]
    assert tokens == expected["input_ids"] and mask == [int(t) for t in trained]
    assert sum(mask) == sum(len(o) for o in outputs) and [t for t, m in zip(tokens, mask) if m].count(eos) == 2 - cut

    # an SFT example of the conversation's last turn: trained on that turn alone
    answer = text[spans[-1][0] : spans[-1][1] - len(tokenizer.eos_token)]
    [(ids, sft_mask)] = sft_sequences(tokenizer, Example("q", "", target=answer, messages=tuple(chat[:4])))
    assert ids == expected["input_ids"]
    assert sft_mask == [
        int(spans[-1][0] <= start and stop <= spans[-1][1]) for start, stop in expected["offset_mapping"]
    ]


def saved(family: str, folder, template: str | None = None):
    """A model folder holding a tokenizer of ``family`` (and its architecture's config), loaded back;
    ``template`` replaces its chat template ("": none)."""
    tokenizer = tokenizer_of(family)
    ARCHITECTURES[family](vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if template is not None:
        (folder / "chat_template.jinja").unlink()
        if template:
            (folder / "chat_template.jinja").write_text(template)
    return load_tokenizer(folder)


def test_a_tokenizer_without_a_chat_template_is_one_line_naming_its_folder(tmp_path):
    tokenizer = saved("llama3", tmp_path, template="")
    with pytest.raises(UserError, match=f"^the tokenizer of {tmp_path} has no chat template") as error:
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2+3?"}])
    assert "\n" not in str(error.value)


def test_a_template_that_cannot_write_a_tools_reply_is_one_line_naming_its_folder(tmp_path):
    """Gemma 3's hub template has no tool role: a workflow sending a tool's reply is refused; a user turn is
    written as the template writes it."""
    tokenizer = saved("gemma3", tmp_path, template=GEMMA3_HUB_TEMPLATE)
    said = tokenizer("5" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    with pytest.raises(UserError, match=f"^the chat template of {tmp_path} cannot write a 'tool' message") as error:
        next_turn_ids(tokenizer, "tool", "5", said)
    assert "\n" not in str(error.value) and "must alternate" in str(error.value)
    reply = tokenizer.decode(next_turn_ids(tokenizer, "user", "Sure?", said), skip_special_tokens=False)
    assert reply == "\n<start_of_turn>user\nSure?<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(UserError, match=f"^the chat template of {tmp_path} cannot render messages of roles user, "):
        chat_prompt_ids(tokenizer, conversation("gemma3")[1:4])  # an SFT example holding a tool's reply
