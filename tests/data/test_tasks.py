"""Tasks and rewards: deterministic splits, and rewards that are right, strict and never crash."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import ArithmeticConfig, DatasetConfig
from areal_hpc.data import arithmetic, countdown, gsm8k
from areal_hpc.data.registry import build_task
from areal_hpc.data.rewards import RewardRequest
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError

TASKS = ["arithmetic", "countdown", "gsm8k"]


def score(reward, completion: str, example: Example) -> float:
    """A reward's value for ``completion`` of ``example``, called as the reward pool calls it."""
    return reward("", completion, [], [], **example.reward_fields())


def small(task: str, **kw) -> DatasetConfig:
    return DatasetConfig(task=task, train_size=300, eval_size=50, **kw)


@pytest.mark.parametrize("name", TASKS)
def test_generators_are_deterministic_and_splits_disjoint(name):
    a, b = build_task(small(name)), build_task(small(name))
    assert a.train == b.train and a.eval == b.eval
    assert not {ex.prompt for ex in a.train} & {ex.prompt for ex in a.eval}
    assert len({ex.uid for ex in a.train + a.eval}) == len(a.train) + len(a.eval)


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_another_seed_gives_other_problems_and_eval_ignores_train_size(name):
    base = build_task(small(name))
    assert build_task(small(name, seed=1)).eval != base.eval
    assert build_task(DatasetConfig(task=name, train_size=10, eval_size=50)).eval == base.eval


@pytest.mark.parametrize("name", TASKS)
def test_reference_targets_score_one(name):
    task = build_task(small(name))
    assert all(
        task.reward(RewardRequest("", ex.target, [], [], ex.reward_fields()))[0] == 1.0 for ex in task.train + task.eval
    )


def test_arithmetic_respects_digits_and_operators():
    cfg = small("arithmetic", arithmetic=ArithmeticConfig(min_digits=2, max_digits=2, ops="*"))
    for ex in build_task(cfg).train:
        a, b = ex.prompt.removeprefix("What is ").removesuffix("?").split("*")
        assert len(a) == len(b) == 2 and int(ex.answer) == int(a) * int(b)


@pytest.mark.parametrize("ops", ["", "+/", "^"])
def test_arithmetic_rejects_unknown_operators(ops):
    cfg = small("arithmetic", arithmetic=ArithmeticConfig(ops=ops))
    with pytest.raises(UserError, match="dataset.arithmetic.ops"):
        build_task(cfg)


def problem(a: int, b: int) -> Example:
    return Example(uid="t", prompt=f"What is {a}+{b}?", target=str(a + b), answer=str(a + b))


@settings(max_examples=300)
@given(
    st.integers(0, 10**12),
    st.integers(0, 10**12),
    st.text(max_size=30).filter(lambda t: not any(c.isdigit() for c in t) and not t.endswith("-")),
)
def test_arithmetic_correct_answer_always_scores_one(a, b, prefix):
    assert score(arithmetic.reward, f"{prefix}{a + b}", problem(a, b)) == 1.0


@settings(max_examples=300)
@given(st.integers(0, 10**12), st.integers(0, 10**12), st.integers(-(10**6), 10**6).filter(lambda d: d != 0))
def test_arithmetic_corrupted_answer_never_scores_one(a, b, delta):
    assert score(arithmetic.reward, str(a + b + delta), problem(a, b)) == 0.0
    assert score(arithmetic.reward, f"{a + b}{abs(delta)}", problem(a, b)) == 0.0


def countdown_problem(numbers, target) -> Example:
    return Example(uid="t", prompt="", target="", answer=str(target), fields={"numbers": list(numbers)})


@settings(max_examples=200)
@given(st.randoms(use_true_random=False), st.integers(2, 6))
def test_countdown_rewards_correct_wrong_and_malformed(rng, count):
    ex = countdown.draw_problem(rng, num_count=count, max_number=30)
    assert score(countdown.reward, ex.target, ex) == 1.0
    expression = ex.target.removeprefix("<answer>").removesuffix("</answer>")
    assert score(countdown.reward, f"<answer>{expression}+1</answer>", ex) == 0.1  # extra number: wrong
    assert score(countdown.reward, f"<answer>({expression})*2</answer>", ex) == 0.1
    assert score(countdown.reward, expression, ex) == 0.0  # no answer tags
    assert score(countdown.reward, f"<answer>{expression} and more</answer>", ex) == 0.0


