"""Built-in string rewards: the completion's final answer equal to the reference, or matching a regex.

The final answer is read from the last MAX_SCORED_CHARS characters of the completion: the first non-empty
line after the last "Answer:" (any case) when there is one, else the last non-empty line.
"""

from __future__ import annotations

import re

import regex  # re's API with a timeout: a pattern that backtracks without end is cut off

MAX_SCORED_CHARS = 4096
REGEX_TIMEOUT_S = 1.0
_ANSWER = re.compile(r"answer:", re.IGNORECASE)


def final_answer(completion: str) -> str:
    """The completion's final answer, stripped (empty when it has no non-empty line)."""
    tail = completion[-MAX_SCORED_CHARS:]
    after = _ANSWER.split(tail)
    lines = [line.strip() for line in after[-1].splitlines() if line.strip()]
    if len(after) > 1:
        return lines[0] if lines else ""
    return lines[-1] if lines else ""


def exact_match_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], answer: str = "", **fields
) -> float:
    """1.0 when the final answer equals ``answer``, both stripped and case-folded; else 0.0."""
    try:
        return float(final_answer(completion).casefold() == str(answer).strip().casefold())
    except Exception:  # noqa: BLE001 - a completion that is not text
        return 0.0


def regex_reward(
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str = "",
    pattern: str | None = None,
    **fields,
) -> float:
    """1.0 when the regex (the example's ``pattern`` field, else ``answer`` itself) matches the whole
    final answer; 0.0 otherwise, for a bad regex, or when matching takes over REGEX_TIMEOUT_S."""
    try:
        return float(
            regex.fullmatch(
                str(answer if pattern is None else pattern), final_answer(completion), timeout=REGEX_TIMEOUT_S
            )
            is not None
        )
    except Exception:  # noqa: BLE001 - regex.error, TimeoutError, a completion that is not text
        return 0.0
