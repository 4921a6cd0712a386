"""Training: the torch-native engine, the PPO actor, the asynchronous RL driver, checkpoints, weight
sync, SFT, evaluation, metrics and plots."""
