"""Deterministic, disjoint train/eval splits for seeded task generators."""

from __future__ import annotations

import random
from typing import Callable

from areal_hpc.data.tasks import Example


def generate_split(draw: Callable[[random.Random], Example], seed: int, train_size: int, eval_size: int,
                   name: str) -> tuple[list[Example], list[Example]]:
    """Draw the eval set first (seed stream 'eval'), then train problems whose prompt is not in it.

    The eval set depends only on (seed, eval_size), so growing the training set never changes it.
    Stops early when the problem space is exhausted rather than looping forever.
    """
    eval_rng, train_rng = random.Random(f"{name}-{seed}-eval"), random.Random(f"{name}-{seed}-train")
    eval_set, seen = [], set()
    for _ in range(eval_size * 20):
        if len(eval_set) == eval_size:
            break
        ex = draw(eval_rng)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            eval_set.append(ex)
    train = []
    for _ in range(train_size * 20):
        if len(train) == train_size:
            break
        ex = draw(train_rng)
        if ex.prompt not in seen:
            train.append(ex)
    return _with_uids(train, name, "train"), _with_uids(eval_set, name, "eval")


def _with_uids(examples: list[Example], name: str, split: str) -> list[Example]:
    from dataclasses import replace

    return [replace(ex, uid=f"{name}/{split}/{i}") for i, ex in enumerate(examples)]
