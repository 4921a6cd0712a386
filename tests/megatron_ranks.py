"""A rank of the Megatron-engine tests: ``tests.native_ranks``'s seeded batch and PPO-like step on a
``MegatronTrainEngine`` in the layout of argv (gloo), compared by the tests with the torch engine's
step in one process (``native_ranks.reference_run``); rank 0 writes what every rank saw to OUT.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \
        python -m tests.megatron_ranks MODEL OUT dp=2 tp=2 pp=2 [empty=1] [save=DIR] [load=DIR] [temperature=T]

temperature=T only runs ``forward`` at that temperature; empty=1 gives the whole batch to dp rank 0;
save=DIR saves after the step, and a second engine loading DIR must take the same next step;
load=DIR only loads DIR and reports the weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from areal_hpc.config import OptimizerConfig
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.parallel.dims import ParallelDims
from areal_hpc.parallel.mesh import build_mesh, init_distributed
from areal_hpc.train.megatron_engine import MegatronTrainEngine
from tests.native_ranks import MAX_TOKENS_PER_MB, seeded_batch, shares, step, weights_of


def engine_on(model_dir, mesh, temperature: float = 1.0) -> MegatronTrainEngine:
    """``native_ranks.engine_on``'s optimizer settings (Adam eps raised, clipping at 0.5)."""
    return MegatronTrainEngine(str(model_dir), "policy", temperature=temperature, mesh=mesh, lr=1e-3, total_steps=4,
                               optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
                               max_tokens_per_mb=MAX_TOKENS_PER_MB, tokenizer=load_tokenizer(model_dir))


def main(model_dir: str, out: str, args: list[str]) -> None:
    options = dict(a.split("=", 1) for a in args)
    rank, _ = init_distributed(torch.device("cpu"))
    sizes = {k: int(v) for k, v in options.items() if k in ("dp", "tp", "pp")}
    mesh = build_mesh(ParallelDims(**sizes), torch.device("cpu"))
    engine = engine_on(model_dir, mesh, float(options.get("temperature", 1.0)))
    own = shares(seeded_batch(), mesh.dims.dp, options.get("empty") == "1")[mesh.data_rank]
    if "load" in options:
        engine.load(Path(options["load"]))
        result = {"weights": weights_of(engine)}
    elif "temperature" in options:
        result = {"indices": own, "outputs": engine.forward(seeded_batch().select(own))}
    else:
        outputs, stats = step(engine, seeded_batch().select(own))
        result = {"indices": own, "outputs": outputs, "stats": stats, "leads": mesh.leads_replica,
                  "weights": weights_of(engine)}
        if "save" in options:
            engine.save(Path(options["save"]))
            restored = engine_on(model_dir, mesh)
            restored.load(Path(options["save"]))
            for twin in (engine, restored):  # the next step: same Adam moments and schedule position?
                step(twin, seeded_batch(seed=1).select(own))
            trained, loaded = weights_of(engine), weights_of(restored)
            result["restored_step_diff"] = max(((trained[k] - loaded[k]).abs().max().item() for k in trained),
                                               default=None)
    every = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object({k: v for k, v in result.items() if k != "weights"}, every, dst=0)
    if rank == 0:
        torch.save({"ranks": every, "weights": result.get("weights")}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
