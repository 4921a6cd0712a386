"""Watching jobs on the dev Slurm cluster from tests: their state in ``sacct`` (every component of a
heterogeneous job), waiting with a deadline for a named state and saying the last state seen when it
does not come, and cancelling what a test submitted."""

from __future__ import annotations

import re
import subprocess
import time

FINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
SACCT_RETRY_S = 30  # slurmdbd busy or restarting: sacct fails for a while, then answers


def submitted_job(output: str) -> str:
    """The job id ``areal-hpc submit`` printed."""
    found = re.search(r"submitted job (\d+)", output)
    assert found, f"no job id in: {output}"
    return found.group(1)


def sacct(job: str, fields: str) -> list[list[str]]:
    """``sacct -X`` rows (allocations, no steps) of ``job``, one list of ``fields`` each. A failing
    sacct (slurmdbd busy on a loaded machine) is asked again for up to ``SACCT_RETRY_S``."""
    deadline = time.monotonic() + SACCT_RETRY_S
    while True:
        done = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", fields], capture_output=True, text=True)
        if done.returncode == 0:
            return [line.split("|") for line in done.stdout.splitlines() if line]
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct -j {job} failed for {SACCT_RETRY_S} s: {done.stderr.strip()}")
        time.sleep(1)


def components_of(job: str) -> dict[str, tuple[str, str, str]]:
    """``{"38+0": (state, exit code, node list), ...}`` of the job's allocations (no steps)."""
    return {row[0]: (row[1].split()[0], row[2], row[3]) for row in sacct(job, "JobID,State,ExitCode,NodeList")}


def wait_for_end(job: str, timeout: float, components: int = 1) -> dict[str, tuple[str, str, str]]:
    """Wait until sacct reports all ``components`` of the job (it lags squeue, and may briefly show a
    het job as one record) in a final state; cancel the job and fail the test after ``timeout``, saying
    the states sacct and squeue showed last."""
    deadline = time.monotonic() + timeout
    while True:
        found = components_of(job)
        if len(found) >= components and all(state in FINAL for state, _, _ in found.values()):
            return found
        if time.monotonic() > deadline:
            queue = subprocess.run(["squeue", "-j", job], capture_output=True, text=True).stdout
            cancel(job)
            raise AssertionError(
                f"job {job} did not end ({components} components in a final state) within "
                f"{timeout:g} s; last seen in sacct: {found}\nsqueue:\n{queue}"
            )
        time.sleep(0.25)


def wait_for(condition, timeout: float, what: str, seen=None):
    """``condition()`` every 0.2 s until it is true; its value, or a failure after ``timeout`` seconds
    saying ``what`` and, given ``seen``, what ``seen()`` finds then (e.g. the job's state in sacct)."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}"
                + (f"; last seen: {seen()}" if seen is not None else "")
            )
        time.sleep(0.2)
    return result


def elapsed_s(job: str) -> int:
    """How long the job ran, by Slurm's clock (its longest component): not its time in the queue, nor
    sacct's lag behind the job's end."""
    return max(int(seconds) for _, seconds in sacct(job, "JobID,ElapsedRaw"))


def ended_at(job: str) -> float:
    """When the job's last allocation ended, by Slurm's clock (seconds since the epoch, 1 s resolution): a
    duration measured against it leaves out sacct's lag behind the job's end."""
    return max(time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S")) for (end,) in sacct(job, "End"))


def states(job: str) -> str:
    """The job's allocations as sacct and squeue show them now, for a failure message."""
    queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T %R"], capture_output=True, text=True)
    return f"sacct {components_of(job)}, squeue {queue.stdout.strip() or queue.stderr.strip() or 'nothing'}"


def cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True)
