"""A rank of the native-engine tests: builds the layout in argv on gloo, takes one optimizer step of a
PPO-like weighted loss on its data-parallel share of a seeded packed batch (``reference_run`` is the
same in one process), and rank 0 writes what every rank saw to OUT.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \
        python -m tests.native_ranks MODEL OUT dp=2 tp=2 pp=2 fsdp=1 [sp=1] [critic=1] [empty=1] [save=DIR] [load=DIR]
            [read=1] [logits_chunk=BYTES]
        python -m tests.native_ranks MODEL OUT groups=1.2.1/2.1.1 [fsdp=1] [bucket=N] ...   # training groups
                                                                           # (dp.tp.pp each)

critic=1 trains a value model (the critic's token classifier) instead of the policy; empty=1 gives the whole
batch to dp rank 0 (the other replicas train on nothing); logits_chunk=BYTES: the log-softmax's chunk
(``algo.logprobs.LOGITS_CHUNK_BYTES``); save=DIR saves after the step and checks that a
second engine loading DIR takes the same next step; load=DIR only loads DIR and reports the weights;
read=1 only builds the engine from MODEL and reports the weights and what each rank read of MODEL's files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_hpc.algo import logprobs
from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.sequence_batch import SequenceBatch, balanced_parts
from areal_hpc.engines.torch import mixed_gradients
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs, ValueOutputs
from areal_hpc.layout import MixedLayout, ParallelDims
from areal_hpc.models.hf import load_critic, load_model, load_tokenizer, model_skeleton
from areal_hpc.models.hub_checkpoint import HubCheckpoint
from areal_hpc.parallel.mesh import build_group_meshes, init_distributed
from tests.trainer_processes import end_rank

MAX_TOKENS_PER_MB = 40  # several micro-batches per share
# The log-softmax a few positions at a time: 2 rows a chunk of the tiny model's 672 columns, 5 of the 336 a rank
# holds at tp2 (most micro-batches' positions are not multiples); the max and sums over tp per chunk.
LOGITS_IN_CHUNKS = f"logits_chunk={4 * 336 * 5}"


def seeded_batch(seed: int = 0, n: int = 9, mixed_temperatures: bool = False) -> SequenceBatch:
    """Sequences with prompt and completion, and the fields of a PPO loss whose token weights carry
    the whole batch's normaliser (token-mean); ``mixed_temperatures``: each sequence's logprobs at its
    own temperature (0.7 and 1.3 in turn, as records sampled at different ones), else the engine's."""
    generator = torch.Generator().manual_seed(seed)
    sequences, masks = [], []
    for _ in range(n):
        prompt, completion = (int(k) for k in torch.randint(2, 14, (2,), generator=generator))
        sequences.append(torch.randint(3, 600, (prompt + completion,), generator=generator).tolist())
        masks.append([0] * prompt + [1] * completion)
    targets = [torch.tensor(m[1:] + [0], dtype=torch.float32) for m in masks]  # position t predicts t+1
    total = sum(float(t.sum()) for t in targets)
    fields = {
        "weights": [t / total for t in targets],
        "advantages": [torch.randn(len(t), generator=generator) for t in targets],
        "old_logprobs": [-6.0 + 0.1 * torch.randn(len(t), generator=generator) for t in targets],
    }
    temperatures = [torch.full((len(s),), (0.7, 1.3)[i % 2]) for i, s in enumerate(sequences)]
    return SequenceBatch(sequences, masks, fields, temperatures if mixed_temperatures else None)


def ppo_like_loss(outputs, packed, fields):
    ratio = torch.exp(outputs["logprobs"] - fields["old_logprobs"])
    clipped = torch.minimum(ratio * fields["advantages"], ratio.clamp(0.8, 1.2) * fields["advantages"])
    return -(fields["weights"] * clipped).sum(), {"loss_tokens": float((fields["weights"] > 0).sum())}


def value_loss(outputs, packed, fields):
    """A critic's weighted squared error against the advantages (as returns)."""
    error = outputs["values"] - fields["advantages"]
    return (fields["weights"] * error**2).sum(), {"loss_tokens": float((fields["weights"] > 0).sum())}


def engine_on(model_dir, mesh=None, critic: bool = False) -> TorchTrainEngine:
    """Adam's eps is raised so that its first step is near-linear in the gradient (with the default,
    m/√v ≈ ±1 on elements whose gradient is ~0 turns rounding noise into lr-sized differences). One process
    (the reference) loads the model with transformers; a mesh's ranks read their parts of the folder into a
    model built on the meta device, as ``TorchTrainEngine.build`` does."""
    torch.manual_seed(0)  # the critic's fresh value head
    forward_fn = ValueOutputs() if critic else PolicyOutputs()
    options = dict(
        mesh=mesh,
        lr=1e-3,
        total_steps=4,
        optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
        max_tokens_per_mb=MAX_TOKENS_PER_MB,
        tokenizer=load_tokenizer(model_dir),
    )
    if mesh is None:
        return TorchTrainEngine((load_critic if critic else load_model)(model_dir), forward_fn, **options)
    checkpoint = HubCheckpoint(model_dir)
    skeleton = model_skeleton(checkpoint, critic=critic)
    return TorchTrainEngine.on_checkpoint(skeleton, checkpoint, forward_fn, mesh.device, **options)


