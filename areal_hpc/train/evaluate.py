"""Held-out evaluation, one path for every task and workflow: each eval prompt runs the run's workflow
(greedy by default, or ``n_samples`` sampled episodes for pass@k), scored by the run's reward.

During RL the engine generates on the rollout servers (``RolloutClient.generate``); for a model in
this process (SFT, ``areal-hpc eval``) on an ``EmbeddedGenerator`` running it, the decoder the embedded
servers run, so a model scores the same in-process and behind a server. ``HeldOutTask`` is the run's task
set up for that (SFT's evaluation, and DPO's with ``preference.eval_task``). Failed episodes and rewards
score 0 and are counted by kind in ``EvalResult.failures``, as the rollout controller counts them.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from areal_hpc.agents.chat import optional_chat
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer, derive_seed
from areal_hpc.agents.groups import run_episode
from areal_hpc.agents.registry import build_workflow
from areal_hpc.agents.rlvr import RLVRWorkflow
from areal_hpc.config import RunConfig
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example, Task
from areal_hpc.rollout.client import Generation
from areal_hpc.rollout.controller import FailureLog, failure_of
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, SamplingParams
from areal_hpc.train.task_setup import reward_pool

EVAL_SLOTS = 64  # sequences an in-process evaluation decodes together
EVAL_BATCH = 64  # generations per /generate request of an evaluation through the rollout servers


@dataclass
class EvalResult:
    n: int  # prompts
    correct: int  # prompts whose first episode scored 1
    mean_reward: float
    reward_failures: int
    samples: list[tuple[str, str, float]] = field(default_factory=list)  # (prompt, completion, reward)
    pass_at: dict[int, float] = field(default_factory=dict)  # k -> pass@k (unbiased, over n samples a prompt)
    episodes: list[dict] = field(default_factory=list)  # one per episode: what `areal-hpc eval --out` writes
    episode_failures: int = 0  # episodes whose workflow raised (scored 0)
    failures: FailureLog = field(default_factory=FailureLog)  # failed episodes and rewards by kind, the first of each

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def summary(self) -> str:
        return f"{self.accuracy:.1%} ({self.correct}/{self.n})"

    def failed(self) -> str:
        """What failed, to follow ``summary`` in a progress line: "" when nothing did."""
        if not self.failures.total:
            return ""
        first = next(iter(self.failures.first.values()))
        return f"; {self.failures.total} failed ({self.failures.summary()}), the first: {first}"

    def scalars(self) -> dict[str, float]:
        return {"eval/accuracy": self.accuracy, "eval/mean_reward": self.mean_reward}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``c`` correct out of ``n`` samples (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


async def evaluate(
    settings: EpisodeSettings,
    workflow,
    examples: list[Example],
    n_samples: int = 1,
    greedy: bool = True,
    samples_kept: int = 3,
    seed: int | None = None,
) -> EvalResult:
    """Run ``workflow`` ``n_samples`` times on each example (greedy: at temperature 0); sampled episodes
    with a ``seed`` draw the same samples every time (sample j of example i: seed (seed, i, j))."""
    if greedy:
        settings = replace(settings, sampling=settings.sampling.greedy())
    settings = settings.for_group(EVAL_BATCH)  # the examples' first turns: a few batched requests, not one each
    engines = [
        [EpisodeContext(settings, None if seed is None else derive_seed(seed, i, j)) for j in range(n_samples)]
        for i in range(len(examples))
    ]
    outcomes = await asyncio.gather(
        *(run_episode(workflow, engine, ex) for ex, row in zip(examples, engines) for engine in row),
        return_exceptions=True,
    )
    episodes, failures = [], FailureLog()
    for i, (example, row) in enumerate(zip(examples, engines)):
        for j, engine in enumerate(row):
            outcome = outcomes[i * n_samples + j]
            for reward in engine.outcomes:
                if reward.error:
                    failures.add(f"reward_{reward.error_kind}", f"{example.uid}: {reward.error}")
            error = None
            if isinstance(outcome, BaseException):
                kind, error = failure_of(outcome)
                failures.add(kind, f"{example.uid}: {error}")
            episodes.append(_episode_row(example, engine, outcome, error))
    values = [e["reward"] for e in episodes]
    correct = [
        sum(e["reward"] == 1.0 for e in episodes[i * n_samples : (i + 1) * n_samples]) for i in range(len(examples))
    ]
    ks = sorted({1, n_samples} | {k for k in (2, 4, 8, 16, 32, 64) if k < n_samples})
    return EvalResult(
        n=len(examples),
        correct=sum(e["reward"] == 1.0 for e in episodes[::n_samples]),
        mean_reward=sum(values) / max(1, len(values)),
        reward_failures=sum(sum(o.error is not None for o in engine.outcomes) for row in engines for engine in row),
        samples=[(e["prompt"], e["completion"], e["reward"]) for e in episodes[::n_samples][:samples_kept]],
        pass_at={k: sum(pass_at_k(n_samples, c, k) for c in correct) / max(1, len(examples)) for k in ks},
        episodes=episodes,
        episode_failures=sum(isinstance(o, BaseException) for o in outcomes),
        failures=failures,
    )


def _episode_row(example: Example, engine: EpisodeContext, outcome, error: str | None) -> dict:
    """``outcome``: the episode's records, or (with ``error``, why) the exception it raised."""
    if error is not None:
        return {
            "example": example.uid,
            "prompt": example.prompt,
            "completion": "",
            "reward": 0.0,
            "turns": 0,
            "error": error,
        }
    reward = outcome[0].reward or 0.0 if outcome else 0.0
    last = outcome[0].segments[-1].output_ids if outcome else []
    return {
        "example": example.uid,
        "prompt": example.prompt or str(list(example.messages)),
        "completion": engine.decode(last),
        "reward": reward,
        "turns": len(outcome[0].segments) if outcome else 0,
        "answer": str(example.answer),
    }


