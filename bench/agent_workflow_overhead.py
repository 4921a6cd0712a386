"""What the agent workflow layer costs, and what multi-turn costs against single-turn with and without the
rollout server's prefix cache: the same multi-turn episodes issued straight to the rollout client and
through the workflow layer (token level and chat level), and single-turn episodes of the same generated
tokens; then a long episode's prefill tokens with and without the cache.

    .venv/bin/python bench/agent_workflow_overhead.py [--turns 4] [--max-new-tokens 16] [--groups 16]
        [--n-samples 4] [--repeats 5] [--servers on,off] [--long-turns 20] [--out results.md]

One embedded rollout server per ``--servers`` setting (``areal-hpc serve``, the tiny model, its own process
on core 0, one torch thread; "on" with ``rollout.prefix_cache_mb``'s default, "off" with 0, the baseline;
"on-gathered" and "off-gathered" the same with ``rollout.gather_ms=5``: the turns returning from one batch
gathered into one prefill instead of admitted as they arrive);
the episodes run in this process on core 1 (their reward worker too). Each round runs every variant once
on each server (``--groups`` x ``--n-samples`` episodes in flight at once), servers and variants
interleaved over ``--repeats`` rounds after one warm-up round; medians. Variants, each episode
``--turns`` turns of ``--max-new-tokens`` tokens at temperature 1 with a fixed environment message
(``--message``) between turns:

- A  direct: ``RolloutClient.generate`` in a plain loop (output ids + ``next_turn_ids`` of the
     message appended), no workflow layer, no reward; its records are made in the conversion step;
- B  token workflow: a ``MultiTurnMathWorkflow``-shaped workflow (``engine.episode``, ``generate``,
     ``engine.reward`` every turn, ``observe_message``), always ``--turns`` turns, through
     ``EpisodeGroups`` with ``EpisodeContext`` settings and a ``RewardPool`` of the task's reward;
- B0 the same without the reward calls (the layer alone);
- C  chat workflow: the same turns through ``engine.openai_client()`` (the real ``openai`` client, the
     in-process ``ChatGateway``), a reward every turn;
- D  single turn: ``RLVRWorkflow`` through the same layer, ``turns x max-new-tokens`` new tokens per
     episode (what a single-turn workflow pays for the same generated tokens); D0 the same generate
     straight on the client;
- E  single turn on the same tokens: D0 with the environment's tokens of a multi-turn episode in its
     prompt (the prompt, then ``turns - 1`` messages as ``next_turn_ids`` writes them after an answer),
     ``turns x max-new-tokens`` new tokens: it prefills what A's episode prefills and generates what A's
     generates, in one turn. Each episode's first message token is drawn from the vocabulary without
     replacement over the run (cycling after as many episodes as the vocabulary has tokens), so its
     environment tokens are its own, as a multi-turn episode's are (they follow its own answers): neither
     the prefix cache nor the prefill's running a group's shared prompt once hands them over.

"trained tokens" are the loss-masked (generated) tokens; record->batch is ``build_batch`` of the
variant's records (for A, D0 and E the ``Trajectory`` objects are made there too), the least of three
builds. CPU seconds of this process, the reward worker and the server (from /proc) are taken per run:
where other processes share the cores, client CPU per turn is the steadier measure of what the layer
costs. Multi-turn's cost against single-turn's is E's generated tokens/s over A's (the same tokens:
prompt, environment tokens and generated tokens) and, with no environment tokens in the single turn (the
same generated tokens only), D0's over A's and D's over B's: the median of the rounds' ratios, per
server; and the server's CPU per generated token, multi over single, the steadier number where other
processes share the cores. The long episodes (``--long-episodes`` of ``--long-turns`` turns of
``--long-new-tokens`` tokens, on the plain client loop) count the prompt tokens each server prefilled and
took from its cache (``/get_model_info``). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SERVER_CORES, CLIENT_CORES = {0}, {1}
FEEDBACK = "That is not correct. Try again and give only the final answer."
VARIANTS = ["A", "B", "B0", "C", "D", "D0", "E"]
SERVERS = {  # --servers setting: the server's overrides, its title
    "on": ([], "prefix cache on, turns admitted as they arrive"),
    "off": (["rollout.prefix_cache_mb=0"], "prefix cache off, turns admitted as they arrive"),
    "on-gathered": (["rollout.gather_ms=5"], "prefix cache on, returning turns gathered (gather_ms=5)"),
    "off-gathered": (
        ["rollout.prefix_cache_mb=0", "rollout.gather_ms=5"],
        "prefix cache off, returning turns gathered (gather_ms=5)",
    ),
}
# (multi-turn, single-turn): E on the same tokens, D0 and D on the same generated tokens (no environment tokens)
MULTI_SINGLE = [("A", "E"), ("A", "D0"), ("B", "D")]
NAMES = {
    "A": "A direct client loop (k turns)",
    "B": "B token workflow + reward/turn",
    "B0": "B0 token workflow, no reward",
    "C": "C chat workflow (openai) + reward/turn",
    "D": "D single-turn workflow (k*M tokens)",
    "D0": "D0 single generate on the client",
    "E": "E single generate, prompt + the environment's tokens",
}


def start_server(model: Path, fileroot: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    """``areal-hpc serve`` (embedded) on core 0, once it has registered in name-resolve."""
    from areal_hpc.runtime.name_resolve import ROLLOUT_SERVERS, NameResolve

    trial = uuid.uuid4().hex[:8]
    names = NameResolve(fileroot / "quickstart" / trial / "name_resolve")
    names.root.mkdir(parents=True)
    log = open(names.root.parent / "server.log", "w")  # noqa: SIM115 - the server writes it for its lifetime
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_hpc",
            "serve",
            "backend=embedded",
            f"model.path={model}",
            "port=0",
            f"cluster.fileroot={fileroot}",
            f"experiment.trial={trial}",
            *overrides,
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, SERVER_CORES),
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 180
    while not names.values(ROLLOUT_SERVERS):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not register: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.1)
    return process, names.values(ROLLOUT_SERVERS)[0]


class TokenTurns:
    """``MultiTurnMathWorkflow`` without its early stop: exactly ``turns`` turns, each scored."""

    def __init__(self, turns: int, message: str, score: bool = True):
        self.turns, self.message, self.score = turns, message, score

    async def arun_episode(self, engine, example):
        episode = engine.episode(example)
        for turn in range(self.turns):
            generation = await episode.generate()
            if self.score:
                value = await engine.reward(
                    example,
                    engine.decode(generation.output_ids),
                    generation.output_ids,
                    prompt_ids=episode.context[: -len(generation.output_ids) or None],
                )
                episode.reward(value)
            if turn < self.turns - 1:
                episode.observe_message(self.message)
        return [episode.trajectory()]


class ChatTurns:
    """The same turns as an ``openai`` agent: messages in, text out, the reward set on each turn."""

    def __init__(self, turns: int, message: str, max_tokens: int, temperature: float):
        self.turns, self.message, self.max_tokens, self.temperature = turns, message, max_tokens, temperature

    async def arun_episode(self, engine, example):
        client = engine.openai_client()
        messages = [{"role": "user", "content": example.prompt}]
        for turn in range(self.turns):
            reply = await client.chat.completions.create(
                model=engine.model_name, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature
            )
            content = reply.choices[0].message.content or ""
            client.set_reward(await engine.reward(example, content))
            messages.append({"role": "assistant", "content": content})
            if turn < self.turns - 1:
                messages.append({"role": "user", "content": self.message})
        return None


async def direct_episode(
    client, tokenizer, prompt_ids: list[int], turns: int, message: str, params: dict
) -> list[tuple]:
    """A: the turns on the client alone; (input ids, generation) per turn."""
    from areal_hpc.models.chat import next_turn_ids

    context, pending, out = list(prompt_ids), list(prompt_ids), []
    for turn in range(turns):
        generation = await client.generate(context, params)
        out.append((pending, generation))
        context += generation.output_ids
        pending = []
        if turn < turns - 1:
            pending = next_turn_ids(tokenizer, "user", message, generation.output_ids)
            context += pending
    return out


def environment_tokens(ctx: dict) -> list[int]:
    """E's environment tokens for one episode: the ``turns - 1`` messages a multi-turn episode receives (after
    answers cut at the token limit, as most are), the first token replaced by the run's next fresh token."""
    from areal_hpc.models.chat import next_turn_ids

    args = ctx["args"]
    message = next_turn_ids(ctx["tokenizer"], "user", args.message, [-1]) * (args.turns - 1)
    return [next(ctx["fresh_tokens"]), *message[1:]] if message else []


