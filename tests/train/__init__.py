"""Tests of ``areal_hpc/train/`` (floor 10): the RL trainer, SFT, DPO/RM, distillation, evaluation."""
