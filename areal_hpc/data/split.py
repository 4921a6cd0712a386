"""Deterministic, disjoint train/eval splits for seeded task generators."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from areal_hpc.config import DatasetConfig
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError


def generate_split(
    draw: Callable[[random.Random], Example], cfg: DatasetConfig, name: str
) -> tuple[list[Example], list[Example]]:
    """Draw ``cfg.eval_size`` eval problems first (seed stream 'eval'), then ``cfg.train_size`` train problems
    whose prompt is not in it; a generated task reads no data, so ``cfg.path`` is refused.

    The eval set depends only on (seed, eval_size), so growing the training set never changes it.
    Stops early when the problem space is exhausted rather than looping forever.
    """
    if cfg.path:
        raise UserError(
            f"config key 'dataset.path': {name} generates its problems; dataset.path is read by "
            "dataset.task=custom (your data) and by tasks made from data (gsm8k)"
        )
    seed, train_size, eval_size = cfg.seed, cfg.train_size, cfg.eval_size
    eval_rng, train_rng = random.Random(f"{name}-{seed}-eval"), random.Random(f"{name}-{seed}-train")
    eval_prompts: set[str] = set()
    eval_set = _draw_up_to(draw, eval_rng, eval_size, excluded=eval_prompts, unique=True)
    train = _draw_up_to(draw, train_rng, train_size, excluded=eval_prompts, unique=False)
    return _with_uids(train, name, "train"), _with_uids(eval_set, name, "eval")


def _draw_up_to(draw, rng: random.Random, n: int, excluded: set[str], unique: bool) -> list[Example]:
    """Up to n problems whose prompt is not in ``excluded`` (``unique`` adds each kept prompt to it).

    Gives up after 20 n draws, so a problem space smaller than n yields fewer problems, not a hang.
    """
    kept = []
    for _ in range(20 * n):
        if len(kept) == n:
            break
        ex = draw(rng)
        if ex.prompt not in excluded:
            kept.append(ex)
            if unique:
                excluded.add(ex.prompt)
    return kept


def _with_uids(examples: list[Example], name: str, split: str) -> list[Example]:
    return [replace(ex, uid=f"{name}/{split}/{i}") for i, ex in enumerate(examples)]
