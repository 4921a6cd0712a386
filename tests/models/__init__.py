"""Tests of ``areal_hpc/models/`` (floor 3): the tiny model, the segment forward."""
