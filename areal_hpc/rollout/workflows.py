"""Episodes: what one prompt turns into. A workflow generates through the rollout client, scores,
and returns trajectory records (one per sample) that carry every token's logprob and version.

- ``RLVRWorkflow``: single turn, ``n_samples`` completions of one prompt (a GRPO group).
- ``MultiTurnWorkflow``: after a wrong answer the environment says so and the model tries again,
  up to ``max_turns``; each turn gets its own reward (``Reward.step`` is the turn).
Rewards run in the task's ``RewardPool`` (worker processes with a timeout), off the event loop: a
reward that hangs or crashes becomes a recorded failure (``metadata["reward_error"]`` and
``["reward_error_kind"]``: "exception" or "timeout"), which the controller counts.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from areal_hpc.algo.temperature import run_temperature
from areal_hpc.data.rewards import RewardOutcome, RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.models.chat import prompt_ids
from areal_hpc.rollout.client import Generation, RolloutClient

RETRY_MESSAGE = "That is not correct. Try again and give only the final answer."


@dataclass
class Sampling:
    """The sampling parameters of a workflow, in SGLang's names."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def from_config(cls, gconfig) -> "Sampling":
        return cls(gconfig.max_new_tokens, run_temperature(gconfig), gconfig.top_p, gconfig.top_k)

    def params(self, stop_token_ids: list[int]) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop_token_ids": stop_token_ids}


class Scorer:
    """One reward pool shared by concurrent episodes: each call scores a list of (completion, example)
    pairs together (a group's samples in parallel in the pool), in a thread (the pool runs one call at
    a time)."""

    def __init__(self, pool: RewardPool):
        self.pool = pool

    async def __call__(self, pairs: list[tuple[str, Example]]) -> list[RewardOutcome]:
        return await asyncio.to_thread(self.pool.score, pairs)


class RLVRWorkflow:
    def __init__(self, tokenizer, sampling: Sampling, n_samples: int, scorer: Scorer, task_name: str):
        self.tokenizer, self.sampling, self.n_samples = tokenizer, sampling, n_samples
        self.scorer, self.task_name = scorer, task_name
        self.stop = [tokenizer.eos_token_id]

    async def run(self, client: RolloutClient, example: Example) -> list[Trajectory]:
        prompt = prompt_ids(self.tokenizer, example.prompt)
        group_id = f"{example.uid}-{uuid.uuid4().hex[:8]}"
        async with asyncio.TaskGroup() as samples:  # one failure cancels its siblings
            tasks = [samples.create_task(client.generate(prompt, self.sampling.params(self.stop)))
                     for _ in range(self.n_samples)]
        generations = [task.result() for task in tasks]
        outcomes = await self.scorer([(self.tokenizer.decode(g.output_ids, skip_special_tokens=True), example)
                                      for g in generations])
        return [Trajectory([_segment(g.input_ids, g)], task=self.task_name, group_id=group_id,
                           rewards=[Reward(outcome.value, step=0, source="reward_fn")],
                           metadata=_metadata(example, [g], [outcome]))
                for g, outcome in zip(generations, outcomes)]


class MultiTurnWorkflow:
    def __init__(self, tokenizer, sampling: Sampling, scorer: Scorer, task_name: str, max_turns: int = 2):
        self.tokenizer, self.sampling, self.scorer = tokenizer, sampling, scorer
        self.task_name, self.max_turns = task_name, max_turns
        self.stop = [tokenizer.eos_token_id]

    async def run(self, client: RolloutClient, example: Example) -> list[Trajectory]:
        # Token in, token out: each turn's prompt is the previous context plus exact output ids plus
        # the environment's reply, never a re-rendered conversation (re-tokenising could differ).
        new_input = prompt_ids(self.tokenizer, example.prompt)
        context = list(new_input)
        segments, rewards, generations, outcomes = [], [], [], []
        for turn in range(self.max_turns):
            generation = await client.generate(context, self.sampling.params(self.stop))
            answer = self.tokenizer.decode(generation.output_ids, skip_special_tokens=True)
            [outcome] = await self.scorer([(answer, example)])
            segments.append(_segment(new_input, generation))
            rewards.append(Reward(outcome.value, step=turn, source="reward_fn"))
            generations.append(generation)
            outcomes.append(outcome)
            if outcome.value >= 1.0:
                break
            new_input = self._feedback(generation)
            context += generation.output_ids + new_input
        return [Trajectory(segments, task=self.task_name, group_id=example.uid, rewards=rewards,
                           metadata=_metadata(example, generations, outcomes))]

    def _feedback(self, generation: Generation) -> list[int]:
        """The environment's turn: close the assistant turn if it was cut off, then a user message."""
        ended = generation.output_ids[-1:] == [self.tokenizer.eos_token_id]
        user = self.tokenizer.apply_chat_template([{"role": "user", "content": RETRY_MESSAGE}], tokenize=False,
                                                  add_generation_prompt=True)
        text = ("" if ended else self.tokenizer.eos_token) + "\n" + user
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _segment(input_ids: list[int], generation: Generation) -> Segment:
    return Segment(input_ids, generation.output_ids, generation.logprobs, generation.versions)


def _metadata(example: Example, generations: list[Generation], outcomes: list[RewardOutcome]) -> dict:
    meta = {"example": example.uid, "answer": example.answer,
            "interruptions": sum(g.interruptions for g in generations),
            "finish_reasons": [g.finish_reason for g in generations]}
    failed = [o for o in outcomes if o.error]
    if failed:  # the controller counts them by kind ("exception", "timeout")
        meta["reward_error"] = [o.error for o in failed]
        meta["reward_error_kind"] = [o.error_kind for o in failed]
    return meta
