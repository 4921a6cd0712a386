"""Data: tasks with verifiable rewards (arithmetic, Countdown, GSM8K) and, next, trajectory shards."""
