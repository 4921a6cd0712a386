"""A rank of the Megatron-engine tests: ``tests.native_ranks`` (its seeded batch, PPO-like step, empty
shares, save / load) with a ``MegatronTrainEngine`` in place of the torch engine, so the tests compare
it with the torch engine's step in one process (``native_ranks.reference_run``).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \
        python -m tests.megatron_ranks MODEL OUT dp=2 tp=2 pp=2 [empty=1] [save=DIR] [load=DIR] [temperature=T]

temperature=T: the policy's outputs at sampling temperature T (1 by default).
"""

from __future__ import annotations

import functools
import sys

import torch

from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.megatron.engine import MegatronTrainEngine
from areal_hpc.models.hf import load_tokenizer
from tests import native_ranks
from tests.trainer_processes import end_rank


def engine_on(model_dir, mesh=None, critic: bool = False, temperature: float = 1.0) -> MegatronTrainEngine:
    """``native_ranks.engine_on``'s settings (Adam eps raised, clipping at 0.5, the critic's head drawn
    after the same seed) on Megatron."""
    torch.manual_seed(0)
    return MegatronTrainEngine(
        str(model_dir),
        "critic" if critic else "policy",
        temperature=temperature,
        mesh=mesh,
        lr=1e-3,
        total_steps=4,
        optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
        max_tokens_per_mb=native_ranks.MAX_TOKENS_PER_MB,
        tokenizer=load_tokenizer(model_dir),
    )


def main(model_dir: str, out: str, args: list[str]) -> None:
    options = dict(a.split("=", 1) for a in args)
    native_ranks.engine_on = functools.partial(engine_on, temperature=float(options.get("temperature", 1.0)))
    native_ranks.main(model_dir, out, args)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    end_rank()
