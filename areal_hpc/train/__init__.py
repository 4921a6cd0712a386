"""Training: the SFT trainer, optimiser and schedule, evaluation, metrics (RL engines next)."""
