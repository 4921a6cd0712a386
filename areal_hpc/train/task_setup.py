"""A run's task as the trainer, SFT and ``areal-hpc eval`` use it: built from the config (your data,
reward and workflow, or a built-in), prompts longer than the context dropped and counted, and the
reward pools it is scored in: the task's own reward for evaluations, and for RL rollouts the reward
model of ``reward.model`` when one is set."""

from __future__ import annotations

import json
from pathlib import Path

from areal_hpc.agents.registry import build_workflow
from areal_hpc.config import RunConfig
from areal_hpc.data.registry import build_task
from areal_hpc.data.rewards import RewardFunction, RewardPool
from areal_hpc.data.tasks import Example, Task
from areal_hpc.errors import UserError
from areal_hpc.models.chat import example_prompt_ids
from areal_hpc.train.reward_model import RewardModelScore, check_reward_model


def prompt_token_limit(cfg: RunConfig, model_dir: str | Path) -> int:
    """``dataset.max_prompt_tokens``, else the context (``rollout.context_length`` or the model's) less
    ``generation.max_new_tokens``."""
    if cfg.dataset.max_prompt_tokens:
        return cfg.dataset.max_prompt_tokens
    context = cfg.rollout.context_length
    if not context:
        try:
            context = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
        except (OSError, ValueError, KeyError):
            return 1 << 30  # a model folder that does not say: the servers refuse what does not fit
    return max(1, context - cfg.generation.max_new_tokens)


def fit_prompts(examples: list[Example], tokenizer, limit: int) -> tuple[list[Example], int]:
    """(the examples whose rendered prompt has at most ``limit`` tokens, how many were dropped)."""
    kept = [ex for ex in examples if len(example_prompt_ids(tokenizer, ex)) <= limit]
    return kept, len(examples) - len(kept)


def open_task(cfg: RunConfig, tokenizer, model_dir: str | Path, say=print) -> Task:
    """The run's task with the prompts that fit (what was dropped is said through ``say``)."""
    task = build_task(cfg.dataset, cfg.reward)
    if cfg.reward.model:
        check_reward_model(cfg.reward.model)
        task.reward = task.reward or model_reward(cfg)  # your data scored by the reward model alone
    if cfg.reward.workers == 0 and (cfg.reward.fn or cfg.reward.model):
        say(
            "reward.workers=0: your reward runs in the trainer's process, where reward.timeout_s cannot stop it; "
            "reward.workers=1 isolates it"
        )
    limit = prompt_token_limit(cfg, model_dir)
    task.train, dropped_train = fit_prompts(task.train, tokenizer, limit)
    task.eval, dropped_eval = fit_prompts(task.eval, tokenizer, limit)
    if dropped_train or dropped_eval:
        say(f"dropped {dropped_train} training and {dropped_eval} held-out prompts longer than {limit} tokens")
    if not task.train:
        raise UserError(
            f"no training prompt of {cfg.dataset.task} fits in {limit} tokens (set "
            "dataset.max_prompt_tokens, rollout.context_length or generation.max_new_tokens)"
        )
    return task


def check_task(cfg: RunConfig) -> None:
    """Read the data, load the reward and build the workflow once before anything starts: a bad path, a
    missing column or user code that does not import is one line, not a failed job."""
    build_task(cfg.dataset, cfg.reward)
    if cfg.reward.model:
        check_reward_model(cfg.reward.model)
    build_workflow(cfg.rollout)


def check_inputs(cfg: RunConfig, reach: bool = True) -> None:
    """What a resolved run reads besides its config, checked once before anything starts: the task (your
    data, reward and workflow), the distillation teacher (with ``reach``, the server itself: a local launch;
    a Slurm job's nodes may reach what the login node cannot), and LoRA's peft and target modules against the
    starting model. The last two import torch, for the runs that use them only."""
    check_task(cfg)
    if cfg.distill.teacher_url:
        from areal_hpc.train.distill import check_teacher

        check_teacher(cfg, reach=reach)
    if cfg.actor.lora.rank:
        from areal_hpc.engines.torch.lora import check_lora

        check_lora(cfg)


def model_reward(cfg: RunConfig) -> RewardFunction:
    return RewardFunction(RewardModelScore(cfg.reward.model), "reward.model")


def reward_pool(cfg: RunConfig, task: Task, training: bool = False) -> RewardPool:
    """The pool that scores evaluations (the task's reward), or with ``training`` the RL rollouts (the
    reward model of ``reward.model`` when one is set)."""
    reward = model_reward(cfg) if training and cfg.reward.model else task.reward
    return RewardPool(reward, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
