"""Tests of ``areal_hpc/parallel/`` (floor 5): the mesh, mixed layouts, the device."""
