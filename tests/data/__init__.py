"""Tests of ``areal_hpc/data/`` (floor 3): tasks, your data, the reward pool, trajectory shards."""
