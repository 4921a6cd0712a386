"""Embedded engine (continuous batching) vs transformers ``generate()`` (padded static batches).

    .venv/bin/python bench/rollout_engine.py [--requests 128] [--batch 32] [--preset small] [--save]

Same model, same prompts, the same long-tailed output lengths (each request asks for its own
``max_new_tokens`` and ignores EOS). The engine keeps ``--batch`` sequences running and refills a
slot as soon as one finishes; the baseline runs the requests in batches of ``--batch`` in arrival
order, left-padded, each batch until its longest request is done. Throughput counts only the
tokens requests asked for. Repeats alternate the two; medians (the ratio: median of per-repeat ratios).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import transformers

from recording import machine, run_and_record

from areal_hpc.models.hf import load_model
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.rollout.embedded_engine import EmbeddedEngine, Request, SamplingParams



def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts of 8-32 tokens, lengths log-normal in [8, 512]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=3.8, sigma=0.9, size=n), 8, 512).astype(int)
    return [(rng.integers(0, vocab, int(rng.integers(8, 33))).tolist(), int(k)) for k in lengths]


def run_engine(model, requests, batch: int) -> float:
    engine = EmbeddedEngine(model, slots=batch, context_length=1024)
    done, lock, finished = threading.Event(), threading.Lock(), []

    def on_done(result):
        with lock:
            finished.append(result)
            if len(finished) == len(requests):
                done.set()

    start = time.perf_counter()
    for i, (prompt, length) in enumerate(requests):
        engine.submit(Request(str(i), prompt, SamplingParams(max_new_tokens=length, ignore_eos=True), on_done))
    done.wait()
    elapsed = time.perf_counter() - start
    engine.stop()
    assert sum(len(r.output_ids) for r in finished) == sum(k for _, k in requests)
    return elapsed


def run_generate(model, requests, batch: int, pad_id: int) -> float:
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        chunk = requests[first:first + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(k for _, k in chunk),
                           min_new_tokens=max(k for _, k in chunk), do_sample=True, pad_token_id=pad_id)
    return time.perf_counter() - start


def run(args) -> dict:
    model_dir = init_model(Path(tempfile.mkdtemp()) / "model", corpus_for_tokenizer(0), preset=args.preset, seed=0)
    model = load_model(model_dir).eval()
    requests = workload(args.requests, model.config.vocab_size)
    useful = sum(k for _, k in requests)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    times = {"engine": [], "generate": []}
    for _ in range(args.repeats):
        times["engine"].append(run_engine(model, requests, args.batch))
        times["generate"].append(run_generate(model, requests, args.batch, model.config.pad_token_id))
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"benchmark": "rollout_engine", "date": date.today().isoformat(), "machine": machine(),
            "model": f"{args.preset} Qwen2 ({count_parameters(model) / 1e6:.2f}M parameters), float32, CPU",
            "requests": len(requests), "batch": args.batch, "useful_tokens": useful,
            "lengths": {"min": min(k for _, k in requests), "median": int(np.median([k for _, k in requests])),
                        "max": max(k for _, k in requests)},
            "repeats": args.repeats, "threads": torch.get_num_threads(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "engine tokens/s": round(useful / median["engine"], 1),
            "generate tokens/s": round(useful / median["generate"], 1),
            "ratio": round(statistics.median(g / e for g, e in zip(times["generate"], times["engine"])), 2)}



def report(r: dict) -> str:
    return "\n".join([
        f"# Embedded engine vs transformers generate() ({r['date']})", "",
        f"Machine: {r['machine']}, {r['threads']} torch threads. Versions: "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".",
        f"Model: {r['model']}. {r['requests']} requests, batch {r['batch']}, output lengths {r['lengths']['min']}-"
        f"{r['lengths']['max']} (median {r['lengths']['median']}), {r['useful_tokens']:,} requested tokens; "
        f"median of {r['repeats']} alternating repeats.", "",
        "| | tokens/s |", "|---|---|",
        f"| embedded engine (continuous batching) | {r['engine tokens/s']} |",
        f"| transformers generate() (static batches) | {r['generate tokens/s']} |",
        f"| **ratio** | **{r['ratio']}x** |", "", "Target: >= 2x."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("rollout_engine", parser.parse_args(), run, report)

if __name__ == "__main__":
    main()
