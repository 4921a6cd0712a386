"""Agent trajectories as prefix trees: the calculator and search agents' real batches, read back from
short runs' shards, trained flat and as a tree (``actor.tree_training=dta``), in one run.

    .venv/bin/python bench/agent_trees.py [--root /tmp/agent_trees] [--steps 3] [--save]

Each agent trains a few steps with its shipped config (the calculator after its SFT warm-up, so its
episodes call the tool; the search agent untrained, so its episodes run every turn); the bench then
reads each step's batch as the trainer took it (``logs/batches.jsonl``, the trajectories from
``shards/``) and counts, per batch, three ways of laying out the same episodes:

- per call: every model call a training sequence (the conversation so far + that reply), as a recorder
  of separate API calls stores them and as the DTA paper's agent traces are trained;
- per episode: one sequence per episode, its turns back to back (how areal-hpc records an episode:
  a turn's context is the previous turn's sequence, kept once);
- tree: the batch's prefix tree (a group's episodes share their prompt; a turn's prefix is shared).

Compression is sequence tokens over tree tokens. Trained tokens/s: the torch engine's PPO step on the
largest step's batch, flat and tree, each in its own process on one thread (``repro_dta.measure``,
the "small" preset with random weights), median of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, once, run_and_record, versions

from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.data.shards.reader import TrajectoryStore
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.train.repro_dta import RecordedWorkload, measure
from areal_hpc.train.trajectory_batch import trajectory_sequence

TRAIN_STEPS = 3


def agent_commands(root: Path) -> dict[str, list[str]]:
    """The two agents' short runs under ``root``: the ``areal-hpc train`` command of each."""
    data = root / "search_data"
    common = [f"cluster.fileroot={root}", "rl.eval_every_steps=0", f"rl.total_train_steps={TRAIN_STEPS}"]
    train = [sys.executable, "-m", "areal_hpc", "train", "--config"]
    return {
        "calculator": [*train, "configs/agent_calculator.yaml", *common],
        "search": [
            *train,
            "configs/agent_search.yaml",
            *common,
            f"dataset.path={data / 'train.jsonl'}",
            f"dataset.eval_path={data / 'test.jsonl'}",
            f"rl.sft_warmup_path={data / 'demos.jsonl'}",
        ],
    }


def step_batches(run: Path) -> list[list[Trajectory]]:
    """Each trained step's trajectories, in the order the trainer took them."""
    audit = [json.loads(line) for line in (run / "logs" / "batches.jsonl").read_text().splitlines()]
    with TrajectoryStore(run / "shards") as store:
        by_id = {t.id: t for t in store.trajectories()}
    return [[by_id[i] for i in line["trained"]] for line in audit if line.get("trained")]


def per_call_tokens(trajectory: Trajectory) -> int:
    """Tokens of the episode as one training sequence per model call: each call's context and reply."""
    total, context = 0, 0
    for segment in trajectory.segments:
        context += len(segment.input_ids) + len(segment.output_ids)
        total += context
    return total


def layouts(batch: list[Trajectory]) -> dict:
    """Token counts of one batch laid out per call, per episode and as its prefix tree."""
    sequences = [trajectory_sequence(t, 1.0)[:2] for t in batch]
    tree = build_prefix_tree([tokens for tokens, _ in sequences])
    return {
        "episodes": len(batch),
        "turns": sum(len(t.segments) for t in batch),
        "per_call_tokens": sum(map(per_call_tokens, batch)),
        "per_episode_tokens": tree.n_sequence_tokens,
        "tree_tokens": tree.n_tokens,
        "workload": RecordedWorkload(tuple(tuple(s) for s, _ in sequences), tuple(tuple(m) for _, m in sequences)),
    }


def run(args) -> dict:
    args.root.mkdir(parents=True, exist_ok=True)
    data = args.root / "search_data"
    if not (data / "train.jsonl").exists():
        once(
            args.root / "search_data.done",
            [sys.executable, "-m", "areal_hpc.agents.search.dataset", str(data)],
            args.root / "search_data.log",
        )
    agents = []
    for agent, command in agent_commands(args.root).items():
        seconds = once(args.root / f"{agent}.done", command, args.root / f"{agent}.log")
        name = "agent_calculator" if agent == "calculator" else "agent_search"
        steps = [layouts(batch) for batch in step_batches(args.root / name / "trial0")]
        largest = max(steps, key=lambda s: s["per_episode_tokens"])
        print(f"{agent}: {len(steps)} steps read; timing the largest batch flat and as a tree", file=sys.stderr)
        timed = {mode: measure(mode, largest["workload"], "small", args.steps) for mode in ("flat", "dta")}
        agents.append(
            {
                "agent": agent,
                "run_seconds": seconds,
                "steps": [{k: v for k, v in s.items() if k != "workload"} for s in steps],
                "timed_step_tokens": largest["per_episode_tokens"],
                "timed": timed,
            }
        )
    return {
        "benchmark": "agent_trees",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": versions("torch", "transformers"),
        "steps": args.steps,
        "agents": agents,
    }


def report(result: dict) -> str:
    lines = [
        f"# Agent trajectories as prefix trees ({result['date']})",
        "",
        f"Machine: {result['machine']}. Versions: {result['versions']}. Speed: the torch engine's PPO step on each "
        f"agent's largest batch, 'small' preset (random weights), one thread, median of {result['steps']} steps.",
        "",
        "| agent | step | episodes | turns | per-call tokens | per-episode tokens | tree tokens | "
        "per call / tree | per episode / tree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for agent in result["agents"]:
        for k, s in enumerate(agent["steps"], 1):
            lines.append(
                f"| {agent['agent']} | {k} | {s['episodes']} | {s['turns']} | {s['per_call_tokens']:,} | "
                f"{s['per_episode_tokens']:,} | {s['tree_tokens']:,} | "
                f"{s['per_call_tokens'] / s['tree_tokens']:.2f}x | {s['per_episode_tokens'] / s['tree_tokens']:.2f}x |"
            )
    lines += [
        "",
        "| agent | batch tokens (per episode) | flat s/step | tree s/step | flat tokens/s | tree tokens/s | "
        "tree / flat | flat peak MiB | tree peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for agent in result["agents"]:
        flat, tree = agent["timed"]["flat"], agent["timed"]["dta"]
        speed = [r["sequence_tokens"] / r["seconds"] for r in (flat, tree)]
        lines.append(
            f"| {agent['agent']} | {agent['timed_step_tokens']:,} | {flat['seconds']:.3f} | {tree['seconds']:.3f} | "
            f"{speed[0]:,.0f} | {speed[1]:,.0f} | {speed[1] / speed[0]:.2f}x | "
            f"{flat['peak_bytes'] / 2**20:.0f} | {tree['peak_bytes'] / 2**20:.0f} |"
        )
    return "\n".join([*lines, "", *NOTES])


NOTES = [
    "Per call / tree is the compression a recorder of separate model calls gets from the tree (the DTA paper's "
    "setting: 9.43x on τ²-bench); areal-hpc already records an episode's turns as one sequence, so its own gain "
    "from the tree is per episode / tree: the group's shared prompt (8 episodes a question for the calculator, "
    "4 for the search agent, whose 12-turn episodes dwarf their prompt).",
    "The calculator's episodes come after its SFT warm-up (most call the tool once: 1.2-1.4 turns an episode); "
    "the search agent's are an untrained model's (every episode runs its 12 turns).",
    "Timed on a loaded machine (other work shared the 2 cores); the ratios are what to read.",
]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/agent_trees"), help="the agents' run folders")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per layout (median)")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("agent_trees", parser.parse_args(), run, report)
