"""Tests of ``areal_hpc/launch/`` (floor 11): the local launcher, Slurm submission, sweeps."""
