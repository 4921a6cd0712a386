"""Launching: name-resolve on the shared filesystem, server supervision, (next) local and Slurm launchers."""
