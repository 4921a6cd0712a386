"""Multiplication with a calculator tool: 'What is 482*3712?'. The model may answer at once or call
the tool with its whole turn, ``<calc>482*3712</calc>``; the environment (``agents.calculator``)
replies with a ``tool`` message ``<result>1789184</result>`` and the model answers ``1789184``.
Reward 1.0 when the answer's last number is the product.

Operands have ``dataset.arithmetic.min_digits`` to ``max_digits`` digits, operators from
``dataset.arithmetic.ops`` (``configs/agent_calculator.yaml``: 4-digit multiplication, which the tiny
model cannot do in its head; operands of one width, so that copying them into a call is one fixed
distance). The held-out set is plain questions. The training set doubles as the
SFT warm-up's demonstrations, so it mixes three kinds of ``target`` (``DEMO_SHARES``):

- ``call``: the question, and the tool call as the target;
- ``read``: the conversation up to the tool's result (``messages``) and the product as the target,
  which teaches the second turn (the workflow starts every episode from the question, ``prompt``);
- ``direct``: the question, and the product as the target: the model tries to learn it by heart and
  mostly fails, the habit RL has to trade for the tool.
"""

from __future__ import annotations

import random
from dataclasses import replace

from areal_hpc.config import DatasetConfig
from areal_hpc.data import arithmetic
from areal_hpc.data.rewards import RewardFunction, last_number, parse_number
from areal_hpc.data.tasks import Example, Task

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR_OPEN, ERROR_CLOSE = "<error>", "</error>"
TOOL_ROLE = "tool"  # the role of the environment's reply (the chat template renders any role)

# Shares of the training examples by kind of SFT target. Two first turns in seven call the tool, so
# greedy decoding after SFT mostly answers in its head (wrong) while sampling still tries the tool.
# Copying digits (the operands into the call, the result into the answer) is the skill the tool needs,
# and 800 steps of SFT learn it or not depending on the seed; RL then sharpens it only a little.
# Measured (800 steps, greedy after SFT: share of tool calls, share of those right; bench/results/
# agent_calculator.md): call/read/direct 0.2/0.3/0.5: seeds 1/2/3: 24%/32%/15%, 42%/6%/60%;
# 0.1/0.5/0.4: seed 2: 30%, 93%, but seed 1: 35%, 0% (never learnt to copy, RL stayed at 0%);
# 0.15/0.55/0.3 and 0.3/0.4/0.3: seed 2: 93% and 95% tool calls (no room left for RL).
# All with 3-4 digit operands. With exactly 4 digits the same warm-up copies the operands of a call (forced
# to start with <calc>) right on 200/200 (seeds 1, 3) and 188/200 (seed 2) held-out questions, against
# 130/200 with 3-4 digits (seed 1): the variable width, not the shares, was what left copying to chance.
DEMO_SHARES = {"call": 0.2, "read": 0.3, "direct": 0.5}


def call_text(expression: str) -> str:
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def result_text(value: int) -> str:
    return f"{RESULT_OPEN}{value}{RESULT_CLOSE}"


def error_text(message: str) -> str:
    return f"{ERROR_OPEN}{message}{ERROR_CLOSE}"


def expression_of(question: str) -> str:
    """'What is 482*3712?' -> '482*3712'."""
    return question.removeprefix("What is ").removesuffix("?")


def demonstration(example: Example, kind: str) -> Example:
    """``example`` with the SFT target of ``kind`` (``call``, ``read`` or ``direct``)."""
    call = call_text(expression_of(example.prompt))
    if kind == "call":
        return replace(example, target=call)
    if kind == "read":
        messages = (
            {"role": "user", "content": example.prompt},
            {"role": "assistant", "content": call},
            {"role": TOOL_ROLE, "content": result_text(int(example.answer))},
        )
        return replace(example, messages=messages)
    if kind == "direct":
        return example
    raise ValueError(f"unknown demonstration kind {kind!r}")


def with_demonstrations(train: list[Example], seed: int, shares: dict[str, float] = DEMO_SHARES) -> list[Example]:
    """Each training example with a kind of target drawn with ``shares`` (seeded)."""
    rng = random.Random(f"calculator-{seed}-demos")
    kinds, weights = list(shares), list(shares.values())
    return [demonstration(ex, rng.choices(kinds, weights)[0]) for ex in train]


def reward(prompt: str, completion: str, prompt_ids, completion_ids, answer: str, **fields) -> dict:
    """1.0 when the completion's last number is the answer (a tool call is no answer); ``tool_used``:
    whether the conversation before the answer holds a tool result."""
    got = None if CALL_OPEN in completion else last_number(completion)
    value = 1.0 if got is not None and got == parse_number(answer) else 0.0
    return {"reward": value, "tool_used": float(RESULT_OPEN in prompt)}


def make_task(cfg: DatasetConfig) -> Task:
    train, held_out = arithmetic.split(cfg, "calculator")
    return Task("calculator", with_demonstrations(train, cfg.seed), held_out, RewardFunction(reward))
