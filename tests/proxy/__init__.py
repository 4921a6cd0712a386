"""Tests of ``areal_hpc/proxy/`` (floor 8): the login-node gateway."""
