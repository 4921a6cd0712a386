"""Data: tasks with verifiable rewards (arithmetic, Countdown, GSM8K), the trajectory record and its HDF5 shards."""
