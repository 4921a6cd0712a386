"""The trajectory record (ATDP-style): what every rollout, proxy session and offline run produces.

A trajectory is a token stream cut into segments (one per turn): the tokens the model was given, then
the tokens it produced with their behaviour-policy logprobs, loss mask and the policy version that
generated each one. Rewards are a separate append-only list so they can arrive late without touching
the tokens. Only numpy here: the login-node proxy imports this module and no torch.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.errors import UserError

MAX_ID_BYTES = 64  # ids and tenant names are fixed-width columns in the shard index
MAX_SOURCE_BYTES = 32


@dataclass
class Segment:
    """One turn: ``input_ids`` (new context: the prompt, or the environment's reply) then the output.

    Concatenating ``input_ids + output_ids`` over all segments gives the full token sequence.
    ``loss_mask`` and ``output_versions`` have one entry per output token. ``temperature`` is the one
    the output was sampled at (0: greedy), recorded where it may differ from the run's (the proxy's
    turns); None: the run's sampling temperature (``generation``), what the run's own rollouts use.
    """

    input_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    output_versions: np.ndarray
    loss_mask: np.ndarray | None = None
    temperature: float | None = None

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32).reshape(-1)
        self.output_ids = np.asarray(self.output_ids, dtype=np.int32).reshape(-1)
        self.output_logprobs = np.asarray(self.output_logprobs, dtype=np.float32).reshape(-1)
        self.output_versions = np.asarray(self.output_versions, dtype=np.int32).reshape(-1)
        n = len(self.output_ids)
        if self.loss_mask is None:
            self.loss_mask = np.ones(n, dtype=np.uint8)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8).reshape(-1)
        for name in ("output_logprobs", "output_versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise UserError(
                    f"segment {name} has {len(getattr(self, name))} entries; it needs one per output token ({n})"
                )
        if self.temperature is not None:
            self.temperature = float(self.temperature)
            if not 0 <= self.temperature < float("inf"):
                raise UserError(f"segment temperature {self.temperature!r} must be a finite number >= 0 (0: greedy)")

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Segment)
            and self.temperature == other.temperature
            and all(
                np.array_equal(getattr(self, k), getattr(other, k))
                for k in ("input_ids", "output_ids", "output_logprobs", "output_versions", "loss_mask")
            )
        )


@dataclass(frozen=True)
class Reward:
    """One reward event: ``step`` is the turn (segment) it scores; a later event for a step replaces it."""

    value: float
    step: int = 0
    source: str = ""
    time: float = field(default_factory=time.time)


@dataclass
class Trajectory:
    """A full record. ``experiment``/``trial`` and ``created`` are filled in by the shard writer."""

    segments: list[Segment]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    task: str = ""
    group_id: str = ""
    session_id: str = ""
    tenant: str = "default"
    rewards: list[Reward] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    eligible: bool = True
    redactions: list[dict] = field(default_factory=list)
    experiment: str = ""
    trial: str = ""
    created: float = 0.0

    def __post_init__(self):
        if not self.segments:
            raise UserError(f"trajectory {self.id!r} has no segments")
        check_name("trajectory id", self.id, MAX_ID_BYTES, allow_empty=False)
        check_name("tenant", self.tenant, MAX_ID_BYTES, allow_empty=False)
        for reward in self.rewards:
            check_name("reward source", reward.source, MAX_SOURCE_BYTES)
        for mark in self.redactions:
            if not isinstance(mark, dict) or {"segment", "start", "end"} - mark.keys():
                raise UserError(f"redaction mark {mark!r} needs 'segment', 'start' and 'end' (token span)")

    @property
    def n_tokens(self) -> int:
        return sum(len(s.input_ids) + len(s.output_ids) for s in self.segments)

    @property
    def n_output_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.segments)

    @property
    def version_range(self) -> tuple[int, int]:
        """(oldest, newest) policy version among output tokens; (-1, -1) when there are none."""
        versions = [s.output_versions for s in self.segments if len(s.output_versions)]
        if not versions:
            return -1, -1
        joined = np.concatenate(versions)
        return int(joined.min()), int(joined.max())

    @property
    def reward(self) -> float | None:
        """The episode's reward: its turns' rewards discounted to the first turn by ``metadata["discount"]``
        (1 when absent: their sum; see :func:`total_reward`); None while no reward is bound."""
        return total_reward(self.rewards, float(self.metadata.get("discount", 1.0)))


def total_reward(events: list[Reward], discount: float = 1.0) -> float | None:
    """The latest event of each step, each multiplied by ``discount ** step`` and summed; None while no
    reward is bound."""
    latest: dict[int, Reward] = {}
    for event in sorted(events, key=lambda r: r.time):
        latest[event.step] = event
    return sum(r.value * discount**r.step for r in latest.values()) if latest else None


def check_name(what: str, value: str, max_bytes: int, allow_empty: bool = True) -> None:
    """Ids and names live in fixed-width columns: refuse what would be truncated or is not text."""
    if not isinstance(value, str):
        raise UserError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    size = len(value.encode())
    if size > max_bytes or (not allow_empty and size == 0):
        raise UserError(f"{what} {value!r} is {size} bytes; it must be 1-{max_bytes} bytes")


def version_runs(versions: np.ndarray) -> list[list[int]]:
    """Run-length form of per-token versions: [[first index, version], ...] (versions change rarely)."""
    if len(versions) == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(versions[1:] != versions[:-1]) + 1])
    return [[int(i), int(versions[i])] for i in starts]


def expand_version_runs(runs: list[list[int]], length: int) -> np.ndarray:
    """Inverse of :func:`version_runs`."""
    versions = np.empty(length, dtype=np.int32)
    bounds = [start for start, _ in runs[1:]] + [length]
    for (start, version), end in zip(runs, bounds):
        versions[start:end] = version
    return versions
