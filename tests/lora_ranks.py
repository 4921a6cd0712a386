"""Trainer ranks for the LoRA tests: two PPO updates with a checkpoint between them, or a resume from
that checkpoint and the second update.

    RANK=r WORLD_SIZE=w ... python -m tests.lora_ranks MODEL OUT save|resume CHECKPOINT [KEY=VALUE ...]

(started by ``trainer_processes.run_ranks(..., module="tests.lora_ranks")``). ``save``: update on the
first synthetic batch, save the actor's checkpoint (collective), update on the second; ``resume``: load
the checkpoint on every rank, update on the second batch. Rank 0 writes the merged weights the push
would send and the last update's statistics to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from areal_hpc.train.build import build_actor, start_trainer
from areal_hpc.train.trainer_ranks import TrainerRanks, follow

from .trainer_processes import end_rank, settled, synthetic_batch


def main(model: str, out: str, mode: str, checkpoint: str, overrides: list[str]) -> None:
    cfg = settled([f"model.path={model}", "rl.total_train_steps=2", *overrides])
    rank, mesh = start_trainer(cfg)
    actor, engines = build_actor(cfg, mesh)
    if mode == "resume":
        engines["actor"].load(Path(checkpoint))  # collective: every rank loads its shard
    if rank != 0:
        follow(actor, engines, mesh)
        return
    group = TrainerRanks(actor, engines, mesh, cfg)
    vocab = len(actor.actor.tokenizer)
    if mode == "save":
        group.update(synthetic_batch(vocab, seed=0))
        group.engines["actor"].save(Path(checkpoint))
    stats = group.update(synthetic_batch(vocab, seed=1))
    weights = {k: v.clone() for bucket in group.engines["actor"].rollout_weights(1 << 20) for k, v in bucket}
    group.stop()
    torch.save({"weights": weights, "stats": stats}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    end_rank()
