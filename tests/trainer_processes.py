"""A trainer rank for the data-parallel tests: one PPO update on a seeded synthetic batch.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.trainer_processes MODEL OUT [KEY=VALUE ...]

Every rank builds the same engines; rank 0 forms the batch, scatters the shares, and writes the
updated weights (actor, and critic for PPO) and the step's statistics to OUT (a torch file) after the update.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from areal_hpc.config import load_config
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.train.trainer_group import TrainerGroup, follow
from areal_hpc.train.build import build_actor, start_trainer


def synthetic_batch(vocab: int, groups: int = 4, group_size: int = 4, seed: int = 0) -> list[Trajectory]:
    """GRPO groups of varied lengths, rewards and behaviour logprobs (a little off-policy)."""
    rng = np.random.default_rng(seed)
    batch = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, int(rng.integers(4, 12)))
        for k in range(group_size):
            n = int(rng.integers(2, 9))
            segment = Segment(prompt, rng.integers(3, vocab, n), -rng.uniform(0.5, 3.0, n), np.zeros(n, dtype=int))
            batch.append(Trajectory([segment], group_id=f"g{g}", rewards=[Reward(float(rng.integers(0, 2)))]))
    return batch


def main(model: str, out: str, overrides: list[str]) -> None:
    cfg = load_config(None, [f"model.path={model}", "rl.total_train_steps=1", *overrides])
    rank, device, dp_group = start_trainer(cfg)
    actor, engines = build_actor(cfg, device, dp_group)
    if rank == 0:
        group = TrainerGroup(actor, cfg)
        stats = group.update(synthetic_batch(actor.actor.model.config.vocab_size))
        group.stop()
        torch.save({"weights": {name: engine.model.state_dict() for name, engine in engines.items()},
                    "stats": stats}, out)
    else:
        follow(actor)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
