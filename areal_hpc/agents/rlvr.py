"""The default workflow: one completion of the prompt, scored by the run's reward (RLVR; the group
runner makes ``n_samples`` of them a GRPO group)."""

from __future__ import annotations

from areal_hpc.data.tasks import Example


class RLVRWorkflow:
    async def arun_episode(self, engine, example: Example):
        episode = engine.episode(example)
        generation = await episode.generate()
        episode.reward(await engine.reward(example, engine.decode(generation.output_ids), generation.output_ids))
        return [episode.trajectory()]
