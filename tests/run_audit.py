"""What a run's own records say about which trajectories trained the final model, checked against its
shards: the audit log (``logs/batches.jsonl``: each step's trained ids, dropped ids, ``resumed_from``
lines) and the consumer cursor of the final checkpoint. Used by every test that stops and resumes a run
(SIGKILL, SIGUSR2, Slurm requeue): none trained twice, none lost."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.data.shards.consumer import ConsumerCursor, TrajectoryConsumer
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.fsio import read_json_lines
from areal_hpc.train.build import SHARD_WRITER

OWN = TrajectoryFilter(writer=SHARD_WRITER)  # the run's own rollouts (other writers' records are not its to train)


@dataclass
class Audit:
    effective: dict[int, list[str]] = field(default_factory=dict)  # step -> ids of its last attempt
    dropped: set[str] = field(default_factory=set)
    resumed_from: list[int] = field(default_factory=list)
    trained_after_resume: set[str] = field(default_factory=set)

    @property
    def trained(self) -> list[str]:
        return [i for step in sorted(self.effective) for i in self.effective[step]]


def read_audit(run: Path) -> Audit:
    audit = Audit()
    for entry in read_json_lines(run / "logs" / "batches.jsonl"):
        if "resumed_from" in entry:
            audit.resumed_from.append(entry["resumed_from"])
        elif "trained" in entry:
            audit.effective[entry["step"]] = entry["trained"]
            if audit.resumed_from:
                audit.trained_after_resume |= set(entry["trained"])
        elif "dropped" in entry:
            audit.dropped |= set(entry["dropped"])
    return audit


def untrained_at(run: Path, step: int) -> set[str]:
    """Trajectories stored but not yet trained by the checkpoint of ``step`` (what a resume recovers)."""
    state = json.loads((run / "checkpoints" / f"step{step:06d}" / "driver.json").read_text())
    with TrajectoryStore(run / "shards") as store:
        cursor = ConsumerCursor.from_state_dict(state["cursor"])
        return {t.id for t in TrajectoryConsumer(store, cursor, where=OWN).pending()}


def assert_each_trajectory_trained_once(run: Path, total_steps: int) -> Audit:
    """Every step 1..total trained once in the final timeline, no trajectory in two steps, and every
    stored trajectory either trained, dropped as too stale, or still pending in the final cursor."""
    audit = read_audit(run)
    trained = audit.trained
    assert sorted(audit.effective) == list(range(1, total_steps + 1))
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    final = json.loads((run / "checkpoints" / f"step{total_steps:06d}" / "driver.json").read_text())
    with TrajectoryStore(run / "shards") as store:
        cursor = ConsumerCursor.from_state_dict(final["cursor"])
        pending = {t.id for t in TrajectoryConsumer(store, cursor, where=OWN).pending()}
        consumed = {t.id for t in store.trajectories(OWN)} - pending
    assert set(trained) <= consumed and consumed <= set(trained) | audit.dropped, "consumed and trained differ"
    return audit
