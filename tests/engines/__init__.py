"""Tests of ``areal_hpc/engines/`` (floor 7): the torch and Megatron engines in every layout and precision."""
