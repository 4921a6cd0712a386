"""Countdown: reach a target with the given numbers, each used exactly once, with + - * /.

Reward (as in the TinyZero/AReaL recipes): 1.0 for a correct equation in <answer>...</answer>,
0.1 for a well-formed arithmetic expression that is wrong, 0.0 otherwise.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from functools import partial

from areal_hpc.config import DatasetConfig
from areal_hpc.data.rewards import RewardFunction, tail
from areal_hpc.data.split import generate_split
from areal_hpc.data.tasks import Example, Task

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EXPRESSION_CHARS = re.compile(r"^[\d\s+\-*/()]+$")
MAX_EXPRESSION_CHARS = 100  # bounds parsing and the size of any integer the evaluation can build
_SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction]:
    """Combine the numbers in shuffled order with random operators (exact division only)."""
    first, *rest = rng.sample(numbers, len(numbers))
    text, value, additive = str(first), Fraction(first), False
    for n in rest:
        op = rng.choice(["+", "-", "*"] + (["/"] if value % n == 0 else []))
        if op in "*/" and additive:
            text = f"({text})"
        text, value, additive = f"{text}{op}{n}", _SYMBOLS[op](value, Fraction(n)), op in "+-"
    return text, value


def draw_problem(rng: random.Random, num_count: int, max_number: int) -> Example:
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_count)]
        expression, value = _random_expression(rng, numbers)
        if value.denominator == 1 and value > 0:
            break
    prompt = (
        f"Using the numbers {numbers}, create an equation that equals {value}. "
        "Use each number once with + - * /. Answer as <answer>equation</answer>."
    )
    return Example(
        uid="", prompt=prompt, target=f"<answer>{expression}</answer>", answer=str(value), fields={"numbers": numbers}
    )


def evaluate_expression(text: str) -> tuple[Fraction | None, list[int]] | None:
    """Exact value and the integers used; None when the text is not a + - * / expression over
    integers. The value is None for a well-formed expression that divides by zero."""
    if len(text) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.match(text):
        return None
    used: list[int] = []
    try:
        return _eval_node(ast.parse(text.strip(), mode="eval").body, used), used
    except ZeroDivisionError:
        return None, used
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _eval_node(node, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval_node(node.left, used), _eval_node(node.right, used))
    raise ValueError("not a + - * / expression over integers")


def reward(
    prompt: str, completion: str, prompt_ids, completion_ids, answer: str, numbers: list[int], **fields
) -> float:
    answers = _ANSWER.findall(tail(completion))
    if not answers:
        return 0.0
    result = evaluate_expression(answers[-1])
    if result is None:
        return 0.0
    value, used = result
    correct = value is not None and value == int(answer) and sorted(used) == sorted(numbers)
    return 1.0 if correct else 0.1


def make_task(cfg: DatasetConfig) -> Task:
    draw = partial(draw_problem, num_count=cfg.countdown.num_count, max_number=cfg.countdown.max_number)
    train, held_out = generate_split(draw, cfg, "countdown")
    return Task("countdown", train, held_out, RewardFunction(reward))
