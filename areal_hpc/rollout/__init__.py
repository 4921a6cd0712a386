"""Rollout: servers with SGLang's HTTP contract (the embedded engine here, SGLang on GPUs), the client
that drives a group of them, and AReaL's staleness-gated controller with its workflows.
"""
