"""The built-in math, exact-match and regex rewards: their matching rules, garbage that scores 0 instead of
raising, and the same results from a thread and from a spawned worker process."""

import multiprocessing as mp
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.reward.match import exact_match_reward, final_answer, regex_reward
from areal_hpc.reward.math_answer import math_verify_reward


def math(completion, answer):
    return math_verify_reward("prompt", completion, [1, 2], [3], answer=answer)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # GSM8K
        ("She sold 48 + 24 = 72 clips.\n#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),
        ("#### 72.\nThat is all.", "72", 1.0),  # the first line after the last ####
        ("So the answer is 72.", "72", 1.0),
        ("Adding up, \\boxed{72}", "72", 1.0),
        ("Hence $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),  # MATH
        ("Hence $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
        ("\\boxed{1+x}", "x+1", 1.0),
        ("#### 2\\pi", "2\\pi", 1.0),
        ("The total is 1,234 dollars.", "1234", 1.0),  # thousands separators, both ways
        ("\\boxed{1234}", "1,234", 1.0),
        ("x" * 10_000 + " the answer is 72", "72", 1.0),  # only the tail is read
        ("The answer is 73.", "72", 0.0),
        ("\\boxed{72} is what I first thought, but the answer is \\boxed{71}", "72", 0.0),
        ("garbage \\boxed{", "72", 0.0),
        ("\x00\x01{{{{}}}}\\frac{", "72", 0.0),
        ("", "72", 0.0),
        ("\\boxed{}", "", 0.0),
        (None, "72", 0.0),
    ],
)
def test_math_answers(completion, answer, expected):
    assert math(completion, answer) == expected


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.integers(-(10**12), 10**12), st.fractions(min_value=-1000, max_value=1000, max_denominator=1000)))
def test_a_boxed_number_matches_itself_and_not_its_successor(n):
    assert math(f"\\boxed{{{n}}}", str(n)) == 1.0
    assert math(f"\\boxed{{{n}}}", str(n + 1)) == 0.0


def test_a_huge_power_is_cut_off_by_math_verify_timeout_in_the_main_thread():
    started = time.monotonic()
    assert math("\\boxed{10^{10^{10^{10}}}}", "10") == 0.0
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Let me think.\nAnswer: Paris\n\nHope this helps.", "Paris"),
        ("answer:\n\n  Rome  ", "Rome"),
        ("answer: x\nANSWER: y", "y"),
        ("Reasoning\n\n  42  \n\n", "42"),
        ("", ""),
    ],
)
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("Thinking...\nAnswer:  PARIS ", "paris", 1.0),
        ("Straße", "STRASSE", 1.0),  # case-folded
        ("paris\nor maybe not", "paris", 0.0),
        ("Answer: Paris.", "Paris", 0.0),  # exact: punctuation counts
        (None, "x", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match_reward("p", completion, [], [], answer=answer) == expected


@pytest.mark.parametrize(
    "completion, fields, expected",
    [
        ("Answer: 42", {"answer": r"\d+"}, 1.0),  # the answer is the regex when there is no pattern field
        ("Answer: 42 apples", {"answer": r"\d+"}, 0.0),  # a full match
        ("Answer: 42", {"answer": "x", "pattern": r"4\d"}, 1.0),
        ("Answer: 42", {"answer": "(("}, 0.0),  # a bad regex
        ("Answer: 42", {"answer": "42", "pattern": "[unclosed"}, 0.0),
        ("Answer: " + "a" * 35 + "b", {"answer": "(a|aa)+c"}, 0.0),  # backtracking without end: cut off
    ],
)
def test_regex(completion, fields, expected):
    started = time.monotonic()
    assert regex_reward("p", completion, [], [], **fields) == expected
    assert time.monotonic() - started < 5


CALLS = [
    (math_verify_reward, ("p", "so \\boxed{\\frac{1}{2}}", [], []), {"answer": "0.5"}, 1.0),
    (math_verify_reward, ("p", "#### 73", [], []), {"answer": "72"}, 0.0),
    (exact_match_reward, ("p", "Answer: yes", [], []), {"answer": "YES"}, 1.0),
    (regex_reward, ("p", "Answer: 2024", [], []), {"answer": r"\d{4}"}, 1.0),
]


def test_rewards_from_a_thread():
    """Off the main thread math-verify's signal timeout is off: no 'signal only works in main thread'."""
    results = []
    thread = threading.Thread(target=lambda: results.extend(fn(*a, **kw) for fn, a, kw, _ in CALLS))
    thread.start()
    thread.join()
    assert results == [expected for *_, expected in CALLS]


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def test_rewards_from_a_spawned_worker():
    with mp.get_context("spawn").Pool(1) as pool:
        results = pool.starmap(_call, [(fn, a, kw) for fn, a, kw, _ in CALLS])
    assert results == [expected for *_, expected in CALLS]
