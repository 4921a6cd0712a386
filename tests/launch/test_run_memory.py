"""The launcher's peak-memory figure ("peak memory of the run's processes", what the quickstart's 1 GiB
target is read from): the PSS of every process carrying the run's marker, read from /proc, of real
processes. Processes that fork and exit while it samples (the fork server starting the trainers and
servers) must not have their shared pages counted twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


# RunMemory in a process of its own, sampling for 4 s while the forker forks (~100 forks, each sampled around
# many times). What the run holds meanwhile: the forker and its children share its pages, so together they
# hold its RSS (a child adds ~nothing), plus the sampler's own PSS, read before and after. In the pytest worker
# instead, that PSS moved by 19 MiB within the 4 s once (a process sharing the worker's pages exited).
SAMPLER = """
import json, sys, time
from areal_hpc.launch.local import RunMemory

def mib(pid, field):
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith(field)) / 1024

forker, run = int(sys.argv[1]), sys.argv[2]
memory = RunMemory(run)
memory.stop()
before = mib(forker, "Rss:") + mib("self", "Pss:")
deadline = time.monotonic() + 4
while time.monotonic() < deadline:
    memory.sample()
after = mib(forker, "Rss:") + mib("self", "Pss:")
print(json.dumps({"peak": memory.peak / 2**20, "before": before, "after": after}))
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
        sampler = subprocess.run(
            [sys.executable, "-c", SAMPLER, str(forker.pid), run], capture_output=True, text=True, timeout=120
        )
        assert sampler.returncode == 0, sampler.stderr[-3000:]
        seen = json.loads(sampler.stdout)
        low, high = sorted((seen["before"], seen["after"]))
        # a fork read before it (the parent's 96 MiB whole) and its child after (half of them) would add 48
        assert low - 16 < seen["peak"] < high + 16, seen
    finally:
        forker.kill()
        forker.wait()
