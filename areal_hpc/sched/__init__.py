"""AReaL-Hex planner: hardware catalogue, cost model, MILP, graph partition, simulator (issue 6).

This package never imports torch training code: it runs on a login node.
"""
