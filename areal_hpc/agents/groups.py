"""Episodes in groups: the rollout controller's unit of work. For each prompt, ``n_samples`` episodes of
the workflow run concurrently (each on its own ``EpisodeContext``) and their records form one group (GRPO
normalises rewards within it); the staleness gate counts the group once. Groups are numbered in the
order they start (from ``first_group``, e.g. the prompts a resumed run had drawn); with a run ``seed``
episode j of group g samples with seed ``derive_seed(seed, g, j)``. The episodes' first generations
leave together, as one batched request (``EpisodeSettings.for_group``).

A workflow's ``arun_episode(engine, example)`` returns its records (a ``Trajectory`` or a list), or
None to take every conversation its engine recorded (token episodes, chat clients). The runner stamps
each record with the task, the group and the episode's bookkeeping: the example, interruptions,
finish reasons, failed rewards (``reward_error``/``reward_error_kind``, which the controller counts) and
the reward functions' extra metrics.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, derive_seed
from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Trajectory


class WorkflowResultError(TypeError):
    """A workflow returned something that is not trajectory records."""


class EpisodeGroups:
    """``run(client, example)``: the controller's workflow protocol, over a user-shaped workflow."""

    def __init__(
        self,
        workflow,
        settings_for: Callable[[object], EpisodeSettings],
        n_samples: int,
        task_name: str,
        seed: int | None = None,
        first_group: int = 0,
        merge_groups: bool = False,
    ):
        """``merge_groups`` (``rollout.merge_group_requests``): the first turns of groups that start together
        go to the servers as one /generate per server, not one per group."""
        self.workflow, self.settings_for = workflow, settings_for
        self.n_samples, self.task_name = n_samples, task_name
        self.seed, self.started, self.merge_groups = seed, first_group, merge_groups
        self._merged: tuple[object, EpisodeSettings] | None = None  # (client, its settings with one batcher for all)

    def _settings(self, client) -> EpisodeSettings:
        """A batcher of the group's own samples (one /generate), or one for every group (the staleness gate
        admits a batch's worth at each weight update: the quickstart's 16 requests a step cost both event
        loops about 0.5 ms each)."""
        if not self.merge_groups:
            return self.settings_for(client).for_group()
        if self._merged is None or self._merged[0] is not client:
            self._merged = client, self.settings_for(client).for_group(parts=lambda: len(client.alive))
        return self._merged[1]

    async def run(self, client, example: Example) -> list[Trajectory]:
        settings = self._settings(client)
        number, self.started = self.started, self.started + 1
        group_id = f"{example.uid}-{uuid.uuid4().hex[:8]}"
        seeds = [None if self.seed is None else derive_seed(self.seed, number, j) for j in range(self.n_samples)]
        async with asyncio.TaskGroup() as episodes:  # one failure cancels its siblings
            tasks = [
                episodes.create_task(run_episode(self.workflow, EpisodeContext(settings, seed), example))
                for seed in seeds
            ]
        records = []
        for task in tasks:
            for record in task.result():
                record.task, record.group_id = self.task_name, group_id
                records.append(record)
        return records


async def run_episode(workflow, engine: EpisodeContext, example: Example) -> list[Trajectory]:
    """One episode's records, with its bookkeeping in their metadata."""
    returned = await workflow.arun_episode(engine, example)
    records = recorded(engine) if returned is None else as_records(returned, type(workflow).__name__)
    meta = episode_metadata(engine, example)
    for record in records:
        record.metadata = {**record.metadata, **meta}
    return records


def recorded(engine: EpisodeContext) -> list[Trajectory]:
    return [record for recorder in engine.recorders for record in recorder.records()]


def as_records(returned, name: str) -> list[Trajectory]:
    records = [returned] if isinstance(returned, Trajectory) else returned
    if not isinstance(records, list) or not all(isinstance(r, Trajectory) for r in records):
        raise WorkflowResultError(
            f"{name}.arun_episode returned {type(returned).__name__}; it must return a "
            "Trajectory, a list of them, or None (the conversations its engine recorded)"
        )
    return records


def episode_metadata(engine: EpisodeContext, example: Example) -> dict:
    meta = {
        "example": example.uid,
        "answer": str(example.answer),
        "interruptions": sum(getattr(g, "interruptions", 0) for g in engine.generations),
    }
    if engine.generations:  # chat turns' finish reasons are in their records already
        meta["finish_reasons"] = [g.finish_reason for g in engine.generations]
    failed = [o for o in engine.outcomes if o.error]
    if failed:  # the controller counts them by kind ("exception", "timeout", "invalid")
        meta["reward_error"] = [o.error for o in failed]
        meta["reward_error_kind"] = [o.error_kind for o in failed]
    metrics: dict[str, list[float]] = {}
    for outcome in engine.outcomes:
        for name, value in outcome.metrics.items():
            metrics.setdefault(name, []).append(value)
    if metrics:
        meta["reward_metrics"] = {name: sum(v) / len(v) for name, v in metrics.items()}
    return meta
