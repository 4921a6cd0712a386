"""Shared reward pieces: bounded answer parsing, the handle of a reward function (built in or the
user's ``reward.fn``, loaded in each worker), and a worker pool that turns a hanging, crashing or
non-numeric reward into a recorded failure instead of a stalled caller or a silent zero.

A reward object with a ``score_batch(requests) -> list`` method (a reward model: one padded forward
instead of one per completion) is called once per worker with its share of a call's requests.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing as mp
import re
import signal
import threading
from dataclasses import dataclass, field
from fractions import Fraction

from areal_hpc.builtins import load_object
from areal_hpc.errors import definition_site, described

# Rewards look at the tail of a completion only: parsing cost stays bounded whatever the model writes.
MAX_SCORED_CHARS = 4096
STARTUP_TIMEOUT_S = 300.0  # reward workers starting up, at most (then calls time out as usual)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def tail(text: str) -> str:
    return text[-MAX_SCORED_CHARS:] if isinstance(text, str) else ""


def parse_number(text: str) -> Fraction | None:
    """'1,234' -> 1234, '-2.5' -> -5/2; None when the text is not a number."""
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number written in the completion (the usual place of a final answer)."""
    matches = _NUMBER.findall(tail(text))
    return parse_number(matches[-1]) if matches else None


@dataclass(frozen=True)
class RewardRequest:
    """One completion to score: the reward function's arguments."""

    prompt: str
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    fields: dict  # the example's answer and other columns


@dataclass(frozen=True)
class RewardOutcome:
    value: float
    error: str | None = None  # why the reward failed; the value is then 0
    error_kind: str | None = None  # "exception" (it raised), "timeout" (it hung or died), "invalid" (not a number)
    metrics: dict = field(default_factory=dict)  # the other numbers a reward returned beside "reward"


class InvalidReward(ValueError):
    """A reward function returned something that is not a finite number (or a dict holding one)."""


class RewardRaised(Exception):
    """A reward function raised: its type, message and the user's file and line as one string (the
    traceback does not survive the way back from a worker process)."""


class RewardFunction:
    """A picklable handle of a reward: a module-level function, or a ``reward.fn`` spec string that each
    worker process loads itself (a file-path spec cannot be pickled as a function). A coroutine
    function is run to completion. Calling it on one request returns ``(reward, metrics)`` or raises
    ``InvalidReward``; ``raw(requests)`` returns what it gave for each request, unchecked (the pool
    checks each in the caller)."""

    def __init__(self, target, key: str = "reward.fn"):
        self.target, self.key = target, key
        self._fn = None if isinstance(target, str) else target

    def load(self):
        if self._fn is None:
            self._fn = load_object(self.target, self.key)
        return self._fn

    @property
    def name(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{getattr(self.target, '__qualname__', type(self.target).__qualname__)}"

    def __getstate__(self):
        return {"target": self.target, "key": self.key}

    def __setstate__(self, state):
        self.__init__(state["target"], state["key"])

    def __call__(self, request: RewardRequest) -> tuple[float, dict]:
        return checked_reward(self.raw([request])[0])

    @property
    def batched(self) -> bool:
        return callable(getattr(self.load(), "score_batch", None))

    def raw(self, requests: list[RewardRequest]) -> list:
        """One result per request: from one ``score_batch`` call when the reward has it, else one call each."""
        fn = self.load()
        if self.batched:
            results = list(fn.score_batch(requests))
            if len(results) != len(requests):
                raise InvalidReward(f"score_batch returned {len(results)} results for {len(requests)} requests")
            return results
        return [_resolved(fn(r.prompt, r.completion, r.prompt_ids, r.completion_ids, **r.fields)) for r in requests]


def _resolved(result):
    return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result


async def _awaited(awaitable):
    return await awaitable


def checked_reward(result) -> tuple[float, dict]:
    """(reward, metrics) of what a reward function returned: a number, or {"reward": number, name: number}."""
    metrics = {}
    if isinstance(result, dict):
        if "reward" not in result:
            raise InvalidReward(f"returned a dict without 'reward' (keys: {sorted(result)[:10]})")
        metrics = {k: v for k, v in result.items() if k != "reward"}
        result = result["reward"]
        for name, value in metrics.items():
            if not _is_finite_number(value):
                raise InvalidReward(f"returned metric {name!r} = {value!r}; metrics must be finite numbers")
    if not _is_finite_number(result):
        raise InvalidReward(
            f"returned {result!r} ({type(result).__name__}); a reward must be a finite number "
            "or a dict with a finite 'reward'"
        )
    return float(result), {k: float(v) for k, v in metrics.items()}


def _is_finite_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)) or (
        type(value).__module__ == "numpy" and _is_finite_number(value.item())
    )


def _call(reward_fn: RewardFunction, requests: list[RewardRequest]) -> list:
    try:
        return reward_fn.raw(requests)
    except InvalidReward:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code failed: where, while its traceback is here
        raise RewardRaised(described(exc)) from None


