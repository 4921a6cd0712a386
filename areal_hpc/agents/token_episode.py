"""A token-level multi-turn record: the model's turns and the environment's tokens between them.

Token in, token out: each turn's prompt is the previous context plus the exact output ids plus the
environment's reply, never a re-rendered conversation (re-tokenising could differ). The environment's
tokens (tool output, feedback) are a segment's ``input_ids``: in the context, out of the loss.
Rewards are per turn; the record carries the discount (a turn's reward reaches each earlier turn
multiplied by it once per turn).
"""

from __future__ import annotations

from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.models.chat import next_turn_ids


class TokenEpisode:
    def __init__(self, engine, prompt_ids: list[int], discount: float = 1.0):
        self.engine, self.discount = engine, discount
        self.context = list(prompt_ids)  # every token so far
        self._pending = list(prompt_ids)  # the environment's tokens since the model's last turn
        self.segments: list[Segment] = []
        self.generations: list = []
        self.rewards: list[Reward] = []

    @property
    def turns(self) -> int:
        return len(self.segments)

    async def generate(self, sampling=None, stop_token_ids: list[int] | None = None):
        """The model's next turn after the context; its tokens join the context."""
        generation = await self.engine.agenerate(self.context, sampling, stop_token_ids)
        self.segments.append(Segment(self._pending, generation.output_ids, generation.logprobs, generation.versions))
        self.generations.append(generation)
        self.context += generation.output_ids
        self._pending = []
        return generation

    def observe(self, ids: list[int]) -> None:
        """The environment's tokens (a tool's output, feedback): context, never trained on."""
        self.context += ids
        self._pending += ids

    def observe_message(self, content: str, role: str = "user") -> None:
        """The environment's reply as a chat message after the model's last turn (closing it if it was cut)."""
        last = self.generations[-1].output_ids if self.generations else []
        self.observe(next_turn_ids(self.engine.tokenizer, role, content, last))

    def reward(self, value: float, turn: int | None = None) -> None:
        """``value`` for ``turn`` (default: the latest)."""
        step = self.turns - 1 if turn is None else turn
        self.rewards.append(Reward(float(value), step=max(step, 0), source="reward_fn"))

    def trajectory(self) -> Trajectory:
        return Trajectory(list(self.segments), rewards=list(self.rewards), metadata={"discount": self.discount})

    def records(self) -> list[Trajectory]:
        """Its record, if the model took a turn."""
        return [self.trajectory()] if self.segments else []