def test_countdown_requires_each_number_exactly_once():
    ex = countdown_problem([3, 4, 5], 12)
    assert score(countdown.reward, "<answer>3*4</answer>", ex) == 0.1  # right value, 5 unused
    assert score(countdown.reward, "<answer>3*4*5/5</answer>", ex) == 0.1  # 5 used twice
    assert score(countdown.reward, "<answer>(5-3)*4+4</answer>", ex) == 0.1
    assert score(countdown.reward, "<answer>3+4+5</answer>", ex) == 1.0
    assert score(countdown.reward, "<answer>3/(4-4)</answer>", ex) == 0.1  # well-formed, divides by zero
    assert score(countdown.reward, "<answer>3**4</answer>", ex) == 0.0


@settings(max_examples=300)
@given(st.integers(-(10**9), 10**9), st.sampled_from(["", "The answer is ", "so #### ", "#### $"]))
def test_gsm8k_final_answer(value, lead):
    ex = Example(uid="t", prompt="", target="", answer=f"{value:,}")
    assert score(gsm8k.reward, f"reasoning 1+2=3\n{lead}{value}", ex) == 1.0
    assert score(gsm8k.reward, f"#### {value + 1}", ex) == 0.0


GARBAGE = st.one_of(
    st.text(max_size=400),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.lists(
        st.sampled_from(["<answer>", "</answer>", "(", ")", "*", "/", "9", "####", ",", ".", "-"]), max_size=200
    ).map("".join),
)


@settings(max_examples=500)
@given(GARBAGE)
def test_garbage_never_raises(text):
    examples = {
        arithmetic.reward: problem(2, 3),
        countdown.reward: countdown_problem([1, 2, 3], 6),
        gsm8k.reward: Example(uid="t", prompt="", target="", answer="42"),
    }
    for reward, ex in examples.items():
        assert score(reward, text, ex) in (0.0, 0.1, 1.0)


@pytest.mark.parametrize(
    "text", ["(" * 5000 + "1" + ")" * 5000, "9" * 1_000_000, "<answer>" + "9*" * 10**5 + "9</answer>", "1," * 500_000]
)
def test_pathological_completions_are_scored_quickly(text):
    import time

    started = time.perf_counter()
    for reward, ex in (
        (arithmetic.reward, problem(2, 3)),
        (countdown.reward, countdown_problem([1, 2, 3], 6)),
        (gsm8k.reward, Example(uid="t", prompt="", target="", answer="42")),
    ):
        score(reward, text, ex)
    assert time.perf_counter() - started < 2.0


def test_gsm8k_sample_ships_with_the_package_and_loads():
    task = build_task(DatasetConfig(task="gsm8k", eval_size=5))
    rows = task.train + task.eval
    assert len(rows) >= 20 and all(score(gsm8k.reward, r.target, r) == 1.0 for r in rows)


@pytest.mark.parametrize(
    "line, words",
    [
        ("not json", ["bad.jsonl", "cannot read"]),
        ('{"question": "q"}', ["bad.jsonl row 1", "answer"]),
        ('{"question": "q", "answer": "no marker"}', ["bad.jsonl row 1", "####"]),
    ],
)
def test_gsm8k_bad_rows_name_file_and_row(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + line + "\n")
    with pytest.raises(UserError) as err:
        build_task(DatasetConfig(task="gsm8k", path=str(path)))
    assert all(w in str(err.value) for w in words)


def test_gsm8k_separate_eval_file(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "#### 3"}) + "\n")
    task = build_task(DatasetConfig(task="gsm8k", eval_path=str(path)))
    assert [ex.prompt for ex in task.eval] == ["How many?"]
    assert len(task.train) == len(gsm8k.sample_path().read_text().strip().splitlines())  # every sample row


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tiny_model_dir):
    from areal_hpc.models.hf import load_tokenizer
    from areal_hpc.train.task_setup import fit_prompts

    tokenizer = load_tokenizer(tiny_model_dir)
    examples = [Example(str(n), "word " * n) for n in (1, 5, 50, 500)]
    kept, dropped = fit_prompts(examples, tokenizer, limit=60)
    assert [ex.uid for ex in kept] == ["1", "5"] and dropped == 2
