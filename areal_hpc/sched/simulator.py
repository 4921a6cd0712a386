"""Discrete-event simulation of asynchronous RL on a plan: rollout replicas, staleness gate, trainer, sync.

Every rollout replica decodes its running sequences together, one token each per iteration, and an
iteration takes longer the more sequences run (the cost model's step time at 1 and at full batch,
interpolated). A sequence starts only while ``accepted + running < (η + v + 1)·B`` (AReaL's gate);
the trainer takes the oldest B finished trajectories, trains, then pushes weights: rollout pauses
for the sync and, if interruptible, continues the in-flight sequences; if not, it admits nothing
until they drain. Left out on purpose: prefill and the KV recompute after an interruption (prefill
runs ~100x faster than decode per token).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReplicaSpeed:
    slots: int  # sequences it can run at once
    step_1_s: float  # decode iteration with one sequence running
    step_full_s: float  # ... with ``slots`` running

    def step_s(self, running: int) -> float:
        if self.slots == 1:
            return self.step_1_s
        return self.step_1_s + (running - 1) * (self.step_full_s - self.step_1_s) / (self.slots - 1)


@dataclass(frozen=True)
class SimResult:
    tokens_per_s: float  # trained tokens (prompt + answer) per second, steady state
    step_s: float
    trainer_idle: float  # fraction of time the trainer waits for data or a sync
    rollout_idle: float  # fraction of slot-time with no sequence decoding
    steps: int


def sample_lengths(rng, n: int, mean: float, maximum: int, spread: float) -> np.ndarray:
    """Answer lengths: log-normal with this mean and log-spread, cut at ``maximum`` (spread 0: all equal)."""
    if spread == 0:
        return np.full(n, float(min(mean, maximum)))
    return np.clip(np.rint(rng.lognormal(np.log(mean) - spread**2 / 2, spread, n)), 1, maximum)


class _Replica:
    """Processor sharing: all running sequences advance together, so progress is one virtual clock."""

    def __init__(self, speed: ReplicaSpeed):
        self.speed, self.progress, self.since, self.stamp = speed, 0.0, 0.0, 0
        self.finishing: list[tuple[float, float]] = []  # heap of (progress at finish, sequence tokens)
        self.busy = 0.0  # sequence-seconds decoded

    def advance(self, t: float) -> None:
        if t > self.since:  # ``since`` lies ahead during a weight sync: no progress until then
            if self.finishing:
                self.progress += (t - self.since) / self.speed.step_s(len(self.finishing))
                self.busy += (t - self.since) * len(self.finishing)
            self.since = t

    def next_finish(self) -> float:
        gap = self.finishing[0][0] - self.progress
        return self.since + max(0.0, gap) * self.speed.step_s(len(self.finishing))


class AsyncRLSimulator:
    """Replicas' speeds, the batch B, the trainer (seconds per token plus fixed seconds per step),
    the weight-sync time, staleness η, and whether a weight update interrupts generation."""

    def __init__(
        self,
        replicas: list[ReplicaSpeed],
        batch: int,
        prompt_len: int,
        train_s_per_token: float,
        train_fixed_s: float,
        sync_s: float,
        staleness: int,
        interruptible: bool = True,
    ):
        self.speeds, self.batch, self.prompt_len = replicas, batch, prompt_len
        self.train_s_per_token, self.train_fixed_s, self.sync_s = train_s_per_token, train_fixed_s, sync_s
        self.staleness, self.interruptible = staleness, interruptible

    def run(self, lengths, steps: int, warmup: int = 2) -> SimResult:
        """Simulate ``warmup`` + ``steps`` training steps; answer lengths are drawn in order from ``lengths``."""
        replicas = [_Replica(s) for s in self.speeds]
        events: list[tuple[float, int, int]] = []  # (time, replica, stamp): stale stamps are skipped
        answers, done = iter(lengths), deque()
        t, version, accepted, running, trained = 0.0, 0, 0, 0, 0.0
        phase, phase_end, busy_train, marks = "idle", math.inf, 0.0, []

        def reschedule(i: int) -> None:
            r = replicas[i]
            r.stamp += 1
            if r.finishing:
                heapq.heappush(events, (r.next_finish(), i, r.stamp))

        while len(marks) <= steps + warmup:
            admitted = set()
            while phase in ("idle", "train") and accepted + running < (self.staleness + version + 1) * self.batch:
                i = min(range(len(replicas)), key=lambda k: len(replicas[k].finishing) / replicas[k].speed.slots)
                r = replicas[i]
                if len(r.finishing) >= r.speed.slots:
                    break
                if i not in admitted:
                    r.advance(t)
                    admitted.add(i)
                answer = float(next(answers))
                heapq.heappush(r.finishing, (r.progress + answer, self.prompt_len + answer))
                running += 1
            for i in admitted:
                reschedule(i)
            if phase == "idle" and len(done) >= self.batch:
                trained = sum(done.popleft() for _ in range(self.batch))
                phase, phase_end = "train", t + self.train_fixed_s + trained * self.train_s_per_token
                busy_train += phase_end - t
                continue
            if phase == "drain" and not running:
                phase, phase_end = "sync", t + self.sync_s
                continue
            while events and events[0][2] != replicas[events[0][1]].stamp:
                heapq.heappop(events)
            if events and events[0][0] <= phase_end:
                t, i, _ = heapq.heappop(events)
                r = replicas[i]
                r.advance(t)
                _, tokens = heapq.heappop(r.finishing)
                done.append(tokens)
                running -= 1
                accepted += 1
                reschedule(i)
            elif phase_end < math.inf:
                t = phase_end
                if phase == "train" and not self.interruptible:
                    phase, phase_end = "drain", math.inf
                elif phase == "train":  # interrupt: in-flight sequences wait out the sync, then continue
                    phase, phase_end = "sync", t + self.sync_s
                    for i, r in enumerate(replicas):
                        r.advance(t)
                        r.since = t + self.sync_s
                        reschedule(i)
                else:
                    phase, phase_end, version = "idle", math.inf, version + 1
                    marks.append((t, trained, busy_train))
            else:
                raise RuntimeError("simulation stalled: nothing decoding and no batch ready")
        for r in replicas:
            r.advance(t)
        (t0, _, b0), (t1, _, b1) = marks[warmup], marks[-1]
        span = t1 - t0
        slot_time = sum(s.slots for s in self.speeds) * t
        return SimResult(
            sum(n for _, n, _ in marks[warmup + 1 :]) / span,
            span / steps,
            1 - (b1 - b0) / span,
            max(0.0, 1 - sum(r.busy for r in replicas) / slot_time),
            steps,
        )


def simulator_for_plan(plan: dict, staleness: int | None = None, interruptible: bool = True) -> AsyncRLSimulator:
    """A simulator for a plan as ``report.plan_dict`` writes it (the YAML ``areal-hpc plan --out`` saves)."""
    w, p = plan["workload"], plan["predicted"]
    speeds = [
        ReplicaSpeed(r["batch"], r["decode_step_s"][0], r["decode_step_s"][1])
        for r in plan["rollout"]
        for _ in range(r["replicas"])
    ]
    per_token = 1 / sum(g["tokens_per_s"] for g in plan["train"])
    step_tokens = w["prompts"] * w["answers"] * (w["prompt_len"] + w["gen_mean"])
    return AsyncRLSimulator(
        speeds,
        w["prompts"] * w["answers"],
        w["prompt_len"],
        per_token,
        p["train_s"] - step_tokens * per_token,
        p["weight_sync_s"],
        plan["staleness"] if staleness is None else staleness,
        interruptible,
    )
