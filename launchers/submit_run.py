"""Submit one run as a heterogeneous Slurm job from Python, and wait for it: what `areal-hpc submit`
does, for notebooks and pipelines of your own.

    python launchers/submit_run.py --profile slurm/profiles/dev.yaml --config configs/quickstart.yaml \
        rl.total_train_steps=50
"""

import argparse
import sys

from areal_hpc.launch.submit import describe, prepare, submit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True)
parser.add_argument("--profile")
parser.add_argument("--plan")
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()

submission = prepare(args.config, args.overrides, args.profile, args.plan)
job = submit(submission)  # a submitit Job: job.state, job.result(), job.cancel()
print(describe(submission, job.job_id))
results = job.results()  # one per task; raises submitit's FailedJobError with the failing task's reason
print(f"job {job.job_id} finished: trainer rank 0 returned {results[0]}", file=sys.stderr)
