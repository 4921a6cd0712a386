"""The task interface: examples with a reference answer, a train/eval split and a pure reward.

A task's ``reward(completion, example)`` is a module-level function (so it pickles into a reward
worker process), never raises and is bounded in time. ``data.registry.build_task`` builds one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


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
