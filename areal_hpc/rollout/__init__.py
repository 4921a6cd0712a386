"""Rollout: the embedded engine with SGLang's HTTP contract, the SGLang launcher and the staleness-gated
controller (issue 4). Empty until then; evaluation uses transformers' generate in areal_hpc.train.evaluate.
"""
