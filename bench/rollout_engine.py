"""Embedded engine (continuous batching) vs transformers ``generate()`` (padded static batches).

    .venv/bin/python bench/rollout_engine.py [--requests 128] [--batch 32] [--sweep 1,8,32,64] [--save]

Main comparison: same model, same prompts, the same long-tailed output lengths (each request asks for
its own ``max_new_tokens`` and ignores EOS), both sampling at temperature 1 with top-k 50 (``generate()``'s
default). The engine keeps ``--batch`` sequences running and refills a slot as soon as one finishes;
the baseline runs the requests in batches of ``--batch`` in arrival order, left-padded, each batch until
its longest request is done. Throughput counts only the tokens requests asked for. Repeats alternate
the two; medians (the ratio: median of per-repeat ratios).

Decode sweep: at each batch size b, b prompts of 16 tokens generate L = ``--sweep-tokens`` tokens each;
decode tokens/s = b (L - 1) / (t(L) - t(1)), which leaves the prefill out for both.

Profile: torch.profiler on the engine's thread over one run of the main workload: self time by op, and
the time outside torch ops (Python: scheduling, bookkeeping). Load averages are recorded: on a shared
machine, a second busy process slows two-thread runs far more than its share.

Another revision of the engine (before a change) runs the same script with PYTHONPATH pointing at it;
``--json`` writes its result and ``--before`` puts a saved result beside this run's:

    git archive REV areal_hpc | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before .venv/bin/python bench/rollout_engine.py --revision REV --json /tmp/before.json
    .venv/bin/python bench/rollout_engine.py --before /tmp/before.json --save
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import transformers
from recording import machine, run_and_record
from torch.profiler import ProfilerActivity, profile

from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.models.hf import load_model
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, SamplingParams

TOP_K = 50  # generate()'s default; the engine is asked for the same
SWEEP_PROMPT = 16


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts of 8-32 tokens, lengths log-normal in [8, 512]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=3.8, sigma=0.9, size=n), 8, 512).astype(int)
    return [(rng.integers(0, vocab, int(rng.integers(8, 33))).tolist(), int(k)) for k in lengths]


def serve(engine: EmbeddedGenerator, requests) -> float:
    """Submit every request at once; seconds until the last one is answered."""
    done, lock, finished = threading.Event(), threading.Lock(), []

    def on_done(result):
        with lock:
            finished.append(result)
            if len(finished) == len(requests):
                done.set()

    start = time.perf_counter()
    for i, (prompt, length) in enumerate(requests):
        engine.submit(
            Request(str(i), prompt, SamplingParams(max_new_tokens=length, top_k=TOP_K, ignore_eos=True), on_done)
        )
    done.wait()
    elapsed = time.perf_counter() - start
    assert sum(len(r.output_ids) for r in finished) == sum(k for _, k in requests)
    return elapsed


def run_engine(model, requests, batch: int) -> float:
    engine = EmbeddedGenerator(model, slots=batch, context_length=1024)
    try:
        return serve(engine, requests)
    finally:
        engine.stop()


def run_generate(model, requests, batch: int) -> float:
    pad_id = model.config.pad_token_id
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        chunk = requests[first : first + batch]
        width, longest = max(len(p) for p, _ in chunk), max(k for _, k in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                top_k=TOP_K,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def decode_rates(model, batch: int, tokens: int, repeats: int) -> dict:
    """Decode tokens/s of the engine and generate() at ``batch`` rows (prefill excluded by differencing)."""
    prompts = [p[:SWEEP_PROMPT] for p, _ in workload(batch, model.config.vocab_size, seed=batch)]
    prompts = [p + [1] * (SWEEP_PROMPT - len(p)) for p in prompts]
    times = {"engine": [], "generate": []}
    for _ in range(repeats):  # an engine per repeat: none is alive while generate() runs, as in the main comparison
        engine = EmbeddedGenerator(model, slots=batch, context_length=1024)
        try:
            times["engine"].append(
                serve(engine, [(p, tokens) for p in prompts]) - serve(engine, [(p, 1) for p in prompts])
            )
        finally:
            engine.stop()
        times["generate"].append(
            run_generate(model, [(p, tokens) for p in prompts], batch)
            - run_generate(model, [(p, 1) for p in prompts], batch)
        )
    rates = {k: round(batch * (tokens - 1) / statistics.median(v), 1) for k, v in times.items()}
    return {"batch": batch, **rates, "ratio": round(rates["engine"] / rates["generate"], 2)}


def profile_engine(model, requests, batch: int, top: int = 10) -> dict:
    """Self time of torch ops on the engine's thread over one run (the profiler starts and stops there)."""
    engine = EmbeddedGenerator(model, slots=batch, context_length=1024)
    try:  # the profiler is made and started on the engine's thread: it records the thread it starts on
        profiler = engine.call(lambda: profile(activities=[ProfilerActivity.CPU]).__enter__()).result()
        wall = serve(engine, requests)
        engine.call(profiler.stop).result()
    finally:
        engine.stop()
    ops = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    in_ops = sum(e.self_cpu_time_total for e in ops) / 1e6
    rows = [{"op": e.key, "calls": e.count, "s": round(e.self_cpu_time_total / 1e6, 3)} for e in ops[:top]]
    rows.append(
        {
            "op": "other torch ops",
            "calls": sum(e.count for e in ops[top:]),
            "s": round(sum(e.self_cpu_time_total for e in ops[top:]) / 1e6, 3),
        }
    )
    rows.append({"op": "outside torch ops (Python)", "calls": None, "s": round(wall - in_ops, 3)})
    for row in rows:
        row["share"] = round(row["s"] / wall, 3)
    return {"wall_s": round(wall, 3), "ops": rows}


