"""A tool-using agent: the model may call a calculator before it answers.

Each model turn ends at the end-of-turn token. A turn that starts with ``<calc>`` is a tool call:
``<calc>EXPR</calc>`` as the whole turn; the environment evaluates ``EXPR`` safely (``calculate``) and
replies with a ``tool`` message, ``<result>N</result>`` or ``<error>why</error>`` (a malformed or
refused call is an observation, never an exception), and the model takes another turn. Any other
turn is the answer, scored by the run's reward function (``engine.reward``: the task's or your
``reward.fn``). At most ``max_turns`` model turns; an episode that is still calling the tool then
scores 0 without an answer. The tool's replies are context (``input_ids``), never trained on.

``dataset.task=calculator`` is the matching task (``data.calculator``: the formats, the SFT
demonstrations); ``configs/agent_calculator.yaml`` the demo.
"""

from __future__ import annotations

import ast
import re

from areal_hpc.data.calculator import CALL_CLOSE, CALL_OPEN, TOOL_ROLE, error_text, result_text
from areal_hpc.data.tasks import Example

MAX_EXPRESSION_CHARS = 64  # longer calls are refused before parsing (deep nesting cannot reach ast)
MAX_LITERAL_DIGITS = 18
MAX_RESULT_DIGITS = 40  # no intermediate value may grow past this (a chain of products stays cheap)
_CHARACTERS = re.compile(r"[0-9+\-*() ]*")  # decimal integers only: no 0x10, 1_000, names or calls
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class ToolError(ValueError):
    """A call the calculator refuses; its message is what the model reads."""


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if len(str(abs(node.value))) > MAX_LITERAL_DIGITS:
            raise ToolError(f"numbers have at most {MAX_LITERAL_DIGITS} digits")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and len(str(abs(left))) + len(str(abs(right))) > MAX_RESULT_DIGITS + 1:
            raise ToolError("result too large")
        result = _OPERATORS[type(node.op)](left, right)
        if len(str(abs(result))) > MAX_RESULT_DIGITS:
            raise ToolError("result too large")
        return result
    raise ToolError("only integers, + - * and parentheses")


def calculate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses, or ``ToolError``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _CHARACTERS.fullmatch(expression.strip()):
        raise ToolError("only integers, + - * and parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("not an expression") from None
    return _value(tree.body)


def tool_call(text: str) -> str | None:
    """The expression text of a turn that is a tool call (``''`` when it is malformed), None when the
    turn is an answer."""
    text = text.strip()
    if not text.startswith(CALL_OPEN):
        return None
    inner = text[len(CALL_OPEN) :]
    if not inner.endswith(CALL_CLOSE) or CALL_CLOSE in inner[: -len(CALL_CLOSE)]:
        return ""
    return inner[: -len(CALL_CLOSE)]


def run_tool(call: str) -> str:
    """The environment's reply to a tool call's expression: a result or an error, never an exception."""
    if not call.strip():
        return error_text("malformed call: one expression between the calc tags")
    try:
        return result_text(calculate(call))
    except ToolError as exc:
        return error_text(str(exc))
    except Exception as exc:  # noqa: BLE001 - the tool is the environment: it must never end an episode
        return error_text(type(exc).__name__)


class CalculatorWorkflow:
    def __init__(self, max_turns: int = 3):
        if max_turns < 1:
            raise ValueError(f"max_turns = {max_turns}; it must be >= 1")
        self.max_turns = max_turns

    async def arun_episode(self, engine, example: Example):
        episode = engine.episode(prompt_ids=engine.opening_ids(example))
        for turn in range(self.max_turns):
            generation = await episode.generate()
            text = engine.decode(generation.output_ids)
            call = tool_call(text)
            if call is None:
                episode.reward(
                    await engine.reward(example, text, generation.output_ids, prompt_ids=generation.input_ids)
                )
                break
            if turn + 1 == self.max_turns:
                episode.reward(0.0)  # still calling the tool: no answer
                break
            episode.observe_message(run_tool(call), role=TOOL_ROLE)
        return [episode.trajectory()]
