"""The tasks by name: ``build_task(cfg.dataset, cfg.reward)`` (a built-in generator, GSM8K, or your
data with your reward) and the text the tiny tokenizer is trained on."""

from __future__ import annotations

from areal_hpc.config import DatasetConfig, RewardConfig
from areal_hpc.data import arithmetic, calculator, countdown, gsm8k
from areal_hpc.data.rewards import RewardFunction
from areal_hpc.data.tasks import Task
from areal_hpc.data.user_data import read_rows, split_examples
from areal_hpc.errors import UserError
from areal_hpc.plugins import load_object

BUILT_IN = {"arithmetic": arithmetic.make_task, "countdown": countdown.make_task, "gsm8k": gsm8k.make_task,
            "calculator": calculator.make_task}


def build_task(cfg: DatasetConfig, reward: RewardConfig | None = None) -> Task:
    """The task ``cfg`` names, its reward replaced by ``reward.fn`` when that is set (checked to load here,
    so a bad spec is one line before anything starts). ``reward.model`` is the trainer's to load
    (``train.task_setup``): a custom task with it and no ``reward.fn`` has no reward here."""
    if reward is not None and reward.fn and reward.model:
        raise UserError("config keys 'reward.fn' and 'reward.model' are both set: RL trains on one reward (the "
                        "task's own, or reward.fn, still scores evaluations beside reward.model)")
    if cfg.task == "custom":
        if not cfg.path:
            raise UserError("config key 'dataset.path': dataset.task=custom trains on your data: give "
                            "dataset.path (a JSONL, Parquet or Arrow file, a glob or a folder)")
        if reward is None or not (reward.fn or reward.model):
            raise UserError("config key 'reward.fn': dataset.task=custom needs your reward: "
                            "reward.fn='package.module:function' or 'path/to/file.py:function' (or reward.model)")
        train, held_out = split_examples(cfg, "custom", read_rows)
        task = Task("custom", train, held_out, None)
    elif cfg.path and cfg.task != "gsm8k":
        raise UserError(f"config key 'dataset.path': {cfg.task} generates its problems; dataset.path is read with "
                        "dataset.task=custom (your data) or gsm8k")
    else:
        task = BUILT_IN[cfg.task](cfg)
    if reward is not None and reward.fn:
        load_object(reward.fn, "reward.fn")
        task.reward = RewardFunction(reward.fn)
    return task


def corpus_for_tokenizer(seed: int) -> list[str]:
    """Prompts and targets of every built-in task, so the tokenizer's merges fit the text it will see."""
    lines = []
    for task in BUILT_IN:
        cfg = DatasetConfig(task=task, seed=seed, train_size=1000, eval_size=10)
        cfg.arithmetic.ops = "+-*"
        for ex in build_task(cfg).train:
            lines += [ex.prompt, ex.target]
    return lines
