"""Held-out accuracy: greedy completions of eval prompts (from an in-process model, or from the rollout
servers during RL), scored by the task's reward in workers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import prompt_ids


@dataclass
class EvalResult:
    n: int
    correct: int
    mean_reward: float
    reward_failures: int
    samples: list[tuple[str, str, float]] = field(default_factory=list)  # (prompt, completion, reward)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def summary(self) -> str:
        return f"{self.accuracy:.1%} ({self.correct}/{self.n})"

    def scalars(self) -> dict[str, float]:
        return {"eval/accuracy": self.accuracy, "eval/mean_reward": self.mean_reward}


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                       batch_size: int = 64) -> list[str]:
    """Decode each prompt greedily (left-padded batches); special tokens are stripped from the text."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, p in enumerate(chunk):
            ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train(was_training)
    return texts


def evaluate(model, tokenizer, examples: list[Example], rewards: RewardPool, max_new_tokens: int) -> EvalResult:
    """Greedy accuracy of an in-process model (transformers ``generate``)."""
    completions = greedy_completions(model, tokenizer, [prompt_ids(tokenizer, ex.prompt) for ex in examples],
                                     max_new_tokens)
    return score_completions(examples, completions, rewards)


async def evaluate_remote(client, tokenizer, examples: list[Example], rewards: RewardPool,
                          max_new_tokens: int) -> EvalResult:
    """Greedy accuracy of the weights the rollout servers hold, asked over their HTTP API."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": [tokenizer.eos_token_id]}
    generations = await asyncio.gather(*(client.generate(prompt_ids(tokenizer, ex.prompt), sampling)
                                         for ex in examples))
    completions = [tokenizer.decode(g.output_ids, skip_special_tokens=True) for g in generations]
    return await asyncio.to_thread(score_completions, examples, completions, rewards)


def score_completions(examples: list[Example], completions: list[str], rewards: RewardPool,
                      n_samples_kept: int = 3) -> EvalResult:
    outcomes = rewards.score(list(zip(completions, examples)))
    values = [o.value for o in outcomes]
    return EvalResult(
        n=len(examples),
        correct=sum(v == 1.0 for v in values),
        mean_reward=sum(values) / max(1, len(values)),
        reward_failures=sum(o.error is not None for o in outcomes),
        samples=[(ex.prompt, c, v) for ex, c, v in list(zip(examples, completions, values))[:n_samples_kept]],
    )
