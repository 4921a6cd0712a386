"""RL algorithms: advantages (GRPO family, RLOO, REINFORCE++, GAE), the decoupled PPO/GSPO loss,
DAPO filters, and micro-batching (dynamic allocation, 1D packing). Pure torch, no engines."""