def git_revision() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    return out.stdout.strip() or "unknown"


def run(args) -> dict:
    model_dir = init_model(Path(tempfile.mkdtemp()) / "model", corpus_for_tokenizer(0), preset=args.preset, seed=0)
    model = load_model(model_dir).eval()
    requests = workload(args.requests, model.config.vocab_size)
    useful = sum(k for _, k in requests)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    load_before = os.getloadavg()
    run_engine(model, requests[: args.batch], args.batch)  # warm-up: first-call allocations, kernel selection
    run_generate(model, requests[: args.batch], args.batch)
    times = {"engine": [], "generate": []}
    for _ in range(args.repeats):
        times["engine"].append(run_engine(model, requests, args.batch))
        times["generate"].append(run_generate(model, requests, args.batch))
    median = {k: statistics.median(v) for k, v in times.items()}
    sweep = [decode_rates(model, b, args.sweep_tokens, args.repeats) for b in args.sweep]
    result = {
        "benchmark": "rollout_engine",
        "date": date.today().isoformat(),
        "machine": machine(),
        "revision": args.revision or git_revision(),
        "model": f"{args.preset} Qwen2 ({count_parameters(model) / 1e6:.2f}M parameters), float32, CPU",
        "requests": len(requests),
        "batch": args.batch,
        "useful_tokens": useful,
        "top_k": TOP_K,
        "lengths": {
            "min": min(k for _, k in requests),
            "median": int(np.median([k for _, k in requests])),
            "max": max(k for _, k in requests),
        },
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "engine tokens/s": round(useful / median["engine"], 1),
        "generate tokens/s": round(useful / median["generate"], 1),
        "ratio": round(statistics.median(g / e for g, e in zip(times["generate"], times["engine"])), 2),
        "sweep": {"prompt_tokens": SWEEP_PROMPT, "new_tokens": args.sweep_tokens, "rows": sweep},
        "profile": profile_engine(model, requests, args.batch) if args.profile else None,
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
    }
    if args.before:
        result["before"] = json.loads(Path(args.before).read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(r: dict) -> str:
    before = r.get("before")
    then = f"before ({before['revision']})" if before else None
    lines = [
        f"# Embedded engine vs transformers generate() ({r['date']})",
        "",
        f"Machine: {r['machine']}, {r['threads']} torch threads; load average (1/5/15 min) "
        f"{'/'.join(map(str, r['load_average']['before']))} before, "
        f"{'/'.join(map(str, r['load_average']['after']))} after. Versions: "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items())
        + f". Revision {r['revision']}.",
        f"Model: {r['model']}. {r['requests']} requests, batch {r['batch']}, output lengths {r['lengths']['min']}-"
        f"{r['lengths']['max']} (median {r['lengths']['median']}), {r['useful_tokens']:,} requested tokens, "
        f"temperature 1 and top-k {r['top_k']} for both; median of {r['repeats']} alternating repeats.",
        "",
    ]
    head = "| | tokens/s |" + (f" {then} |" if before else "")
    lines += [head, "|---|---|" + ("---|" if before else "")]
    for name, key in (
        ("embedded engine (continuous batching)", "engine tokens/s"),
        ("transformers generate() (static batches)", "generate tokens/s"),
    ):
        lines.append(f"| {name} | {r[key]} |" + (f" {before[key]} |" if before else ""))
    lines.append(f"| **ratio** | **{r['ratio']}x** |" + (f" {before['ratio']}x |" if before else ""))
    sweep = r["sweep"]
    lines += [
        "",
        f"Decode tokens/s by batch size ({sweep['prompt_tokens']}-token prompts, {sweep['new_tokens']} new "
        "tokens each, prefill excluded), same run:",
        "",
        "| batch | engine | generate() | ratio |" + (f" engine {then} | ratio {then} |" if before else ""),
        "|---|---|---|---|" + ("---|---|" if before else ""),
    ]
    old = {row["batch"]: row for row in before["sweep"]["rows"]} if before else {}
    for row in sweep["rows"]:
        was = old.get(row["batch"])
        lines.append(
            f"| {row['batch']} | {row['engine']} | {row['generate']} | {row['ratio']}x |"
            + ((f" {was['engine']} | {was['ratio']}x |" if was else " | |") if before else "")
        )
    for title, result in (("Where the engine's time goes", r), (f"Where the engine's time went, {then}", before)):
        if result and result.get("profile"):
            prof = result["profile"]
            lines += [
                "",
                f"{title} (torch.profiler on the engine thread, one run of the main workload, {prof['wall_s']} s):",
                "",
                "| op | calls | s | share |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {o['op']} | {o['calls'] if o['calls'] is not None else ''} | {o['s']} | {o['share']:.0%} |"
                for o in prof["ops"]
            ]
    lines += ["", "Target: >= 3x."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--sweep",
        type=lambda s: [int(b) for b in s.split(",") if b],
        default=[1, 8, 32, 64],
        help="batch sizes for decode tokens/s, comma-separated (empty: none)",
    )
    parser.add_argument("--sweep-tokens", type=int, default=64, help="new tokens per request in the sweep")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the torch.profiler run")
    parser.add_argument("--revision", help="the engine's revision, as recorded (default: this checkout's HEAD)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--before", help="a result written by --json (another revision) to show beside this one")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("rollout_engine", parser.parse_args(), run, report)


if __name__ == "__main__":
    main()
