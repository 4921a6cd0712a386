"""What the login-node proxy adds: the same chat requests sent straight to a rollout server's
``/generate`` (the token ids the proxy would send) and through the proxy's ``/v1/chat/completions``.

    .venv/bin/python bench/proxy_overhead.py [--requests 400] [--concurrency 16] [--max-tokens 4] [--save]

One embedded rollout server (``areal-hpc serve``, a tiny model) and one proxy (``areal-hpc proxy``), each
its own process, on loopback. Latency: requests one at a time, direct and proxied alternating, p50/p99
of each and of the difference (the proxy's added latency). Throughput: ``--concurrency`` requests in
flight for ``--requests`` requests per side, sides alternating over ``--repeats`` rounds, medians. The
proxy's requests are turns of sessions opened beforehand (8 turns each, ended at the end: their
records are written to shards during the run). Short replies make the proxy's share as large as it gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from recording import machine, run_and_record

REPO = Path(__file__).resolve().parent.parent
# The server on one core, the proxy and the load generator on the other: the proxy's CPU comes out of
# the client's share, never the server's (on a login node it has the machine to itself).
SERVER_CORES, CLIENT_CORES = {0}, {1}
MESSAGES = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]


def start(args: list[str], log: Path, ready: str, cores: set[int]) -> subprocess.Popen:
    """``areal-hpc ARGS`` on ``cores`` (one torch thread per core), once its log says ``ready``."""
    out = open(log, "w")  # noqa: SIM115 - the server writes it for its lifetime
    process = subprocess.Popen(
        [sys.executable, "-m", "areal_hpc", *args],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(len(cores))},
    )
    deadline = time.monotonic() + 180
    while ready not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{args[0]} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return process


def address_of(log: Path) -> str:
    return log.read_text().split("http://", 1)[1].split()[0].removesuffix("/v1")


async def one(http: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> float:
    started = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as reply:
        await reply.read()
        assert reply.status == 200, await reply.text()
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(args, server: str, proxy: str, tenant_key: str, prompt_ids: list[int], proxy_pid: int) -> dict:
    direct = (
        f"http://{server}/generate",
        {
            "input_ids": prompt_ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 1.0, "stop_token_ids": [2]},
        },
        {},
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        n_sessions = (2 * args.requests * args.repeats + args.latency_requests) // 8 + 2 * args.concurrency
        keys = []
        for _ in range(n_sessions):
            async with http.post(
                f"http://{proxy}/rl/start_session", json={}, headers={"Authorization": f"Bearer {tenant_key}"}
            ) as reply:
                keys.append((await reply.json())["session_key"])
        turns = iter([k for k in keys for _ in range(8)])

        def proxied():
            return (
                f"http://{proxy}/v1/chat/completions",
                {"model": "tiny", "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 1.0},
                {"Authorization": f"Bearer {next(turns)}"},
            )

        for _ in range(20):  # warm both paths
            await one(http, *direct)
            await one(http, *proxied())
        pairs = []
        for _ in range(args.latency_requests):
            pairs.append((await one(http, *direct), await one(http, *proxied())))

        async def throughput(make) -> float:
            queue = iter(range(args.requests))

            async def worker():
                for _ in queue:
                    await one(http, *make())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return args.requests / (time.perf_counter() - started)

        rates, proxy_cpu = {"direct": [], "proxy": []}, 0.0
        for _ in range(args.repeats):
            rates["direct"].append(await throughput(lambda: direct))
            before = cpu_seconds(proxy_pid)
            rates["proxy"].append(await throughput(proxied))
            proxy_cpu += cpu_seconds(proxy_pid) - before
        ended = time.perf_counter()
        for key in keys:
            async with http.post(
                f"http://{proxy}/rl/end_session", json={}, headers={"Authorization": f"Bearer {key}"}
            ) as reply:
                assert reply.status == 200
        end_s = time.perf_counter() - ended
    return {
        "pairs": pairs,
        "rates": rates,
        "sessions": len(keys),
        "end_sessions_s": end_s,
        "proxy_cpu_ms_per_request": 1e3 * proxy_cpu / (args.requests * args.repeats),
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args) -> dict:
    from areal_hpc.proxy.chat_template import ChatTokenizer
    from areal_hpc.proxy.tenants import add_key

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = scratch / "model"
        subprocess.run(
            [sys.executable, "-m", "areal_hpc", "init-model", "--out", str(model)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        key = add_key(scratch / "keys.yaml", "bench")
        server = start(
            ["serve", "backend=embedded", f"model.path={model}", "port=0", f"cluster.fileroot={scratch}"],
            scratch / "server.log",
            "embedded rollout server",
            SERVER_CORES,
        )
        try:
            server_address = address_of(scratch / "server.log")
            proxy = start(
                [
                    "proxy",
                    f"model.path={model}",
                    "proxy.port=0",
                    f"proxy.backends={server_address}",
                    f"proxy.keys_file={scratch / 'keys.yaml'}",
                    "proxy.model_name=tiny",
                    "proxy.requests_per_minute=0",
                    "proxy.tokens_per_minute=0",
                    f"cluster.fileroot={scratch}",
                ],
                scratch / "proxy.log",
                "proxy for",
                CLIENT_CORES,
            )
            try:
                tokenizer = ChatTokenizer(model)
                prompt_ids = tokenizer.encode(tokenizer.render(MESSAGES))
                os.sched_setaffinity(0, CLIENT_CORES)
                load_before = os.getloadavg()[0]
                found = asyncio.run(
                    measure(args, server_address, address_of(scratch / "proxy.log"), key, prompt_ids, proxy.pid)
                )
                load_after = os.getloadavg()[0]
                rss_kb = int(
                    next(
                        line
                        for line in Path(f"/proc/{proxy.pid}/status").read_text().splitlines()
                        if line.startswith("VmHWM")
                    ).split()[1]
                )
            finally:
                proxy.terminate()
                proxy.wait(timeout=60)
        finally:
            server.terminate()
            server.wait(timeout=60)
    direct, proxied = [d for d, _ in found["pairs"]], [p for _, p in found["pairs"]]
    added = [p - d for d, p in found["pairs"]]
    rates = {side: statistics.median(values) for side, values in found["rates"].items()}
    return {
        "date": date.today().isoformat(),
        "machine": args.machine,
        "versions": {"python": platform.python_version(), "aiohttp": aiohttp.__version__},
        "settings": {
            "latency_requests": args.latency_requests,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "prompt_tokens": len(prompt_ids),
        },
        "latency_ms": {
            name: {"p50": 1e3 * quantile(v, 0.5), "p99": 1e3 * quantile(v, 0.99)}
            for name, v in (("direct", direct), ("proxy", proxied), ("added", added))
        },
        "requests_per_s": rates,
        "throughput_ratio": rates["proxy"] / rates["direct"],
        "all_rates": found["rates"],
        "proxy_peak_rss_mib": rss_kb / 1024,
        "sessions": found["sessions"],
        "end_sessions_s": found["end_sessions_s"],
        "load_average": [load_before, load_after],
        "proxy_cpu_ms_per_request": found["proxy_cpu_ms_per_request"],
    }


def report(result: dict) -> str:
    lat, s = result["latency_ms"], result["settings"]
    lines = [
        f"# proxy overhead ({result['date']})",
        "",
        f"machine: {result['machine']}",
        f"versions: {result['versions']}",
        f"settings: {s}; 1-minute load average before/after: "
        f"{result['load_average'][0]:.2f} / {result['load_average'][1]:.2f}",
        "",
        "| | p50 (ms) | p99 (ms) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {lat[name]['p50']:.2f} | {lat[name]['p99']:.2f} |" for name in ("direct", "proxy", "added")]
    rates = result["requests_per_s"]
    lines += [
        "",
        f"throughput at concurrency {s['concurrency']}: direct {rates['direct']:.0f} req/s, proxy "
        f"{rates['proxy']:.0f} req/s: **{result['throughput_ratio']:.2f}x** (target >= 0.8x; p50 added "
        f"latency target < 2 ms: **{lat['added']['p50']:.2f} ms**)",
        f"proxy CPU per request {result['proxy_cpu_ms_per_request']:.2f} ms (one core: about "
        f"{1e3 / result['proxy_cpu_ms_per_request']:.0f} requests/s); "
        f"proxy peak RSS {result['proxy_peak_rss_mib']:.0f} MiB; {result['sessions']} sessions ended "
        f"(records written) in {result['end_sessions_s']:.2f} s",
        "",
        json.dumps(result["all_rates"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--requests", type=int, default=400, help="requests per side per throughput round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default=machine(), help="how the result names this machine")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("proxy_overhead", parser.parse_args(), run, report)
