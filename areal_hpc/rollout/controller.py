"""The rollout controller: AReaL's asynchrony. Episodes keep running while the trainer trains,
as many as the staleness gate allows; the trainer takes batches of finished episodes, oldest first
(see ``staleness.py``: stragglers that would exceed eta are dropped and counted in ``dropped``).

    controller = RolloutController(client, workflow, gate, examples)
    await controller.start()
    batch = await controller.prepare_batch(B)     # B episodes, none more than eta versions stale
    await controller.pause(); ...update weights...; controller.set_version(v + 1); await controller.resume()

An episode fails when generating it fails (a server's 5xx, a request the server refuses, e.g. longer
than the context, connections that keep failing), when its workflow raises (``workflow``; an agent
program it ran that failed: ``agent_program``), when storing it fails (``on_accept``, e.g. a full
disk), or when every one of its rewards failed (raised or timed out; an episode with some failed
rewards is trained, those samples scoring 0). Failures are counted by kind in ``failures`` (a
reward failure per reward call; a reward that returned no finite number is ``reward_invalid``), which
keeps the first message of each kind with the user's file and line, and charged to a ``FailureBudget``:
once it is spent, or once every server is gone, the controller stops submitting and ``prepare_batch``
raises a one-line error. Once the run is stopping (``stopping`` is set: Slurm signalled every process of
the job at once, the servers, reward workers and agent programs too) an episode's failure is the stop's
doing: neither counted nor charged, and an episode with a failed reward is not trained.
Groups the ``accept`` filter rejects (DAPO's dynamic sampling) are counted in ``filtered``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp

from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import described
from areal_hpc.rollout.client import ConnectionFailedError, NoServerError, RolloutClient, RolloutError, ServerReplyError
from areal_hpc.rollout.commits import CoalescedCommits
from areal_hpc.rollout.staleness import ReadyQueue, StalenessGate

# What can go wrong with an episode; metrics carry a count of each (rollout/failures/<kind>).
FAILURE_KINDS = (
    "server_error",
    "rejected",
    "connection",
    "store",
    "reward_exception",
    "reward_timeout",
    "reward_invalid",
    "workflow",
    "agent_program",
)
MAX_MESSAGE_CHARS = 400


class RolloutFailure(RolloutError):
    """The failure budget is spent: rollouts keep failing."""


class EpisodeFailure(Exception):
    """A failure a workflow names itself: ``kind`` (one of FAILURE_KINDS, e.g. ``agent_program``: the agent
    program it ran exited non-zero), its message the line to report."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Episode:
    trajectories: list[Trajectory]
    version: int  # trainer version when the episode started (its oldest possible token)
    number: int = -1  # the order it was started in (its prompt's draw); -1: read back after a restart

    @property
    def ids(self) -> list[str]:
        return [t.id for t in self.trajectories]