def evaluate_model(
    model: torch.nn.Module,
    tokenizer,
    examples: list[Example],
    rewards: RewardPool,
    sampling: Sampling,
    workflow=None,
    model_folder=None,
    n_samples: int = 1,
    greedy: bool = True,
    discount: float = 1.0,
    seed: int | None = None,
) -> EvalResult:
    """Evaluate a model in this process, decoded by an embedded engine on it (which puts the model in
    evaluation mode; a training step puts it back). ``model_folder``: where its tokenizer and chat
    template are, for workflows that chat."""
    engine = EmbeddedGenerator(  # the model's whole context, as a rollout server's: the KV cache grows on demand
        model,
        slots=min(EVAL_SLOTS, max(1, len(examples) * n_samples)),
        eos_token_ids=[tokenizer.eos_token_id],
    )

    async def generate(input_ids: list[int], params: dict) -> Generation:
        result = await engine.generate(uuid.uuid4().hex, input_ids, SamplingParams.from_json(params))
        if result.error:
            raise RuntimeError(result.error)
        return Generation(list(input_ids), result.output_ids, result.logprobs, result.versions, result.finish_reason)

    async def run() -> EvalResult:
        async with optional_chat(generate, model_folder, discount) as chat:
            settings = EpisodeSettings(generate, tokenizer, sampling, Scorer(rewards), chat, discount)
            return await evaluate(settings, workflow or RLVRWorkflow(), examples, n_samples, greedy, seed=seed)

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


class HeldOutTask:
    """A model in this process on the held-out problems of the run's ``task``, greedy, in the run's workflow and
    scored by the task's reward; ``close()`` ends the reward pool."""

    def __init__(self, cfg: RunConfig, task: Task, tokenizer, model_dir: Path):
        self.task, self.tokenizer = task, tokenizer
        self.model_folder, self.discount = cfg.tokenizer.path or model_dir, cfg.rollout.turn_discount
        self.workflow, self.sampling = build_workflow(cfg.rollout), Sampling.from_config(cfg.generation)
        self.rewards = reward_pool(cfg, task)

    def evaluate(self, model: torch.nn.Module) -> EvalResult:
        return evaluate_model(
            model,
            self.tokenizer,
            self.task.eval,
            self.rewards,
            self.sampling,
            self.workflow,
            self.model_folder,
            discount=self.discount,
        )

    def close(self) -> None:
        self.rewards.close()
