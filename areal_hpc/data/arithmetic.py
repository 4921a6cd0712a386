"""Multi-digit arithmetic: 'What is 482+37?' -> '519'. Reward 1.0 when the last number is right."""

from __future__ import annotations

import random
from functools import partial

from areal_hpc.config import DatasetConfig
from areal_hpc.data.rewards import RewardFunction, last_number, parse_number
from areal_hpc.data.split import generate_split
from areal_hpc.data.tasks import Example, Task
from areal_hpc.errors import UserError

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def draw_problem(rng: random.Random, min_digits: int, max_digits: int, ops: str) -> Example:
    a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
    op = rng.choice(ops)
    result = OPERATORS[op](a, b)
    return Example(uid="", prompt=f"What is {a}{op}{b}?", target=str(result), answer=str(result))


def reward(prompt: str, completion: str, prompt_ids, completion_ids, answer: str, **fields) -> float:
    """1.0 when the last number in the completion equals the answer, else 0.0."""
    got = last_number(completion)
    return 1.0 if got is not None and got == parse_number(answer) else 0.0


def split(cfg: DatasetConfig, name: str) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems ``dataset.arithmetic`` describes, checked, split under ``name``."""
    a = cfg.arithmetic
    if not a.ops or set(a.ops) - set(OPERATORS):
        raise UserError(f"config key 'dataset.arithmetic.ops': {a.ops!r} must use only {' '.join(OPERATORS)}")
    if a.min_digits > a.max_digits:
        raise UserError(
            f"config key 'dataset.arithmetic.min_digits': {a.min_digits} is above max_digits={a.max_digits}"
        )
    draw = partial(draw_problem, min_digits=a.min_digits, max_digits=a.max_digits, ops=a.ops)
    return generate_split(draw, cfg, name)


def make_task(cfg: DatasetConfig) -> Task:
    train, held_out = split(cfg, "arithmetic")
    return Task("arithmetic", train, held_out, RewardFunction(reward))
