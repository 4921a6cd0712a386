"""Launchers, the top floor below the CLI: the local launcher, Slurm heterogeneous jobs through
submitit, plain-sbatch tasks, requeue on preemption, and sweeps. Nothing but ``cli.py`` imports them."""
