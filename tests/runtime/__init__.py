"""Tests of ``areal_hpc/runtime/`` (floor 4): bootstrap, name-resolve, the fork server, process exit, MPI."""
