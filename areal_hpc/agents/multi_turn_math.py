"""Multi-turn math with feedback: after a wrong answer the environment says so and the model tries
again, up to ``max_turns``. Each turn is scored; with ``rollout.turn_discount`` < 1 an answer found
later is worth less (AReaL's reward discounting)."""

from __future__ import annotations

from areal_hpc.data.tasks import Example

RETRY_MESSAGE = "That is not correct. Try again and give only the final answer."


class MultiTurnMathWorkflow:
    def __init__(self, max_turns: int = 2, feedback: str = RETRY_MESSAGE):
        if max_turns < 1:
            raise ValueError(f"max_turns = {max_turns}; it must be >= 1")
        self.max_turns, self.feedback = max_turns, feedback

    async def arun_episode(self, engine, example: Example):
        episode = engine.episode(example)
        for _ in range(self.max_turns):
            generation = await episode.generate()
            value = await engine.reward(
                example,
                engine.decode(generation.output_ids),
                generation.output_ids,
                prompt_ids=episode.context[: -len(generation.output_ids) or None],
            )
            episode.reward(value)
            if value >= 1.0:
                break
            episode.observe_message(self.feedback)
        return [episode.trajectory()]
