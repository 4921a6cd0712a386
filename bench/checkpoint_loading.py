"""Per-rank peak memory of building the torch engine from a checkpoint as the Hub ships it (bf16 safetensors
shards and their index), on gloo ranks of this machine, two routes in turn:
- ``slices`` (``TorchTrainEngine.build`` today): the model built on the meta device, parallelised there, then each
  rank reading only the slices it keeps (``engines.torch.rank_weights``);
- ``whole`` (the route before): every rank loads the whole model with transformers, then parallelises it.

    .venv/bin/python bench/checkpoint_loading.py [--layouts pp2_fsdp2 tp2_pp2 fsdp4] [--save]

Model: a random Llama-structure model (hidden 512, 8 layers, MLP 1536, vocabulary 32,000, untied head: 58M
parameters, 117 MB in bf16), written in shards of at most 40 MB; float32 parameters, no optimizer.
Memory, per rank: peak RSS (VmHWM, reset through /proc/self/clear_refs right before the build) minus the RSS at
that moment; what building the engine added, anonymous memory and the checkpoint's pages mapped while read
alike. The rank's shard: the bytes of the parameters it holds (its local parts, float32). Target: <= 1.3x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record, versions

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {  # name: ParallelDims' fields, over 4 ranks
    "pp2_fsdp2": dict(pp=2, dp=2, fsdp=True),
    "tp2_pp2": dict(tp=2, pp=2),
    "fsdp4": dict(dp=4, fsdp=True),
}
ROUTES = ("slices", "whole")
TARGET = 1.3


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_main(model: str, out: str, layout: str, route: str) -> None:
    """One rank: build the engine by ``route`` and write what it added to its memory, and its shard."""
    import torch
    from torch.distributed.tensor import DTensor

    from areal_hpc.engines.torch.engine import TorchTrainEngine
    from areal_hpc.engines.torch.outputs import PolicyOutputs
    from areal_hpc.layout import MixedLayout, ParallelDims
    from areal_hpc.models.hf import load_model, model_skeleton
    from areal_hpc.models.hub_checkpoint import HubCheckpoint
    from areal_hpc.parallel.mesh import build_group_meshes, close_distributed, init_distributed

    cpu = torch.device("cpu")
    rank, _ = init_distributed(cpu)
    mesh = build_group_meshes(MixedLayout((ParallelDims(**LAYOUTS[layout]),)), cpu)
    model_skeleton(HubCheckpoint(model))  # the model's classes imported before measuring, on either route
    torch.distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = status_kib("VmRSS")
    if route == "slices":
        checkpoint = HubCheckpoint(model)
        engine = TorchTrainEngine.on_checkpoint(model_skeleton(checkpoint), checkpoint, PolicyOutputs(), cpu, mesh=mesh)
    else:
        engine = TorchTrainEngine(load_model(model), PolicyOutputs(), mesh=mesh)
    peak, after = status_kib("VmHWM"), status_kib("VmRSS")
    held = [p.to_local() if isinstance(p, DTensor) else p for p in engine.root.parameters()]
    shard = sum(t.numel() * t.element_size() for t in held)
    Path(f"{out}.rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "peak_mib": (peak - before) / 1024,
                "kept_mib": (after - before) / 1024,
                "shard_mib": shard / 2**20,
            }
        )
    )
    close_distributed()


def write_model(folder: Path) -> float:
    """The bench's model, bf16 safetensors shards and their index in ``folder``; its size in MiB on disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40MB")
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def launch(model: Path, out: Path, layout: str, route: str, world: int = 4) -> list[dict]:
    port = 29000 + os.getpid() % 1000
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, __file__, "--rank-of", str(model), str(out), layout, route]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r)}, cwd=REPO) for r in range(world)]
    if any(p.wait() for p in ranks):
        raise SystemExit(f"a rank of {layout}/{route} failed")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]


def run(args) -> dict:

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        size = write_model(model)
        for layout in args.layouts:
            for route in ROUTES:
                for rank in launch(model, Path(tmp) / f"{layout}-{route}", layout, route):
                    rows.append({"layout": layout, "route": route, **rank})
    return {
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": versions("torch", "transformers", "safetensors"),
        "model_mib_bf16": size,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = [
        f"# Per-rank peak memory building the torch engine from a Hub-form checkpoint ({result['date']})",
        "",
        f"Machine: {result['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + f". Model: {result['model_mib_bf16']:.0f} MiB in bf16 (shards of <= 40 MB); float32 parameters; 4 gloo "
        "ranks. Peak: VmHWM over the build minus the RSS before it (MiB); shard: the parameters the rank holds.",
        "",
        "| layout | rank | shard | slices: peak | slices: peak / shard | whole: peak | whole: peak / shard |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["layout"], r["route"], r["rank"]): r for r in result["rows"]}
    worst = 0.0
    for layout, _, rank in sorted(k for k in by if k[1] == "slices"):
        ours, before = by[layout, "slices", rank], by[layout, "whole", rank]
        worst = max(worst, ours["peak_mib"] / ours["shard_mib"])
        lines.append(
            f"| {layout} | {rank} | {ours['shard_mib']:.1f} | {ours['peak_mib']:.1f} | "
            f"{ours['peak_mib'] / ours['shard_mib']:.2f} | {before['peak_mib']:.1f} | "
            f"{before['peak_mib'] / before['shard_mib']:.2f} |"
        )
    lines += [
        "",
        f"Worst rank: peak {worst:.2f}x its shard (target <= {TARGET}x): {'met' if worst <= TARGET else 'missed'}.",
    ]
    print(json.dumps({"benchmark": "checkpoint_loading", "worst_peak_over_shard": round(worst, 3)}))
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-of"]:
        rank_main(*sys.argv[2:6])
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("checkpoint_loading", parser.parse_args(), run, report)