@dataclass
class FailureLog:
    """Failures by kind, the first message of each kind and the last few: bounded however long a run keeps
    failing."""

    counts: Counter = field(default_factory=Counter)
    recent: deque = field(default_factory=lambda: deque(maxlen=8))
    first: dict[str, str] = field(default_factory=dict)  # kind -> its first message, in the order they came

    def add(self, kind: str, message: str, n: int = 1) -> None:
        self.counts[kind] += n
        line = " ".join(message.split())[:MAX_MESSAGE_CHARS]  # one line
        self.first.setdefault(kind, line)
        self.recent.append(f"{kind}: {line}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(f"{kind} {n}" for kind, n in self.counts.most_common())


@dataclass
class FailureBudget:
    """Stops a run whose episodes keep failing: ``max_consecutive`` failures in a row (0: never), or
    more than ``max_rate`` of the last ``window`` episodes (checked once that many have ended)."""

    max_consecutive: int = 32
    window: int = 200
    max_rate: float = 0.5
    consecutive: int = 0
    _last: deque = field(init=False)  # outcomes of the latest ``window`` episodes (True: failed)

    def __post_init__(self) -> None:
        self._last = deque(maxlen=self.window)

    @classmethod
    def from_config(cls, cfg) -> FailureBudget:
        """From a ``FailureBudgetConfig`` (``rollout.failure_budget``)."""
        return cls(cfg.max_consecutive, cfg.window, cfg.max_rate)

    def record(self, failed: bool) -> None:
        self.consecutive = self.consecutive + 1 if failed else 0
        self._last.append(failed)

    def spent(self) -> str | None:
        """Why the budget is spent (a phrase), or None while it is not."""
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            return f"{self.consecutive} episodes in a row failed"
        failed = sum(self._last)
        if len(self._last) == self.window and failed > self.max_rate * self.window:
            return f"{failed} of the last {self.window} episodes failed"
        return None


class RolloutController:
    def __init__(
        self,
        client: RolloutClient,
        workflow,
        gate: StalenessGate,
        examples: Iterable[Example],
        on_accept: Callable[[list[Episode]], None] | None = None,
        accept: Callable[[list[Trajectory]], bool] = lambda group: True,
        on_drop: Callable[[Episode], None] | None = None,
        budget: FailureBudget | None = None,
        accept_executor: concurrent.futures.Executor | None = None,
        stopping: asyncio.Event | None = None,
    ):
        """``on_accept`` stores accepted episodes, those that finished while the previous call ran in
        one call (``CoalescedCommits``), on ``accept_executor`` (None: asyncio's default threads);
        ``stopping``: set once the run received a stop signal."""
        self.client, self.workflow, self.gate = client, workflow, gate
        self.accept, self.on_drop = accept, on_drop
        self._commits = None if on_accept is None else CoalescedCommits(on_accept, accept_executor)
        self.budget = budget or FailureBudget()
        self.stopping = stopping or asyncio.Event()
        # A list is cycled; an iterator (e.g. an endless, resumable prompt stream) is used as it is.
        self._examples = examples if isinstance(examples, Iterator) else itertools.cycle(examples)
        self._ready = ReadyQueue()
        self._arrived = asyncio.Event()
        self._changed = asyncio.Event()
        self._paused = False
        self._tasks: set[asyncio.Task] = set()
        self._fatal: asyncio.Future | None = None
        self._loop_task: asyncio.Task | None = None
        self.failures = FailureLog()
        self.dropped = 0  # episodes that finished too late to train within eta
        self.started = 0  # episodes started (numbered in that order)
        self.filtered = 0  # groups the accept filter rejected (e.g. DAPO: all rewards equal)

    async def start(self) -> None:
        self._fatal = asyncio.get_running_loop().create_future()
        self._loop_task = asyncio.create_task(self._submit_loop())

    @property
    def submitting(self) -> bool:
        """Whether episodes may still be started (False once rollouts stopped for good)."""
        return self._loop_task is not None and not self._loop_task.done()

    def counters(self) -> dict[str, float]:
        """Cumulative counts for metrics: failures by kind, filtered and dropped episodes."""
        return {
            "rollout/failures_total": float(self.failures.total),
            **{f"rollout/failures/{kind}": float(self.failures.counts[kind]) for kind in FAILURE_KINDS},
            "rollout/filtered_total": float(self.filtered),
            "rollout/dropped_total": float(self.dropped),
        }

    async def prepare_batch(self, size: int, version: int | None = None) -> list[Episode]:
        """Wait for ``size`` finished episodes no more than eta versions behind ``version`` (the one the
        batch trains; default: the servers', ``set_version``'s), oldest first, in the order they were
        started (not the order they finished: a synchronous run's batches repeat)."""
        batch: list[Episode] = []
        version = self.gate.version if version is None else version
        while len(batch) < size:
            taken, dropped = self._ready.take(size - len(batch), version, self.gate.max_staleness)
            batch += taken
            if dropped:
                self.gate.drop(len(dropped))
                self.dropped += len(dropped)
                for episode in dropped:
                    if self.on_drop is not None:
                        self.on_drop(episode)
                self._changed.set()
            if len(batch) < size:
                arrived = asyncio.ensure_future(self._arrived.wait())
                try:
                    await asyncio.wait([arrived, self._fatal], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    arrived.cancel()
                if self._fatal.done():
                    raise self._fatal.exception()
                self._arrived.clear()
        return sorted(batch, key=lambda episode: (episode.version, episode.number))

    async def pause(self) -> None:
        """Stop starting episodes and abort in-flight generation (it resumes after ``resume``)."""
        self._paused = True
        await self.client.pause()

    async def drain(self) -> None:
        """Stop starting episodes and wait until the running ones finish: a weight update without
        interrupting generation (AReaL's interruptible generation turned off)."""
        self._paused = True
        while self.gate.running:
            await asyncio.sleep(0.01)

    def restore(self, episodes: list[Episode]) -> None:
        """Queue finished episodes from before a restart (read back from the shards) for training."""
        for episode in episodes:
            self._ready.put(episode.version, episode)
        self.gate.accepted += len(episodes)
        self._arrived.set()

    async def resume(self) -> None:
        await self.client.resume()
        self._paused = False
        self._changed.set()

    def set_version(self, version: int) -> None:
        self.gate.set_version(version)
        self._changed.set()

    async def stop(self) -> None:
        for task in [self._loop_task, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._loop_task, *self._tasks] if t is not None], return_exceptions=True)
        if self._commits is not None:
            await self._commits.finished()  # a store already running ends before the writer is closed

    async def _submit_loop(self) -> None:
        while not self._fatal.done():  # with every server gone or the budget spent, rollouts stop
            while not self._paused and self.gate.capacity() > 0:
                self.gate.start()
                task = asyncio.create_task(self._episode(next(self._examples), self.gate.version, self.started))
                self.started += 1
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._changed.clear()
            await self._changed.wait()

    async def _episode(self, example: Example, version: int, number: int) -> None:
        accepted = False
        try:
            trajectories = await self.workflow.run(self.client, example)
            failed = reward_failures(trajectories)
            if failed and self.stopping.is_set():
                return  # reward workers are signalled too: the stop's doing, neither counted nor trained
            self._log_reward_failures(example, failed)
            if failed and len(failed) == sum(len(t.rewards) for t in trajectories):
                self._charge(f"{example.uid}: every reward failed, the last: {failed[-1][1]}")
                return  # nothing to learn from: not trained
            if not self.accept(trajectories):
                self.filtered += 1
            else:
                episode = Episode(trajectories, version, number)
                if self._commits is not None:
                    try:
                        await self._commits.store(episode)  # e.g. a shard commit (fsync), off the event loop
                    except Exception as exc:  # noqa: BLE001 - e.g. the shard commit hit a full disk
                        self._fail("store", f"{example.uid}: {described(exc)}")
                        return
                self._ready.put(version, episode)
                accepted = True  # only once it is really queued: the gate must not count a lost one
                self._arrived.set()
            self.budget.record(failed=False)
        except Exception as exc:  # noqa: BLE001 - one bad episode must not stop the others
            cause = _leaf(exc)  # a workflow's TaskGroup wraps its samples' errors in an ExceptionGroup
            if isinstance(cause, NoServerError):
                self._stop(cause)
            elif not self.stopping.is_set():
                kind, message = failure_of(cause)
                self._fail(kind, f"{example.uid}: {message}")
        finally:
            self.gate.finish(accepted)
            self._changed.set()

    def _log_reward_failures(self, example: Example, failed: list[tuple[str, str]]) -> None:
        """Count each failed reward of the episode, (kind, error)."""
        for kind, error in failed:
            self.failures.add(f"reward_{kind}", f"{example.uid}: {error}")

    def _fail(self, kind: str, message: str) -> None:
        self.failures.add(kind, message)
        self._charge(message)

    def _charge(self, last_error: str) -> None:
        """A failed episode: charge it to the budget; a spent budget stops the rollouts."""
        self.budget.record(failed=True)
        spent = self.budget.spent()
        if spent:
            self._stop(
                RolloutFailure(
                    f"rollouts keep failing: {spent} ({self.failures.summary()}); "
                    f"last error: {' '.join(last_error.split())[:MAX_MESSAGE_CHARS]}"
                )
            )

    def _stop(self, error: RolloutError) -> None:
        if not self._fatal.done():
            self._fatal.set_exception(error)
            self._changed.set()  # the submit loop sees it and ends


def reward_failures(trajectories: list[Trajectory]) -> list[tuple[str, str]]:
    """(kind, error) of each failed reward of an episode (the workflow records them in the metadata)."""
    return [
        (kind, error)
        for t in trajectories
        for kind, error in zip(t.metadata.get("reward_error_kind", ()), t.metadata.get("reward_error", ()))
    ]


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def failure_of(exc: BaseException) -> tuple[str, str]:
    """(kind, one-line message) of the exception an episode raised: a failure the workflow named (its
    message), a server's reply (its message), a connection that kept failing, or the workflow's own error;
    each with the user's file and line where the user's code is in its traceback (e.g. the workflow's line
    that asked for the generation)."""
    exc = _leaf(exc)
    if isinstance(exc, EpisodeFailure):
        return exc.kind, str(exc)
    if isinstance(exc, ServerReplyError):
        return ("server_error" if exc.status >= 500 else "rejected"), described(exc, str(exc))
    if isinstance(exc, (ConnectionFailedError, aiohttp.ClientError, asyncio.TimeoutError)):
        return "connection", described(exc)
    return "workflow", described(exc)