def _ignore_stop_warning() -> None:
    """Slurm's SIGUSR2 reaches every process of a step: the trainer acts on it, its workers must not die."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _load(reward_fn: RewardFunction) -> tuple[bool, str | None]:
    """A worker imports the reward's module when it starts (start-up, not scoring), and a reward object
    with a ``load`` method (a model's weights, an index) loads what it needs then. Whether it scores
    in batches, and where the user's reward is defined ("file.py:12", None for a built-in)."""
    fn = reward_fn.load()
    if callable(getattr(fn, "load", None)):
        fn.load()
    return reward_fn.batched, definition_site(fn)


class RewardPool:
    """Scores ``RewardRequest``s in worker processes, each completion bounded by ``timeout_s`` (a batch
    of k by k times that). Starting the workers (spawn, imports: seconds on a loaded machine) is not
    charged to a call.

    ``workers=0`` scores in the calling thread instead: no process, no pickling, no handler threads
    sharing the caller's cores, and no isolation: ``timeout_s`` is not enforced, and a reward that hangs
    or crashes takes the caller with it. Failures and invalid values are recorded as in the workers."""

    def __init__(self, reward_fn, workers: int = 1, timeout_s: float = 5.0):
        self.reward_fn = reward_fn if isinstance(reward_fn, RewardFunction) else RewardFunction(reward_fn)
        self.workers, self.timeout_s = workers, timeout_s
        self._pool, self._batched = None, False
        self._defined_at: str | None = None  # where the user's reward is defined: named when it returns a non-number
        self._loaded_here = False  # workers=0: the reward's module loaded in this process
        self._lock = threading.Lock()  # calls from several threads (rollouts, an evaluation) run one at a time

    def _fresh_pool(self):
        self.close()
        self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_ignore_stop_warning)
        started = self._pool.map_async(_load, [self.reward_fn] * self.workers, chunksize=1)
        try:
            loaded = started.get(STARTUP_TIMEOUT_S)
            self._batched, self._defined_at = all(batched for batched, _ in loaded), loaded[0][1]
        except Exception:  # noqa: BLE001 - e.g. an unimportable module: not raised here, each call records its own
            self._batched = False
        return self._pool

    def _calls(self, pending: list[int]) -> list[list[int]]:
        """The requests each worker call scores: a share per worker when the reward takes batches."""
        if not self._batched:
            return [[i] for i in pending]
        shares = min(max(self.workers, 1), len(pending))
        return [pending[k::shares] for k in range(shares)]

    def score(self, requests: list[RewardRequest]) -> list[RewardOutcome]:
        with self._lock:
            return self._score(requests)

    def _score_here(self, requests: list[RewardRequest]) -> list[RewardOutcome]:
        """``workers=0``: each call in this thread, its failures recorded as the workers' are."""
        if not self._loaded_here:
            try:
                self._batched, self._defined_at = _load(self.reward_fn)
            except Exception:  # noqa: BLE001 - as in the workers: each call records its own error
                self._batched = False
            self._loaded_here = True
        outcomes: list[RewardOutcome | None] = [None] * len(requests)
        for call in self._calls(list(range(len(requests)))):
            asked = [requests[i] for i in call]
            for i, outcome in zip(call, self._call_outcomes(len(call), lambda: _call(self.reward_fn, asked))):  # noqa: B023 - called within this iteration
                outcomes[i] = outcome
        return outcomes

    def _call_outcomes(self, n: int, results) -> list[RewardOutcome]:
        """The outcomes of one call's ``n`` requests from ``results()`` (its raw results): a raise fails all
        ``n``, an invalid value its own item. A worker's timeout (``mp.TimeoutError``) is raised."""
        try:
            return [self._outcome(result) for result in results()]
        except mp.TimeoutError:
            raise
        except InvalidReward as exc:
            return [self._invalid(exc)] * n
        except Exception as exc:  # noqa: BLE001 - any failure of user reward code is recorded
            raised = str(exc) if isinstance(exc, RewardRaised) else described(exc)
            return [RewardOutcome(0.0, f"reward raised {raised}", "exception")] * n

    def _score(self, requests: list[RewardRequest]) -> list[RewardOutcome]:
        if not self.workers:
            return self._score_here(requests)
        outcomes: list[RewardOutcome | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        while pending:
            pool = self._pool or self._fresh_pool()
            handles = [
                (call, pool.apply_async(_call, (self.reward_fn, [requests[i] for i in call])))
                for call in self._calls(pending)
            ]
            pending = []
            for k, (call, handle) in enumerate(handles):
                timeout_s = self.timeout_s * len(call)
                try:
                    results = self._call_outcomes(len(call), lambda: handle.get(timeout=timeout_s))  # noqa: B023 - called within this iteration
                except mp.TimeoutError:
                    # The worker may be stuck for good: replace the pool, re-run what is left.
                    results = [RewardOutcome(0.0, f"reward timed out after {timeout_s:g}s", "timeout")] * len(call)
                    self.close()
                    pending = [j for later, _ in handles[k + 1 :] for j in later]
                for i, outcome in zip(call, results):
                    outcomes[i] = outcome
                if pending:
                    break
        return outcomes

    def _outcome(self, result) -> RewardOutcome:
        try:
            value, metrics = checked_reward(result)
        except InvalidReward as exc:
            return self._invalid(exc)
        return RewardOutcome(value, metrics=metrics)

    def _invalid(self, exc: InvalidReward) -> RewardOutcome:
        where = f" (defined at {self._defined_at})" if self._defined_at else ""
        return RewardOutcome(0.0, f"reward {self.reward_fn.name}{where} {exc}", "invalid")

    def close(self):
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
