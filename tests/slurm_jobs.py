"""Watching jobs on the dev Slurm cluster from tests: their state in ``sacct`` (every component of a
heterogeneous job), waiting with a deadline, and cancelling what a test submitted."""

from __future__ import annotations

import re
import subprocess
import time

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def submitted_job(output: str) -> str:
    """The job id ``areal-hpc submit`` printed."""
    found = re.search(r"submitted job (\d+)", output)
    assert found, f"no job id in: {output}"
    return found.group(1)


def components_of(job: str) -> dict[str, tuple[str, str, str]]:
    """``{"38+0": (state, exit code, node list), ...}`` of the job's allocations (no steps)."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode,NodeList"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line]
    return {row[0]: (row[1].split()[0], row[2], row[3]) for row in rows}


def wait_for_end(job: str, timeout: float, components: int = 1) -> dict[str, tuple[str, str, str]]:
    """Wait until sacct reports all ``components`` of the job (it lags squeue, and may briefly show a
    het job as one record) in a final state; cancel the job and fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = components_of(job)
        if len(found) >= components and all(state in FINAL for state, _, _ in found.values()):
            return found
        if time.monotonic() > deadline:
            queue = subprocess.run(["squeue", "-j", job], capture_output=True, text=True).stdout
            cancel(job)
            raise AssertionError(f"job {job} did not end within {timeout:g} s: {found}\n{queue}")
        time.sleep(0.25)


def wait_for(condition, timeout: float, what: str):
    """``condition()`` every 0.2 s until it is true; its value, or a failure after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)
    return result


def cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True)
