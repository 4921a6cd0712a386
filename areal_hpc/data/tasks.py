"""The task interface: examples with a reference answer, a train/eval split and a pure reward.

``build_task(cfg.dataset)`` returns a ``Task`` whose ``reward(completion, example)`` is a module-level
function (so it pickles into a reward worker process), never raises and is bounded in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from areal_hpc.config import DatasetConfig


@dataclass(frozen=True)
class Example:
    uid: str
    prompt: str  # the user turn, before the chat template
    target: str  # one correct completion, used as the SFT label
    answer: str  # what the reward checks: a number, or the Countdown target
    numbers: tuple[int, ...] = ()  # Countdown only: the numbers to use


RewardFn = Callable[[str, Example], float]


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    reward: RewardFn


def build_task(cfg: DatasetConfig) -> Task:
    from areal_hpc.data import arithmetic, countdown, gsm8k

    builders = {"arithmetic": arithmetic.make_task, "countdown": countdown.make_task, "gsm8k": gsm8k.make_task}
    return builders[cfg.task](cfg)


def corpus_for_tokenizer(seed: int) -> list[str]:
    """Prompts and targets of every task, so the tokenizer's merges fit the text it will see."""
    lines = []
    for task in ("arithmetic", "countdown", "gsm8k"):
        cfg = DatasetConfig(task=task, seed=seed, train_size=1000, eval_size=10)
        cfg.arithmetic.ops = "+-*"
        for ex in build_task(cfg).train:
            lines += [ex.prompt, ex.target]
    return lines