def shares(batch: SequenceBatch, dp: int, empty: bool) -> list[list[int]]:
    if empty:
        return [list(range(len(batch)))] + [[] for _ in range(dp - 1)]
    return balanced_parts([len(s) for s in batch.sequences], dp)


def weights_of(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.rollout_weights(1 << 20) for name, tensor in bucket}


def held_weights(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    """The whole of each parameter this rank holds a part of (collective over its tensor- and data-
    parallel peers)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in engine.model.named_parameters()
    }


def step(engine: TorchTrainEngine, batch: SequenceBatch, critic: bool = False) -> tuple[dict, dict]:
    outputs = engine.forward(batch)
    return outputs, engine.train_step(batch, value_loss if critic else ppo_like_loss)


def reference_run(model_dir, critic: bool = False) -> dict:
    """The same step in one process, no mesh."""
    engine = engine_on(model_dir, critic=critic)
    outputs, stats = step(engine, seeded_batch(), critic)
    return {"outputs": outputs, "stats": stats, "weights": weights_of(engine)}


def main(model_dir: str, out: str, args: list[str]) -> None:
    options = dict(a.split("=", 1) for a in args)
    rank, _ = init_distributed(torch.device("cpu"))
    sizes = {k: int(v) for k, v in options.items() if k in ("dp", "tp", "pp", "cp", "ep")}
    flags = dict(fsdp=options.get("fsdp") == "1", sequence_parallel=options.get("sp") == "1")
    shapes = [[int(n) for n in group.split(".")] for group in options.get("groups", "").split("/") if group]
    layout = MixedLayout(
        tuple(ParallelDims(dp=dp, tp=tp, pp=pp, **flags) for dp, tp, pp in shapes)
        if shapes
        else (ParallelDims(**sizes, **flags),)
    )
    mesh = build_group_meshes(layout, torch.device("cpu"))
    critic = options.get("critic") == "1"
    if "bucket" in options:  # the gradient sum across groups in buckets of this many elements
        mixed_gradients.BUCKET_ELEMENTS = int(options["bucket"])
    if "logits_chunk" in options:  # bytes of float32 logits per chunk of the log-softmax: several per micro-batch
        logprobs.LOGITS_CHUNK_BYTES = int(options["logits_chunk"])
    if "read" in options:
        report(rank, out, built_from_folder(model_dir, mesh))
        return
    engine = engine_on(model_dir, mesh, critic)
    if "load" in options:
        engine.load(Path(options["load"]))
        result = {"weights": weights_of(engine) if mesh.index == 0 else {}, "held": held_weights(engine)}
    else:
        batch = seeded_batch(mixed_temperatures=options.get("temperatures") == "mixed")
        own = shares(batch, layout.replicas, options.get("empty") == "1")[mesh.data_rank]
        outputs, stats = step(engine, batch.select(own), critic)
        result = {
            "indices": own,
            "outputs": outputs,
            "stats": stats,
            "leads": mesh.leads_replica,
            "group": mesh.index,
            "held": held_weights(engine),
        }
        result["weights"] = weights_of(engine) if mesh.index == 0 else {}  # group 0 pushes and saves
        if "save" in options:
            if mesh.index == 0:
                engine.save(Path(options["save"]))
            dist.barrier()
            restored = engine_on(model_dir, mesh, critic)
            restored.load(Path(options["save"]))
            for twin in (engine, restored):  # the next step: same Adam moments and schedule position?
                step(twin, seeded_batch(seed=1).select(own), critic)
            trained, loaded = held_weights(engine), held_weights(restored)
            result["restored_step_diff"] = max(
                ((trained[k] - loaded[k]).abs().max().item() for k in trained), default=None
            )
    report(rank, out, result)


def built_from_folder(model_dir: str, mesh) -> dict:
    """The policy as ``TorchTrainEngine.build`` makes it from the folder, and no more: its weights, and what
    this rank read of the folder (bytes) against the elements it holds."""
    checkpoint = HubCheckpoint(model_dir)
    skeleton = model_skeleton(checkpoint)
    engine = TorchTrainEngine.on_checkpoint(skeleton, checkpoint, PolicyOutputs(), mesh.device, mesh=mesh)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in engine.root.parameters())
    return {"weights": weights_of(engine), "read": checkpoint.bytes_read, "held_elements": held}


def report(rank: int, out: str, result: dict) -> None:
    """Rank 0 writes what every rank saw (and its own weights) to ``out``."""
    every = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object({k: v for k, v in result.items() if k != "weights"}, every, dst=0)
    if rank == 0:
        torch.save({"ranks": every, "weights": result["weights"]}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    end_rank()