def direct_records(episodes: list[tuple[str, list[tuple]]]):
    from areal_hpc.data.trajectory import Segment, Trajectory

    return [
        Trajectory([Segment(ids, g.output_ids, g.logprobs, g.versions) for ids, g in turns], group_id=group)
        for group, turns in episodes
    ]


async def server_counts(ctx: dict) -> dict:
    """The server's forward passes and prompt tokens prefilled and cached so far."""
    info = await ctx["client"].model_info(ctx["address"])
    return {k: info[k] for k in ("forward_passes", "prompt_tokens_prefilled", "prompt_tokens_cached")}


async def one_run(variant: str, ctx: dict) -> dict:
    """One variant over every group at once: wall time, records (or what makes them), token counts."""
    from areal_hpc.agents.groups import EpisodeGroups

    args, client, examples = ctx["args"], ctx["client"], ctx["examples"]
    params = ctx["sampling"].params([ctx["tokenizer"].eos_token_id])
    counts_before = await server_counts(ctx)
    cpu_before = time.process_time(), cpu_seconds(ctx["server_pid"]), reward_cpu(ctx["pool"])
    started = time.perf_counter()
    if variant in ("A", "D0", "E"):
        turns = args.turns if variant == "A" else 1
        if variant != "A":
            params = {**params, "max_new_tokens": args.turns * args.max_new_tokens}

        async def group(example):
            prompt = ctx["prompt_ids"][example.uid]
            prompts = [prompt + environment_tokens(ctx) if variant == "E" else prompt for _ in range(args.n_samples)]
            return [
                (example.uid, turns_)
                for turns_ in await asyncio.gather(
                    *(direct_episode(client, ctx["tokenizer"], p, turns, args.message, params) for p in prompts)
                )
            ]

        raw = [e for g in await asyncio.gather(*(group(ex) for ex in examples)) for e in g]
        wall = time.perf_counter() - started
        converted = time.perf_counter()
        records = direct_records(raw)
    else:
        workflow = {
            "B": TokenTurns(args.turns, args.message),
            "B0": TokenTurns(args.turns, args.message, score=False),
            "C": ChatTurns(args.turns, args.message, args.max_new_tokens, args.temperature),
            "D": ctx["rlvr"],
        }[variant]
        settings = ctx["settings_D"] if variant == "D" else ctx["settings"]
        groups = EpisodeGroups(workflow, lambda _: settings, args.n_samples, "arithmetic")
        records = [r for g in await asyncio.gather(*(groups.run(client, ex) for ex in examples)) for r in g]
        wall = time.perf_counter() - started
        converted = time.perf_counter()
    cpu = (
        time.process_time() - cpu_before[0],
        cpu_seconds(ctx["server_pid"]) - cpu_before[1],
        reward_cpu(ctx["pool"]) - cpu_before[2],
    )
    records_s = time.perf_counter() - converted  # A, D0: their Trajectory objects are made here
    counts_after = await server_counts(ctx)
    batch_s = []
    for _ in range(3):  # the least of three builds of the batch from the same records (this box is noisy)
        again = time.perf_counter()
        batch = build(records, ctx)
        batch_s.append(time.perf_counter() - again)
    convert_s = records_s + min(batch_s)
    trained = sum(map(sum, batch.loss_masks))
    return {
        "wall_s": wall,
        "convert_s": convert_s,
        "episodes": len(records),
        "turns": sum(len(r.segments) for r in records),
        "generated": sum(r.n_output_tokens for r in records),
        "tokens": sum(r.n_tokens for r in records),
        "trained": trained,
        "client_cpu_s": cpu[0],
        "server_cpu_s": cpu[1],
        "reward_cpu_s": cpu[2],
        **{k: counts_after[k] - counts_before[k] for k in counts_before},
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reward_cpu(pool) -> float:
    """CPU time of the reward pool's worker processes so far (0 before it started)."""
    workers = getattr(pool._pool, "_pool", None) or []
    return sum(cpu_seconds(w.pid) for w in workers)


def build(records, ctx):
    from areal_hpc.config import ActorConfig
    from areal_hpc.train.trajectory_batch import build_batch

    return build_batch(records, ActorConfig(), ctx["args"].turns * ctx["args"].max_new_tokens, ctx["args"].temperature)


async def measure(args, servers: dict[str, tuple[str, int]], model: Path) -> tuple[dict, dict]:
    """Every variant's runs on each server (``{setting: {variant: [run, ...]}}``), and each server's long episodes."""
    from dataclasses import replace

    from areal_hpc.agents.chat import ChatGateway
    from areal_hpc.agents.engine import EpisodeSettings, Sampling, Scorer
    from areal_hpc.agents.rlvr import RLVRWorkflow
    from areal_hpc.config import DatasetConfig
    from areal_hpc.data.registry import build_task
    from areal_hpc.data.rewards import RewardPool
    from areal_hpc.models.chat import example_prompt_ids
    from areal_hpc.models.hf import load_tokenizer
    from areal_hpc.rollout.client import RolloutClient

    task = build_task(DatasetConfig(task="arithmetic", seed=0, train_size=args.groups, eval_size=1))
    examples = task.train[: args.groups]
    tokenizer = load_tokenizer(model)
    sampling = Sampling(args.max_new_tokens, temperature=args.temperature)
    runs: dict[str, dict[str, list[dict]]] = {setting: {v: [] for v in args.variants} for setting in servers}
    with RewardPool(task.reward) as pool:
        async with contextlib.AsyncExitStack() as stack:
            contexts = {}
            for setting, (address, pid) in servers.items():
                client = await stack.enter_async_context(
                    RolloutClient([address], max_requests=4 * args.groups * args.n_samples)
                )
                chat = await stack.enter_async_context(
                    ChatGateway(client.generate, model, default_max_tokens=args.max_new_tokens)
                )
                settings = EpisodeSettings(client.generate, tokenizer, sampling, Scorer(pool), chat)
                contexts[setting] = {
                    "args": args,
                    "client": client,
                    "address": address,
                    "examples": examples,
                    "tokenizer": tokenizer,
                    "sampling": sampling,
                    "prompt_ids": {ex.uid: example_prompt_ids(tokenizer, ex) for ex in examples},
                    "settings": settings,
                    "rlvr": RLVRWorkflow(),
                    "fresh_tokens": itertools.cycle(
                        random.Random(setting).sample(range(len(tokenizer)), len(tokenizer))
                    ),
                    "server_pid": pid,
                    "pool": pool,
                    "settings_D": replace(
                        settings, sampling=replace(sampling, max_new_tokens=args.turns * args.max_new_tokens)
                    ),
                }
            for ctx in contexts.values():  # warm-up: connections, reward worker, template caches
                for variant in args.variants:
                    await one_run(variant, ctx)
            for _ in range(args.repeats):
                for setting, ctx in contexts.items():
                    for variant in args.variants:
                        runs[setting][variant].append(await one_run(variant, ctx))
                        shown = {
                            k: round(v, 4) if isinstance(v, float) else v for k, v in runs[setting][variant][-1].items()
                        }
                        print(setting, variant, shown, flush=True)
            long = {setting: await long_episodes(ctx) for setting, ctx in contexts.items()}
    return runs, long


async def long_episodes(ctx: dict) -> dict:
    """``--long-episodes`` episodes of ``--long-turns`` turns at once on the plain client loop: the prompt
    tokens the server prefilled and took from its cache for them, per episode, and the wall time."""
    args = ctx["args"]
    params = {**ctx["sampling"].params([ctx["tokenizer"].eos_token_id]), "max_new_tokens": args.long_new_tokens}
    prompts = [ctx["prompt_ids"][ex.uid] for ex in ctx["examples"][: args.long_episodes]]
    before, started = await server_counts(ctx), time.perf_counter()
    episodes = await asyncio.gather(
        *(direct_episode(ctx["client"], ctx["tokenizer"], p, args.long_turns, args.message, params) for p in prompts)
    )
    wall, after = time.perf_counter() - started, await server_counts(ctx)
    n = len(prompts)
    return {
        "episodes": n,
        "turns": args.long_turns,
        "wall_s": wall,
        "prefilled_per_episode": (after["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"]) / n,
        "cached_per_episode": (after["prompt_tokens_cached"] - before["prompt_tokens_cached"]) / n,
        "generated_per_episode": sum(len(g.output_ids) for e in episodes for _, g in e) / n,
        "context_per_episode": sum(len(ids) for e in episodes for ids, _ in e) / n
        + sum(len(g.output_ids) for e in episodes for _, g in e) / n,
    }


def summarise(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for variant, rs in runs.items():
        med = statistics.median
        out[variant] = {
            "episodes_per_s": med(r["episodes"] / r["wall_s"] for r in rs),
            "generated_per_s": med(r["generated"] / r["wall_s"] for r in rs),
            "trained_per_s": med(r["trained"] / (r["wall_s"] + r["convert_s"]) for r in rs),
            "best_trained_per_s": max(r["trained"] / (r["wall_s"] + r["convert_s"]) for r in rs),
            "batch_tokens_per_s": med(r["tokens"] / r["convert_s"] for r in rs),
            "convert_ms": med(1e3 * r["convert_s"] for r in rs),
            "wall_s": med(r["wall_s"] for r in rs),
            "generated": med(r["generated"] for r in rs),
            "tokens": med(r["tokens"] for r in rs),
            "turns": med(r["turns"] for r in rs),
            "episodes": rs[0]["episodes"],
            "client_cpu_ms_per_turn": med(1e3 * r["client_cpu_s"] / r["turns"] for r in rs),
            "reward_cpu_ms_per_turn": med(1e3 * r["reward_cpu_s"] / r["turns"] for r in rs),
            "server_cpu_ms_per_turn": med(1e3 * r["server_cpu_s"] / r["turns"] for r in rs),
            "client_core_busy": med(r["client_cpu_s"] / r["wall_s"] for r in rs),
            "server_core_busy": med(r["server_cpu_s"] / r["wall_s"] for r in rs),
            "server_cpu_ms_per_generated": med(1e3 * r["server_cpu_s"] / r["generated"] for r in rs),
            "forward_passes": med(r["forward_passes"] for r in rs),
            "prompt_tokens_prefilled": med(r["prompt_tokens_prefilled"] for r in rs),
            "prompt_tokens_cached": med(r["prompt_tokens_cached"] for r in rs),
            "ratio_runs": [],
        }
    if "A" in runs:  # per-round ratios against A (the same round: the machine's load then)
        for variant, rs in runs.items():
            out[variant]["ratio_runs"] = [
                (r["generated"] / r["wall_s"]) / (a["generated"] / a["wall_s"]) for r, a in zip(rs, runs["A"])
            ]
    return out


def multi_vs_single(runs: dict[str, list[dict]], summary: dict) -> dict:
    """Multi-turn's cost against single-turn's on the same generated tokens, for each pair run: the median of
    the rounds' generated tokens/s ratios (single over multi; min-max), and the ratio of the server's median
    CPU per generated token (multi over single)."""
    out = {}
    for multi, single in MULTI_SINGLE:
        if multi in runs and single in runs:
            rounds = [
                (s["generated"] / s["wall_s"]) / (m["generated"] / m["wall_s"])
                for m, s in zip(runs[multi], runs[single])
            ]
            out[f"{multi}/{single}"] = {
                "wall": statistics.median(rounds),
                "min": min(rounds),
                "max": max(rounds),
                "server_cpu": summary[multi]["server_cpu_ms_per_generated"]
                / summary[single]["server_cpu_ms_per_generated"],
            }
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def report(args, summaries: dict, costs: dict, long: dict, meta: dict) -> str:
    lines = []
    for setting, summary in summaries.items():
        lines += ["", f"### Server {setting}: {SERVERS[setting][1]}", "", *variant_tables(summary)]
    lines += [
        "",
        "Multi-turn cost against single-turn (single's generated tok/s over multi's, median of rounds, min-max; and "
        "the server's CPU per generated token, multi over single). A/E: on the same tokens (E's prompt holds the "
        "environment tokens A's episodes receive); A/D0 and B/D: on the same generated tokens only (the single "
        "turn has no environment tokens to prefill):",
        "",
    ]
    for setting, pairs in costs.items():
        for pair, c in pairs.items():
            lines.append(
                f"- server {setting}, {pair}: **{c['wall']:.2f}x** ({c['min']:.2f}-{c['max']:.2f}); "
                f"server CPU {c['server_cpu']:.2f}x"
            )
    lines += [
        "",
        f"{args.long_episodes} episodes of {args.long_turns} turns ({args.long_new_tokens} new tokens a turn) at once:",
        "",
        "| server | prompt tokens prefilled / episode | taken from the cache / episode | final context / episode "
        "| generated / episode | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for setting, e in long.items():
        lines.append(
            f"| {setting} | {e['prefilled_per_episode']:.0f} | {e['cached_per_episode']:.0f} | "
            f"{e['context_per_episode']:.0f} | {e['generated_per_episode']:.0f} | {e['wall_s']:.2f} |"
        )
    lines.append("")
    lines.append(
        f"settings: turns k={args.turns}, M={args.max_new_tokens} new tokens/turn, {args.groups} groups x "
        f"{args.n_samples} samples = {args.groups * args.n_samples} episodes in flight, temperature "
        f"{args.temperature}, message {args.message!r}, {args.repeats} interleaved rounds after 1 warm-up; {meta}"
    )
    return "\n".join(lines)


def variant_tables(summary: dict) -> list[str]:
    """One server's tables: throughput and tokens, then CPU and the server's work, per variant."""
    a = summary.get("A")
    lines = [
        "| variant | episodes/s | generated tok/s | trained tok/s (rollout + batch) | record->batch tok/s "
        "| batch ms | tokens generated / in records | turns | vs A (gen tok/s, median of rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, s in summary.items():
        ratio = statistics.median(s["ratio_runs"]) if a else float("nan")
        spread = f" ({min(s['ratio_runs']):.2f}-{max(s['ratio_runs']):.2f})" if a else ""
        lines.append(
            f"| {NAMES[variant]} | {s['episodes_per_s']:.1f} | {s['generated_per_s']:.0f} | "
            f"{s['trained_per_s']:.0f} | {s['batch_tokens_per_s']:.0f} | {s['convert_ms']:.1f} | "
            f"{s['generated']:.0f} / {s['tokens']:.0f} | {s['turns']:.0f} | {ratio:.3f}{spread} |"
        )
    lines += [
        "",
        "| variant | client CPU ms/turn | reward worker CPU ms/turn | server CPU ms/turn | client CPU / wall "
        "| server CPU / wall | server forward passes | prompt tokens prefilled / cached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, s in summary.items():
        lines.append(
            f"| {variant} | {s['client_cpu_ms_per_turn']:.2f} | {s['reward_cpu_ms_per_turn']:.2f} | "
            f"{s['server_cpu_ms_per_turn']:.2f} | {s['client_core_busy']:.2f} | {s['server_core_busy']:.2f} | "
            f"{s['forward_passes']:.0f} | {s['prompt_tokens_prefilled']:.0f} / {s['prompt_tokens_cached']:.0f} |"
        )
    if a:
        lines.append("")
        for variant in ("B", "B0", "C", "D"):
            if variant in summary:
                s = summary[variant]
                lines.append(
                    f"{variant}/A: episodes/s {s['episodes_per_s'] / a['episodes_per_s']:.3f}, generated "
                    f"tok/s {s['generated_per_s'] / a['generated_per_s']:.3f}, trained tok/s "
                    f"{s['trained_per_s'] / a['trained_per_s']:.3f} ("
                    + (
                        f"overhead {100 * (1 - s['trained_per_s'] / a['trained_per_s']):+.1f}%; "
                        if variant != "D"
                        else ""
                    )
                    + "best rounds "
                    f"{s['best_trained_per_s'] / a['best_trained_per_s']:.3f}); client CPU "
                    f"{s['client_cpu_ms_per_turn'] + s['reward_cpu_ms_per_turn']:.2f} ms/turn vs A's "
                    f"{a['client_cpu_ms_per_turn']:.2f}"
                )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--message", default=FEEDBACK, help="the environment's message between turns")
    parser.add_argument(
        "--servers", default="on,off", help=f"servers to run on, of {', '.join(SERVERS)} (prefix cache; gathering)"
    )
    parser.add_argument("--long-turns", type=int, default=20, help="turns of each long episode")
    parser.add_argument("--long-new-tokens", type=int, default=8, help="new tokens a turn in the long episodes")
    parser.add_argument("--long-episodes", type=int, default=4)
    parser.add_argument("--model", type=Path, help="a model folder (default: build the tiny model)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    args.variants, args.servers = args.variants.split(","), args.servers.split(",")
    unknown = sorted(set(args.servers) - set(SERVERS)) + sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown --servers or --variants {unknown}; servers: {list(SERVERS)}, variants: {VARIANTS}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import openai
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = args.model
        if model is None:
            from areal_hpc.data.registry import corpus_for_tokenizer
            from areal_hpc.models.tiny import init_model

            model = init_model(scratch / "tiny", corpus_for_tokenizer(0), preset="tiny", seed=0)
        processes, servers = [], {}
        try:
            for setting in args.servers:
                process, address = start_server(model, scratch, SERVERS[setting][0])
                processes.append(process)
                servers[setting] = address, process.pid
            os.sched_setaffinity(0, CLIENT_CORES)  # before the reward worker is spawned: it inherits core 1
            load_before = os.getloadavg()
            started = time.perf_counter()
            runs, long = asyncio.run(measure(args, servers, model))
            elapsed = time.perf_counter() - started
            load_after = os.getloadavg()
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=60)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}: {os.cpu_count()} cores ({cpu_model()}), {platform.platform()}",
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, openai {openai.__version__}",
        "load_average_1_5_15": f"{'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} after",
        "measured_s": round(elapsed, 1),
    }
    summaries = {setting: summarise(rs) for setting, rs in runs.items()}
    costs = {setting: multi_vs_single(runs[setting], summaries[setting]) for setting in runs}
    text = report(args, summaries, costs, long, meta)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    result = {
        "benchmark": "agent_workflow_overhead",
        "multi_vs_single": {s: {pair: round(c["wall"], 3) for pair, c in pairs.items()} for s, pairs in costs.items()},
        "long_episode_prefilled": {s: round(e["prefilled_per_episode"]) for s, e in long.items()},
    }
    if "on" in long and "off" in long:
        result["long_episode_prefill_saved"] = round(
            1 - long["on"]["prefilled_per_episode"] / long["off"]["prefilled_per_episode"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
