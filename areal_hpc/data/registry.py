"""The tasks by name: ``build_task(cfg.dataset)`` and the text the tiny tokenizer is trained on."""

from __future__ import annotations

from areal_hpc.config import DatasetConfig
from areal_hpc.data import arithmetic, countdown, gsm8k
from areal_hpc.data.tasks import Task


def build_task(cfg: DatasetConfig) -> Task:
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
