"""``areal-hpc train | submit | slurm-task``: the launchers' subcommands, each as the function that declares its
arguments and the one that runs it; ``areal_hpc/cli.py`` lists them in its table.

    areal-hpc train --config configs/quickstart.yaml [--resume]
    areal-hpc submit --config FILE --profile slurm/profiles/dev.yaml [--plan plan.yaml] [--dry-run]
    areal-hpc slurm-task --config FILE          (what slurm/*.sbatch scripts run under srun)
"""

from __future__ import annotations

import argparse
import sys

from areal_hpc.arguments import config_arguments


def train_arguments(train: argparse.ArgumentParser) -> None:
    """Declare ``train``'s arguments on its parser."""
    config_arguments(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const="always",
        default="never",
        choices=["always", "auto", "never"],
        help="continue the run from its latest checkpoint; --resume=auto: continue if there is "
        "one, else start (what a requeued job does)",
    )


def run_train(args: argparse.Namespace) -> int:
    from areal_hpc.launch.local import launch

    return launch(args.config, args.overrides, args.resume)


def submit_arguments(sub: argparse.ArgumentParser) -> None:
    """Declare ``submit``'s arguments on its parser."""
    config_arguments(sub)
    sub.add_argument(
        "--profile", metavar="FILE", help="site profile YAML under the config (e.g. slurm/profiles/dev.yaml)"
    )
    sub.add_argument(
        "--plan",
        metavar="FILE",
        help="`areal-hpc plan --out` output: its pools' partitions become the job's components",
    )
    sub.add_argument(
        "--resume",
        nargs="?",
        const="always",
        default="never",
        choices=["always", "auto", "never"],
        help="as for `train`: continue the run folder's run (a requeued job always does)",
    )
    sub.add_argument(
        "--dry-run",
        action="store_true",
        help="print the job script and check it with `sbatch --test-only`; submit nothing",
    )
    sub.add_argument(
        "--check-memory",
        metavar="DEVICE",
        help="refuse the run, before anything is queued, if a "
        "trainer rank or a rollout server would not fit in DEVICE's memory: a device type (H100, H20, "
        "...) or a size in GB (e.g. 24)",
    )


def run_submit(args: argparse.Namespace) -> int:
    from areal_hpc.launch.submit import describe, prepare, script, submit, test_only

    submission = prepare(args.config, args.overrides, args.profile, args.plan, args.resume)
    if args.check_memory:
        from areal_hpc.algo.logprobs import LOGITS_CHUNK_BYTES
        from areal_hpc.sched.cli import check_run_memory

        print(check_run_memory(submission.cfg, args.check_memory, LOGITS_CHUNK_BYTES), file=sys.stderr)
    if args.dry_run:
        print(script(submission))
        print(f"sbatch --test-only: {test_only(script(submission))}", file=sys.stderr)
        return 0
    job = submit(submission)
    print(describe(submission, job.job_id))
    return 0


def run_slurm_task(args: argparse.Namespace) -> int:
    from areal_hpc.launch.slurm_task import main

    return main(args.config, args.overrides)
