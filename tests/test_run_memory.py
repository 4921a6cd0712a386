"""The launcher's peak-memory figure ("peak memory of the run's processes", what the quickstart's 1 GiB
target is read from): the PSS of every process carrying the run's marker, read from /proc, of real
processes. Processes that fork and exit while it samples (the fork server starting the trainers and
servers) must not have their shared pages counted twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from areal_hpc.launch.local import RunMemory
from areal_hpc.runtime.bootstrap import RUN_MARKER

HOLDER = """
import sys, time
block = bytearray(int(sys.argv[1]) * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
time.sleep(60)
"""

# holds 96 MiB, then forks a child every 20 ms that touches nothing and exits after 20 ms
FORKER = """
import os, sys, time
block = bytearray(96 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pid = os.fork()
    if pid == 0:
        time.sleep(0.02)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.02)
"""


def _start(code: str, run: str, *args: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env={**os.environ, RUN_MARKER: run}
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def _pss_mib(pid: int, field: str = "Pss:") -> float:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith(field)) / 1024


def test_the_peak_counts_every_process_of_the_run_and_no_other(tmp_path):
    run = str(tmp_path / "run")
    ours = [_start(HOLDER, run, "64"), _start(HOLDER, run, "32")]
    other = _start(HOLDER, str(tmp_path / "another-run"), "128")
    try:
        memory = RunMemory(run)
        memory.stop()
        memory.sample()
        expected = sum(_pss_mib(p.pid) for p in ours) + _pss_mib(os.getpid())
        assert abs(memory.peak / 2**20 - expected) < 8, (memory.peak / 2**20, expected)
        assert memory.peak / 2**20 < expected + 64  # the other run's 128 MiB are not ours
    finally:
        for process in (*ours, other):
            process.kill()
            process.wait()


def test_a_sample_taken_while_processes_fork_and_exit_counts_nothing_twice(tmp_path):
    run = str(tmp_path / "run")
    forker = _start(FORKER, run)
    try:
        memory = RunMemory(run)
        memory.stop()
        # the forker and its children share its pages: together they hold its RSS (a child adds ~nothing)
        steady = _pss_mib(forker.pid, "Rss:") + _pss_mib(os.getpid())
        deadline = time.monotonic() + 4  # ~100 forks, each sampled around many times
        while time.monotonic() < deadline:
            memory.sample()
        # a fork read before it (the parent's 96 MiB whole) and its child after (half of them) would add 48
        assert steady - 16 < memory.peak / 2**20 < steady + 16, (memory.peak / 2**20, steady)
    finally:
        forker.kill()
        forker.wait()
