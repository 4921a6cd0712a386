"""Training on any engine: the PPO actor, the asynchronous RL driver, checkpoints, the weight push to
rollout servers, SFT, evaluation, metrics and plots."""
