"""Tests of ``areal_hpc/sched/`` (floor 6): the planner, its cost model, MILP, simulator, memory estimator."""
