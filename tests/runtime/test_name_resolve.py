"""Name-resolve entries carry their run's incarnation and a heartbeat: a writer that lives stays listed,
one killed without cleaning up (its file left behind) is ignored once its heartbeat is stale, and an
entry of another incarnation (a requeued job's predecessor) is never read. Writers are real processes."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from areal_hpc.errors import UserError
from areal_hpc.runtime.bootstrap import INCARNATION
from areal_hpc.runtime.name_resolve import ROLLOUT_SERVERS, NameResolve, ServerDirectory, registered, registered_server
from tests.conftest import REPO
from tests.waiting import wait_until

WRITER = """
import sys, time
from areal_hpc.runtime.name_resolve import registered_server
with registered_server(sys.argv[1], sys.argv[2], interval_s=float(sys.argv[3])):
    print("registered", flush=True)
    time.sleep(600)
"""


def start_writer(run_dir, address: str, interval_s: float, incarnation: str = "") -> subprocess.Popen:
    """A process that registers ``address`` and keeps its heartbeat, until killed."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run_dir), address, str(interval_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, INCARNATION: incarnation},
    )
    assert writer.stdout.readline() == "registered\n"
    return writer


@pytest.fixture
def writers():
    started = []
    yield lambda *args, **kwargs: started.append(start_writer(*args, **kwargs)) or started[-1]
    for writer in started:
        writer.kill()
        writer.wait()


def test_a_live_writer_stays_listed_and_a_killed_ones_entry_is_ignored_once_stale(tmp_path, writers):
    # a beat every 0.2 s, stale after 2 s: a beat (an fsynced write) may lag 1.8 s on a loaded machine
    names = NameResolve(tmp_path / "name_resolve", incarnation="", stale_after_s=2.0)
    writer = writers(tmp_path, "node1:30000", interval_s=0.2)

    async def listed_for(seconds: float) -> float:  # listed at every look, for longer than the stale limit
        started = time.monotonic()
        await wait_until(
            lambda: names.values(ROLLOUT_SERVERS) != ["node1:30000"] or time.monotonic() - started > seconds,
            timeout=30,
            what="two stale limits to pass",
        )
        return time.monotonic() - started

    assert asyncio.run(listed_for(4.0)) > 4.0 and names.values(ROLLOUT_SERVERS) == ["node1:30000"]
    writer.kill()
    writer.wait()
    started = time.monotonic()
    asyncio.run(wait_until(lambda: not names.values(ROLLOUT_SERVERS), timeout=30, what="the entry to go stale"))
    assert time.monotonic() - started < 10.0  # its stale limit, not the default 30 s
    assert (tmp_path / "name_resolve" / ROLLOUT_SERVERS / "node1:30000").is_file()  # left behind, and ignored
    # the default limit (30 s) has not passed yet: age decides, not the file
    assert NameResolve(tmp_path / "name_resolve", incarnation="").values(ROLLOUT_SERVERS) == ["node1:30000"]


def test_entries_of_another_incarnation_are_ignored(tmp_path, writers, monkeypatch):
    writers(tmp_path, "node1:30000", interval_s=5.0, incarnation="4242.0")  # the job before its requeue
    writers(tmp_path, "node2:30000", interval_s=5.0, incarnation="4242.1")
    root = tmp_path / "name_resolve"
    assert NameResolve(root, incarnation="4242.1").values(ROLLOUT_SERVERS) == ["node2:30000"]
    assert NameResolve(root, incarnation="4242.0").values(ROLLOUT_SERVERS) == ["node1:30000"]
    assert NameResolve(root, incarnation="").values(ROLLOUT_SERVERS) == ["node1:30000", "node2:30000"]
    monkeypatch.setenv(INCARNATION, "4242.1")  # a reader knows its own incarnation from the launcher
    assert NameResolve(root).values(ROLLOUT_SERVERS) == ["node2:30000"]


def test_a_server_entry_lasts_as_long_as_its_block(tmp_path):
    names = NameResolve(tmp_path / "name_resolve", incarnation="")
    with registered_server(tmp_path, "node1:30000"):
        assert names.values(ROLLOUT_SERVERS) == ["node1:30000"]
    assert names.values(ROLLOUT_SERVERS) == []
    assert not (tmp_path / "name_resolve" / ROLLOUT_SERVERS / "node1:30000").exists()


def test_the_directory_reports_servers_that_join_or_restart(tmp_path):
    names = NameResolve(tmp_path, incarnation="")
    directory = ServerDirectory(names)
    with registered(names, f"{ROLLOUT_SERVERS}/a:1", "a:1"):
        assert directory.current() == ["a:1"] and directory.changes() == []
        with registered(names, f"{ROLLOUT_SERVERS}/b:1", "b:1"):
            assert directory.changes() == ["b:1"] and directory.changes() == []
    with registered(names, f"{ROLLOUT_SERVERS}/a:1", "a:1"):  # a new process at the same address
        assert directory.changes() == ["a:1"] and directory.changes() == []


def test_entries_that_are_not_entries_are_skipped_and_keys_stay_inside(tmp_path):
    names = NameResolve(tmp_path, incarnation="")
    names.add(f"{ROLLOUT_SERVERS}/node1:30000", "node1:30000")
    (tmp_path / ROLLOUT_SERVERS / "notes.txt").write_text("node9:1")  # not written by name-resolve
    (tmp_path / ROLLOUT_SERVERS / ".node2:30000.123.tmp").write_text("{")  # a write in progress
    assert names.values(ROLLOUT_SERVERS) == ["node1:30000"] and names.values("nothing/here") == []
    names.delete(f"{ROLLOUT_SERVERS}/node1:30000")
    assert names.values(ROLLOUT_SERVERS) == []
    with pytest.raises(UserError, match="without '.' or '..'"):
        names.add("../escape", "x")
