"""Tests of ``areal_hpc/reward/`` (floor 3): built-in rewards and the sandbox."""
