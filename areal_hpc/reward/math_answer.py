"""The built-in math reward: the completion's final answer checked against the reference with math-verify
(boxed LaTeX, fractions, decimals, thousands separators, GSM8K's "#### 72")."""

from __future__ import annotations

import functools
import threading

from math_verify import parse, verify
from math_verify.errors import TimeoutException

MAX_SCORED_CHARS = 4096  # only the completion's tail is parsed: cost stays bounded whatever the model writes
# math-verify bounds each parse and comparison with signal.alarm, which works in the main thread only
# (elsewhere it raises); off the main thread we pass None to turn it off, and the caller's wall clock is
# the only bound left (a hostile answer such as 10^{10^{10^{10}}} can then take that long).
VERIFY_TIMEOUT_S = 2


def math_verify_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], answer: str = "", **fields
) -> float:
    """1.0 when the completion's final answer equals ``answer`` mathematically, else 0.0 (never raises).
    The final answer is the first line after the last "####" of the completion's tail when it has one,
    else what math-verify finds in the tail: the last \\boxed{} first, then "the answer is ..." and the
    like, then the last number or expression. A reference written GSM8K style is cut the same way."""
    timeout = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _parse_gold(str(answer), timeout)
        tail = completion[-MAX_SCORED_CHARS:]
        if "####" in tail:
            predicted = _parse_bare(_after_hashes(tail), timeout)
        else:
            predicted = parse(tail, parsing_timeout=timeout)
        return float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # noqa: BLE001 - math-verify's failures score 0
        return 0.0


def _after_hashes(text: str) -> str:
    """GSM8K writes its answer as "... #### 72": the first line after the last "####"."""
    return text.rsplit("####", 1)[1].strip().split("\n", 1)[0] if "####" in text else text


def _parse_bare(text: str, timeout: int | None) -> list:
    """An answer alone ("0.5", "\\frac12", "2\\pi", "1,234.") is read as LaTeX by boxing it, or as plain
    text where that finds no expression; one with its delimiters ($...$, \\boxed{}) is parsed as it is."""
    if "$" in text or "\\boxed" in text:
        return parse(text, parsing_timeout=timeout)
    text = text.strip().rstrip(".")
    boxed = parse(f"\\boxed{{{text}}}", parsing_timeout=timeout)
    return boxed if any(not isinstance(x, str) for x in boxed) else parse(text, parsing_timeout=timeout)


@functools.lru_cache(maxsize=4096)  # a group of completions shares its reference
def _parse_gold(answer: str, timeout: int | None) -> list:
    return _parse_bare(_after_hashes(answer), timeout)
