"""RL algorithms and batching: micro-batch allocation and sequence packing (advantages and losses next)."""
