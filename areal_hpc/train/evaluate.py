"""Held-out accuracy, one path: greedy completions of the eval prompts from a ``generate`` function,
scored by the task's reward in workers.

During RL ``generate`` is the rollout servers' (``RolloutClient.generate``); for a model in this
process (SFT, ``areal-hpc eval``) it is an ``EmbeddedEngine`` running on that model, the decoder the
embedded servers run, so a model scores the same in-process and behind a server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import prompt_ids
from areal_hpc.rollout.embedded_engine import EmbeddedEngine, Result, SamplingParams

# (prompt ids, SGLang sampling params) -> anything with ``output_ids``
GenerateFn = Callable[[list[int], dict], Awaitable]
EVAL_SLOTS = 64  # sequences an in-process evaluation decodes together


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


async def evaluate(generate: GenerateFn, tokenizer, examples: list[Example], rewards: RewardPool,
                   max_new_tokens: int) -> EvalResult:
    """Greedy accuracy of whatever ``generate`` decodes with (special tokens stripped from the text)."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": [tokenizer.eos_token_id]}
    generations = await asyncio.gather(*(generate(prompt_ids(tokenizer, ex.prompt), sampling) for ex in examples))
    completions = [tokenizer.decode(g.output_ids, skip_special_tokens=True) for g in generations]
    return await asyncio.to_thread(score_completions, examples, completions, rewards)


async def evaluate_remote(client, tokenizer, examples: list[Example], rewards: RewardPool,
                          max_new_tokens: int) -> EvalResult:
    """Greedy accuracy of the weights the rollout servers hold, asked over their HTTP API."""
    return await evaluate(client.generate, tokenizer, examples, rewards, max_new_tokens)


def evaluate_model(model: torch.nn.Module, tokenizer, examples: list[Example], rewards: RewardPool,
                   max_new_tokens: int) -> EvalResult:
    """Greedy accuracy of a model in this process, decoded by an embedded engine on it (which puts
    the model in evaluation mode; a training step puts it back)."""
    longest = max((len(prompt_ids(tokenizer, ex.prompt)) for ex in examples), default=1)
    engine = EmbeddedEngine(model, slots=min(EVAL_SLOTS, max(1, len(examples))),
                            context_length=longest + max_new_tokens, eos_token_ids=[tokenizer.eos_token_id])

    async def generate(input_ids: list[int], sampling: dict) -> Result:
        return await engine.generate(uuid.uuid4().hex, input_ids, SamplingParams.from_json(sampling))

    try:
        return asyncio.run(evaluate(generate, tokenizer, examples, rewards, max_new_tokens))
    finally:
        engine.stop()


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
