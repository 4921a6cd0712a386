"""The built-in code reward: the completion's Python program run against the example's tests, each case
in the sandbox.

``tests`` is Python code (asserts) appended to the program, a list of such snippets (one case each), or a
list of {"input": stdin, "output": expected stdout} cases (a JSON string of one, or the list itself).
"""

from __future__ import annotations

import json
import re

from areal_hpc.errors import UserError
from areal_hpc.reward.sandbox import run_python

CASE_TIMEOUT_S = 2.0  # wall clock per case; a looping program is stopped here and counted as a timeout
CASE_CPU_S = 3  # above the wall clock, so a busy loop reads as a timeout too
_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)


def code_reward(
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str = "",
    tests=None,
    **fields,
) -> dict:
    """{"reward": 1.0 when every case passes else 0.0, "pass_rate": the fraction passed, "timeouts": cases
    stopped by the wall clock, "killed": cases stopped at another limit}. After a timeout the remaining
    cases are not run (they fail), so a looping program costs one CASE_TIMEOUT_S."""
    cases = _cases(extract_program(completion), tests)
    passed = timeouts = killed = 0
    for code, stdin, expected in cases:
        result = run_python(code, stdin=stdin, timeout_s=CASE_TIMEOUT_S, cpu_s=CASE_CPU_S)
        timeouts += result.timed_out
        killed += result.killed_by is not None and not result.timed_out
        passed += result.returncode == 0 and (expected is None or _same_output(result.stdout, expected))
        if result.timed_out:
            break
    return {
        "reward": float(passed == len(cases)),
        "pass_rate": passed / len(cases),
        "timeouts": timeouts,
        "killed": killed,
    }


def extract_program(completion: str) -> str:
    """The last ```python (or ```py, ```python3) fenced block of the completion, else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _cases(program: str, tests) -> list[tuple[str, str, str | None]]:
    """(code, stdin, expected stdout): the program and its input for an input/output case; the program
    followed by the test code, no input and None for an assert case."""
    if isinstance(tests, str):
        try:
            parsed = json.loads(tests)
        except ValueError:
            parsed = None
        tests = parsed if isinstance(parsed, list) else [tests]
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return [(f"{program}\n\n{t}", "", None) for t in tests]
    if (
        isinstance(tests, list)
        and tests
        and all(isinstance(t, dict) and {"input", "output"} <= t.keys() for t in tests)
    ):
        return [(program, str(t["input"]), str(t["output"])) for t in tests]
    raise UserError(
        "code_reward needs a 'tests' field: Python asserts, a list of them, or a list of "
        f'{{"input": ..., "output": ...}} cases; got {type(tests).__name__} {str(tests)[:80]!r}'
    )


def _same_output(got: str, expected: str) -> bool:
    """Equal line by line, ignoring trailing whitespace on each line and blank lines at the end."""
    return [line.rstrip() for line in got.rstrip().splitlines()] == [
        line.rstrip() for line in expected.rstrip().splitlines()
    ]
