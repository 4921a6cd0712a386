"""End-to-end runs across packages: ``areal-hpc train`` as a user runs it, repeatability, the dev Slurm cluster."""
