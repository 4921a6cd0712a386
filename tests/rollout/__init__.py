"""Tests of ``areal_hpc/rollout/`` (floor 7): the embedded server, its weights and sampler, client, controller."""
