"""How trainer rank 0 stops when Slurm says so: SIGUSR2 (its warning before a time limit or preemption)
or SIGTERM (requeue, scancel) saves a checkpoint at once (after the update in progress, if any) and
the run exits with ``SAVED_AND_STOPPED``; the launcher requeues and the next incarnation resumes.

``StopGuard`` is the one place the step loop asks about stopping: it races rollout-side work against
the signal, and treats an error that a stop may have caused (the servers are signalled at the same
moment and may be gone first) as the stop it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from areal_hpc.runtime.run_state import STOP_GRACE_S

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
T = TypeVar("T")


class StopRequested(Exception):
    """A stop signal arrived and the checkpoint of the last completed step is written."""


class EarlyStopSignal:
    """While the trainer is still loading (before the loop): SIGUSR2 is remembered, so the run saves
    as soon as it can; SIGTERM ends the process (nothing new to save yet)."""

    def __init__(self):
        self.received = False
        signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True


class StopGuard:
    """The stop signals, handled by the running event loop from now on. ``on_stop`` callbacks save the
    checkpoint of the last trained step and raise ``StopRequested``."""

    def __init__(self, early: EarlyStopSignal | None = None):
        self.event = asyncio.Event()
        for signum in STOP_SIGNALS:
            asyncio.get_running_loop().add_signal_handler(signum, self.event.set)
        if early is not None and early.received:
            self.event.set()

    def check(self, on_stop: Callable[[], None]) -> None:
        if self.event.is_set():
            on_stop()

    async def unless_stopped(self, work: Awaitable[T], on_stop: Callable[[], None]) -> T:
        """``work``'s result; or, when the signal comes first (``work`` is cancelled) or ``work`` fails
        because of it, ``on_stop()``."""
        async with self.excusing_errors(on_stop):
            result = await until_set(work, self.event)
        if result is None:
            on_stop()
        return result

    @contextlib.asynccontextmanager
    async def excusing_errors(self, on_stop: Callable[[], None]) -> AsyncIterator[None]:
        """Rollout-side work while a stop signal may arrive: Slurm signals every task of the job at once,
        so the servers may be gone before this process's handler has run. An error with a stop signal
        (already, or within ``STOP_GRACE_S``) is the stop's doing: ``on_stop()`` instead of failing the
        run without a checkpoint."""
        try:
            yield
        except Exception:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), STOP_GRACE_S)
            if not self.event.is_set():
                raise
            on_stop()


async def until_set(work: Awaitable[T], event: asyncio.Event) -> T | None:
    """``work``'s result, or None (and ``work`` cancelled) if ``event`` is set first."""
    task, stopped = asyncio.ensure_future(work), asyncio.create_task(event.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
