"""A short request's latency on an idle rollout server vs during one /generate call of 3,000 prompts.

    .venv/bin/python bench/fair_admission.py [--batch 3000] [--requests 20] [--save]

One embedded rollout server (``areal-hpc serve``, the tiny model, ``--slots`` rows, 64 by default) on one core, the client on
the other. Baseline: ``--requests`` 8-token requests one at a time on the idle server. Then one call
carrying ``--batch`` prompts of 16 new tokens each, and while it runs the same 8-token requests one at a
time. The engine admits each call's prompts in turn with other callers' and never gives one call every
row (embedded_engine), so the ratio of the medians stays small (target <= 2x); before that, a request
waited behind every prompt of the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import aiohttp
from proxy_overhead import CLIENT_CORES, REPO, SERVER_CORES, address_of, quantile, start
from recording import machine, record_name, run_and_record

PROMPT = [5, 17, 33, 2, 9, 41, 8]


async def latencies(http: aiohttp.ClientSession, url: str, count: int) -> list[float]:
    """Seconds each of ``count`` 8-token requests takes, sent one after another."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        async with http.post(url, json=body) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()
        seconds.append(time.perf_counter() - started)
    return seconds


async def measure(address: str, batch: int, count: int) -> dict:
    url = f"http://{address}/generate"
    big = {"input_ids": [PROMPT] * batch, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await latencies(http, url, 3)  # warm-up
        idle = await latencies(http, url, count)
        started = time.perf_counter()

        async def large_call() -> float:
            async with http.post(url, json=big) as reply:
                assert reply.status == 200, await reply.text()
                await reply.read()
            return time.perf_counter() - started

        call = asyncio.create_task(large_call())
        await asyncio.sleep(1.0)  # the call is queued and decoding
        during = await latencies(http, url, count)
        still_running = not call.done()
        batch_s = await call
    return {"idle": idle, "during": during, "batch_still_running": still_running, "batch_s": batch_s}


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = scratch / "model"
        subprocess.run([sys.executable, "-m", "areal_hpc", "init-model", "--out", str(model)], cwd=REPO, check=True)
        server = start(
            [
                "serve",
                "backend=embedded",
                f"model.path={model}",
                "port=0",
                f"cluster.fileroot={scratch}",
                f"rollout.max_running_requests={args.slots}",
            ],
            scratch / "server.log",
            "embedded rollout server",
            SERVER_CORES,
        )
        try:
            os.sched_setaffinity(0, CLIENT_CORES)
            found = asyncio.run(measure(address_of(scratch / "server.log"), args.batch, args.requests))
        finally:
            server.terminate()
            server.wait(timeout=60)
    idle, during = statistics.median(found["idle"]), statistics.median(found["during"])
    return {
        "date": date.today().isoformat(),
        "machine": args.machine,
        "versions": {"python": platform.python_version(), "aiohttp": aiohttp.__version__},
        "settings": {"batch": args.batch, "requests": args.requests, "slots": args.slots},
        "idle_ms": {"p50": 1e3 * idle, "p99": 1e3 * quantile(found["idle"], 0.99)},
        "during_ms": {"p50": 1e3 * during, "p99": 1e3 * quantile(found["during"], 0.99)},
        "ratio_p50": during / idle,
        "batch_still_running": found["batch_still_running"],
        "batch_s": found["batch_s"],
    }


def report(result: dict) -> str:
    idle, during = result["idle_ms"], result["during_ms"]
    return "\n".join(
        [
            f"# fair admission ({result['date']})",
            "",
            f"machine: {result['machine']}",
            f"versions: {result['versions']}",
            f"settings: {result['settings']}",
            "",
            "| 8-token request | p50 (ms) | p99 (ms) |",
            "|---|---|---|",
            f"| idle server | {idle['p50']:.1f} | {idle['p99']:.1f} |",
            f"| during the {result['settings']['batch']:,}-prompt call | {during['p50']:.1f} | {during['p99']:.1f} |",
            "",
            f"during / idle (p50): **{result['ratio_p50']:.2f}x** (target <= 2x); the call was still running "
            f"after the last request: {result['batch_still_running']}; it took {result['batch_s']:.1f} s in all",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=3000, help="prompts in the large call")
    parser.add_argument("--requests", type=int, default=20, help="8-token requests idle and during the call")
    parser.add_argument("--slots", type=int, default=64, help="the server's rows (rollout.max_running_requests)")
    parser.add_argument("--machine", default=machine(), help="how the result names this machine")
    parser.add_argument("--label", default="", help="a name for this setting in the record's name")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    run_and_record(record_name("fair_admission", args.label), args, run, report)
