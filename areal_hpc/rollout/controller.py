"""The rollout controller: AReaL's asynchrony. Episodes keep running while the trainer trains,
as many as the staleness gate allows; the trainer takes batches of finished episodes, oldest first
(see ``staleness.py``: stragglers that would exceed eta are dropped and counted in ``dropped``).

    controller = RolloutController(client, workflow, gate, examples)
    await controller.start()
    batch = await controller.prepare_batch(B)     # B episodes, none more than eta versions stale
    await controller.pause(); ...update weights...; controller.set_version(v + 1); await controller.resume()

A failing episode (a reward error is not one: it is recorded in the trajectory) frees its slot and
is counted in ``failures``; if every server is gone, ``prepare_batch`` raises instead of waiting.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from areal_hpc.data.tasks import Example
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.rollout.client import NoServerError, RolloutClient
from areal_hpc.rollout.staleness import ReadyQueue, StalenessGate


@dataclass
class Episode:
    trajectories: list[Trajectory]
    version: int  # trainer version when the episode started (its oldest possible token)

    @property
    def ids(self) -> list[str]:
        return [t.id for t in self.trajectories]


class RolloutController:
    def __init__(self, client: RolloutClient, workflow, gate: StalenessGate, examples: Iterable[Example],
                 on_accept: Callable[[Episode], None] | None = None,
                 accept: Callable[[list[Trajectory]], bool] = lambda group: True,
                 on_drop: Callable[[Episode], None] | None = None):
        self.client, self.workflow, self.gate = client, workflow, gate
        self.on_accept, self.accept, self.on_drop = on_accept, accept, on_drop
        # A list is cycled; an iterator (e.g. an endless, resumable prompt stream) is used as it is.
        self._examples = examples if isinstance(examples, Iterator) else itertools.cycle(examples)
        self._ready = ReadyQueue()
        self._arrived = asyncio.Event()
        self._changed = asyncio.Event()
        self._paused = False
        self._tasks: set[asyncio.Task] = set()
        self._fatal: asyncio.Future | None = None
        self._loop_task: asyncio.Task | None = None
        self.failures: list[str] = []
        self.dropped = 0  # episodes that finished too late to train within eta

    async def start(self) -> None:
        self._fatal = asyncio.get_running_loop().create_future()
        self._loop_task = asyncio.create_task(self._submit_loop())

    async def prepare_batch(self, size: int) -> list[Episode]:
        """Wait for ``size`` finished episodes no more than eta versions behind, oldest first."""
        batch: list[Episode] = []
        while len(batch) < size:
            taken, dropped = self._ready.take(size - len(batch), self.gate.version, self.gate.max_staleness)
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
        return batch

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

    async def _submit_loop(self) -> None:
        while not self._fatal.done():  # with every server gone, starting episodes is pointless
            while not self._paused and self.gate.capacity() > 0:
                self.gate.start()
                task = asyncio.create_task(self._episode(next(self._examples), self.gate.version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._changed.clear()
            await self._changed.wait()

    async def _episode(self, example: Example, version: int) -> None:
        accepted = False
        try:
            trajectories = await self.workflow.run(self.client, example)
            if self.accept(trajectories):
                episode = Episode(trajectories, version)
                if self.on_accept is not None:
                    self.on_accept(episode)
                self._ready.put(version, episode)
                accepted = True  # only once it is really queued: the gate must not count a lost one
                self._arrived.set()
        except NoServerError as exc:
            if not self._fatal.done():
                self._fatal.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - one bad episode must not stop the others
            self.failures.append(f"{example.uid}: {type(exc).__name__}: {exc}")
        finally:
            self.gate.finish(accepted)
            self._changed.set()
