"""Tests of ``areal_hpc/agents/`` (floor 9): workflows, built-in agents, GRPO groups."""
