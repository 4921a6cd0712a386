"""Group commit (``rollout.commits.CoalescedCommits``): items that arrive while a store runs go together into
the next one, in arrival order, each exactly once, one store at a time; a failed store fails exactly
its own items; a cancelled caller's item is still stored."""

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.rollout.commits import CoalescedCommits
from tests.waiting import wait_until


class RecordingStore:
    """``store_all`` that records each call, checks that calls never overlap, takes ``seconds`` and
    raises for calls holding an item in ``fail_on``. ``gated``: calls wait until ``open_gate()``, and
    ``calls_started`` counts the calls that began, so a test knows a store is running instead of
    guessing from a sleep."""

    def __init__(self, seconds: float = 0.0, fail_on=(), gated: bool = False):
        self.calls, self.seconds, self.fail_on = [], seconds, set(fail_on)
        self._running = threading.Lock()
        self._gate = threading.Event()
        if not gated:
            self._gate.set()
        self.calls_started = 0

    def __call__(self, items):
        assert self._running.acquire(blocking=False), "two stores ran at once"
        try:
            self.calls_started += 1
            assert self._gate.wait(timeout=60), "the test never opened the gate"
            time.sleep(self.seconds)
            self.calls.append(list(items))
            if self.fail_on & set(items):
                raise OSError(f"disk full at {sorted(self.fail_on & set(items))}")
        finally:
            self._running.release()

    def open_gate(self) -> None:
        self._gate.set()

    async def running(self) -> None:
        """Until the first call has begun (it then waits at the gate)."""
        await wait_until(lambda: self.calls_started >= 1, 30, "the first store to run")


def test_items_arriving_during_a_store_go_together_into_the_next():
    store = RecordingStore(gated=True)

    async def run():
        commits = CoalescedCommits(store)
        first = asyncio.create_task(commits.store(0))
        await store.running()
        rest = [asyncio.create_task(commits.store(i)) for i in range(1, 10)]
        await asyncio.sleep(0)  # one turn: each has handed its item over and waits
        store.open_gate()
        await asyncio.gather(first, *rest)

    asyncio.run(run())
    assert store.calls == [[0], list(range(1, 10))]


def test_a_failed_store_fails_its_own_items_only():
    store = RecordingStore(fail_on={1}, gated=True)

    async def run():
        commits = CoalescedCommits(store)
        first = asyncio.create_task(commits.store(0))
        await store.running()
        second = [asyncio.create_task(commits.store(i)) for i in (1, 2)]
        await asyncio.sleep(0)  # 1 and 2 wait for the first store
        store.open_gate()
        third = await asyncio.gather(first, *second, return_exceptions=True)
        return third, await asyncio.gather(commits.store(3), return_exceptions=True)

    (first, one, two), (three,) = asyncio.run(run())
    assert store.calls == [[0], [1, 2], [3]]
    assert first is None and three is None
    assert isinstance(one, OSError) and isinstance(two, OSError) and str(one) == "disk full at [1]"


def test_a_cancelled_callers_item_is_still_stored():
    store = RecordingStore(gated=True)

    async def run():
        commits = CoalescedCommits(store)
        first = asyncio.create_task(commits.store(0))
        await store.running()
        waiting = asyncio.create_task(commits.store(1))
        await asyncio.sleep(0)  # it has handed its item over and waits for the first store
        waiting.cancel()
        store.open_gate()
        await first
        await commits.finished()
        return waiting.cancelled()

    assert asyncio.run(run())
    assert store.calls == [[0], [1]]


@settings(max_examples=25, deadline=None)
@given(
    arrivals=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    store_ms=st.integers(0, 4),
    fail_every=st.sampled_from([0, 3, 5]),
)
def test_every_item_is_stored_once_in_arrival_order(arrivals, store_ms, fail_every):
    """Items arrive with the given gaps (ms); each caller returns or raises according to its own call."""
    failing = {i for i in range(len(arrivals)) if fail_every and i % fail_every == fail_every - 1}
    store = RecordingStore(seconds=store_ms / 1000, fail_on=failing)

    async def run():
        commits = CoalescedCommits(store)
        callers = []
        for i, gap in enumerate(arrivals):
            callers.append(asyncio.create_task(commits.store(i)))
            await asyncio.sleep(gap / 1000)
        return await asyncio.gather(*callers, return_exceptions=True)

    outcomes = asyncio.run(run())
    assert [i for call in store.calls for i in call] == list(range(len(arrivals)))
    for call in store.calls:
        failed = bool(failing & set(call))
        for i in call:
            assert isinstance(outcomes[i], OSError) if failed else outcomes[i] is None


@pytest.mark.parametrize("cancelled_first", [True, False])
def test_finished_waits_for_the_running_store(cancelled_first):
    store = RecordingStore(gated=True)

    async def run():
        commits = CoalescedCommits(store)
        caller = asyncio.create_task(commits.store(0))
        await store.running()
        if cancelled_first:
            caller.cancel()
        finishing = asyncio.create_task(commits.finished())
        await asyncio.sleep(0)
        assert not finishing.done()  # the store is still running
        store.open_gate()
        await finishing
        return len(store.calls)

    assert asyncio.run(run()) == 1
