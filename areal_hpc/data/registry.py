"""The task a run trains on: ``build_task(cfg.dataset, cfg.reward)`` (a built-in generator, GSM8K, your
own ``make_task``, or your data with your reward) and the text the tiny tokenizer is trained on."""

from __future__ import annotations

from areal_hpc import builtins
from areal_hpc.config import ArithmeticConfig, DatasetConfig, RewardConfig
from areal_hpc.data.rewards import RewardFunction
from areal_hpc.data.tasks import Task
from areal_hpc.data.user_data import read_rows, split_examples
from areal_hpc.errors import UserError


def build_task(cfg: DatasetConfig, reward: RewardConfig | None = None) -> Task:
    """The task ``cfg`` names, its reward replaced by ``reward.fn`` when that is set (checked to load here,
    so a bad spec is one line before anything starts). ``reward.model`` is the trainer's to load
    (``train.task_setup``): a custom task with it and no ``reward.fn`` has no reward here."""
    if reward is not None and reward.fn and reward.model:
        raise UserError(
            "config keys 'reward.fn' and 'reward.model' are both set: RL trains on one reward (the "
            "task's own, or reward.fn, still scores evaluations beside reward.model)"
        )
    if builtins.is_custom_task(cfg.task):
        if not cfg.path:
            raise UserError(
                "config key 'dataset.path': dataset.task=custom trains on your data: give "
                "dataset.path (a JSONL, Parquet or Arrow file, a glob or a folder)"
            )
        if reward is None or not (reward.fn or reward.model):
            raise UserError(
                "config key 'reward.fn': dataset.task=custom needs your reward: "
                "reward.fn='package.module:function' or 'path/to/file.py:function' (or reward.model)"
            )
        train, held_out = split_examples(cfg, "custom", read_rows)
        task = Task("custom", train, held_out, None)
    else:
        task = builtins.load("task", cfg.task)(cfg)
        if not isinstance(task, Task):
            raise UserError(
                f"config key 'dataset.task': {cfg.task!r} returned a {type(task).__name__}, not a Task "
                "(areal_hpc.data.tasks.Task: train and held-out examples with their reward)"
            )
    if reward is not None and reward.fn:
        builtins.load("reward", reward.fn)
        task.reward = RewardFunction(builtins.spec_of("reward", reward.fn))
    return task


def corpus_for_tokenizer(seed: int) -> list[str]:
    """Prompts and targets of every built-in task, so the tokenizer's merges fit the text it will see."""
    lines = []
    for task in builtins.POINTS["task"].builtins:
        cfg = DatasetConfig(task=task, seed=seed, train_size=1000, eval_size=10, arithmetic=ArithmeticConfig(ops="+-*"))
        for ex in build_task(cfg).train:
            lines += [ex.prompt, ex.target]
    return lines
