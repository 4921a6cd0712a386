"""Run the ``srun`` of a job step so that the batch script gets past it when its step has ended.

Slurm before 24.11 starts one PMIx abort agent per het group inside srun but keeps the handle of only
the last one (SchedMD ticket 16817, fixed by "mpi/pmix - Prevent multiple abort agents"): an srun whose
step spans several het groups under ``--mpi=pmix`` (or ``MpiDefault=pmix``) can hang in
``pmixp_abort_agent_stop`` after every task of its step has exited, and the job then holds its nodes
until its time limit. On the dev cluster (22.05.8) one such step in about 25 hung.

The guard runs srun as its child and watches the job's steps (``squeue``, ``sacct``). Once the steps that
appeared after srun started have all left the queue and srun is still there ``grace_s`` seconds later,
it kills srun and exits with the step's exit code as ``sacct`` recorded it (the largest of its tasks',
as srun itself reports). Outside a Slurm job it simply runs the command.

    python -m areal_hpc.launch.srun_guard [--poll-s S] [--grace-s S] srun --het-group=0-1 ... command
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

NOT_STEPS = {"batch", "extern", "interactive"}
NOT_ENDED = {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING"}  # sacct State of a live record
SACCT_WAIT_S = 30.0  # slurmdbd may record a step's end a few seconds after squeue drops it
CLOCK_SKEW_S = 5.0


def running_steps(job: str) -> set[str] | None:
    """Step numbers of ``job`` that squeue lists now ("958.0" -> "0"); None when squeue did not answer."""
    try:
        listed = subprocess.run(
            ["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return None
    if listed.returncode != 0:
        return None
    steps = {line.strip().rsplit(".", 1)[1] for line in listed.stdout.splitlines() if "." in line}
    return steps - NOT_STEPS


def recorded_steps(job: str, since: float, heterogeneous: bool = False) -> dict[str, int | None]:
    """The steps sacct has recorded for ``job`` (see ``steps_of_sacct``); none when sacct did not answer."""
    try:
        listed = subprocess.run(
            ["sacct", "-n", "-P", "-j", job, "-o", "JobID,Start,State,ExitCode"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except subprocess.TimeoutExpired:
        return {}
    return steps_of_sacct(listed, since, heterogeneous)


def steps_of_sacct(listed: str, since: float, heterogeneous: bool) -> dict[str, int | None]:
    """The steps in ``sacct -n -P -o JobID,Start,State,ExitCode`` output that started at ``since`` (a Unix
    time) or later (a requeued job's earlier incarnation keeps its own), each with the largest exit code
    over its tasks in every het component (a task ended by signal S counts as 128 + S, as srun reports
    it), or None while any component's record of it has not ended: slurmdbd records each het component's
    end on its own, and a component still shows RUNNING with exit code 0 for a moment after the step has
    left squeue.

    In a ``heterogeneous`` job a record without a component ("958.0", not "958+1.0") is slurmdbd's view
    before it has learnt the job's components: it holds the first component's tasks only, so the step
    counts as not ended until the per-component records ("958+0.0", "958+1.0") are there."""
    codes: dict[str, int] = {}
    live: set[str] = set()
    for line in listed.splitlines():
        step_id, start, state, exit_code = (line.split("|") + ["", "", ""])[:4]
        found = re.fullmatch(r"\d+(\+\d+)?\.(\w+)", step_id)
        if not found or found.group(2) in NOT_STEPS or not _started_since(start, since):
            continue
        step = found.group(2)
        if heterogeneous and not found.group(1):
            live.add(step)
        status, _, signal = exit_code.partition(":")
        code = int(status) or (128 + int(signal) if signal and int(signal) else 0)
        codes[step] = max(code, codes.get(step, 0))
        if not state or state.split()[0] in NOT_ENDED:  # "CANCELLED by 0" is ended
            live.add(step)
    return {step: None if step in live else code for step, code in codes.items()}


def _started_since(start: str, since: float) -> bool:
    """Whether sacct's Start (local time, or Unknown/None for what has not started) is at ``since`` or later,
    give or take the clocks of two hosts."""
    try:
        return datetime.datetime.fromisoformat(start).timestamp() >= since - CLOCK_SKEW_S
    except ValueError:
        return False


def run_guarded(command: list[str], job: str, poll_s: float = 10.0, grace_s: float = 30.0) -> int:
    """Run ``command`` (an srun) to its end, or until its step has been gone ``grace_s`` seconds.

    Its steps are those that appear after it starts, in squeue while they run or in sacct once they
    have ended (a short step may come and go between two looks)."""
    started = time.time()
    heterogeneous = int(os.environ.get("SLURM_HET_SIZE", "1")) > 1
    before = running_steps(job) or set()  # steps of the batch script that were there already
    srun = subprocess.Popen(command)
    ours: set[str] = set()
    gone_since = None
    while True:
        try:
            return srun.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        running = running_steps(job)
        if running is None:
            continue
        ours |= running - before
        if ours & running:
            gone_since = None
            continue
        ours |= set(recorded_steps(job, started, heterogeneous)) - before
        if ours:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= grace_s:
                break
    srun.kill()
    srun.wait()
    deadline = time.monotonic() + SACCT_WAIT_S
    while (
        any((codes := recorded_steps(job, started, heterogeneous)).get(step) is None for step in ours)
        and time.monotonic() < deadline
    ):
        time.sleep(1.0)
    code = max((codes[step] for step in ours if codes.get(step) is not None), default=None)
    print(
        f"areal-hpc: srun was still running {grace_s:g} s after its step {job}.{','.join(sorted(ours))} ended "
        "(Slurm before 24.11 with PMIx across het groups, SchedMD ticket 16817): ended it; the step's exit code "
        f"is {'unknown to sacct' if code is None else code}",
        file=sys.stderr,
        flush=True,
    )
    return 1 if code is None else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_hpc.launch.srun_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--poll-s", type=float, default=10.0, help="how often to look at the job's steps")
    parser.add_argument("--grace-s", type=float, default=30.0, help="how long srun may outlive its step")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the srun command line")
    args = parser.parse_args(argv)
    if not args.command:
        print(f"{parser.prog}: no command given: expected an srun command line after the options", file=sys.stderr)
        return 2
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return subprocess.run(args.command).returncode
    return run_guarded(args.command, job, args.poll_s, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
