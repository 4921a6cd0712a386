"""A tool agent's demo over seeds (``configs/agent_calculator.yaml`` or ``configs/agent_search.yaml``): held-out
success against RL step, mean and range over the seeds, the SFT warm-up's accuracy (RL step 0) marked, and
how the agent uses its tool while training.

    .venv/bin/python bench/agent_curve.py --agent calculator --run --root /tmp/calc_runs --seeds 1 2 3 \\
        --md bench/results/agent_calculator.md --png docs/img/agent_calculator.png
    .venv/bin/python bench/agent_curve.py --agent search --root /tmp/search_runs --seeds 1 2 3 --png out.png

``--run`` runs ``areal-hpc train --config CONFIG experiment.seed=S cluster.fileroot=ROOT/seedS`` for each seed,
one at a time (the search agent's data written first, by its config, into ROOT/data), and records its wall
time (``wall.json``); without it the script reads runs already there. It reads each run's ``metrics.jsonl``
(``eval/accuracy`` every ``rl.eval_every_steps``, the tool metric every step). "End" is the mean of the last 3
evaluations. The calculator's "operands copied": of the held-out questions, the share whose call, forced to
start with ``<calc>`` and decoded greedily, holds the question's expression exactly (after the warm-up and at
the end): the copying skill apart from the habit of calling.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import train_command
from run_processes import process_tree, pss_mib

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Agent:
    config: str
    title: str  # of the curve
    tool_metric: str  # logged every RL step
    tool_label: str
    tool_scale: float = 1.0  # 100: the metric is a share, plotted in percent
    # (the run's config.yaml, a model folder) -> a share, after the warm-up and at the end
    skill: Callable[[Path, Path], float] | None = None
    skill_label: str = ""

    @property
    def name(self) -> str:  # the config's experiment.name
        return Path(self.config).stem

    def data_overrides(self, root: Path) -> list[str]:
        """The search agent's data: written once into ROOT/data by its config's settings."""
        if self.name != "agent_search":
            return []
        data = root / "data"
        overrides = [
            f"dataset.path={data / 'train.jsonl'}",
            f"dataset.eval_path={data / 'test.jsonl'}",
            f"rl.sft_warmup_path={data / 'demos.jsonl'}",
        ]
        if not (data / "test.jsonl").exists():
            subprocess.run(
                [sys.executable, "-m", "areal_hpc.agents.search.dataset", "--config", self.config, *overrides],
                cwd=REPO,
                check=True,
            )
        return overrides


def run_dir(agent: Agent, root: Path, seed: int) -> Path:
    return root / f"seed{seed}" / agent.name / "trial0"


def run_seed(agent: Agent, root: Path, seed: int, overrides: list[str]) -> None:
    """Run one seed, sampling the PSS summed over the run's processes every half second (its peak is
    recorded with the wall time in ``wall.json``)."""
    folder = root / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    overrides = [*agent.data_overrides(root), *overrides]
    started, load_before, peak = time.time(), os.getloadavg(), 0.0
    command = train_command(
        agent.config,
        f"cluster.fileroot={folder}",
        f"experiment.seed={seed}",
        *overrides,
    )
    with (folder / "train.log").open("w") as log:
        run = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while run.poll() is None:
            peak = max(peak, sum(pss_mib(pid) for pid in process_tree(run.pid)))
            time.sleep(0.5)
    if run.returncode:
        raise SystemExit(f"seed {seed} failed (exit {run.returncode}): see {folder / 'train.log'}")
    (folder / "wall.json").write_text(
        json.dumps(
            {"wall_s": time.time() - started, "started": started, "load_before": load_before, "peak_pss_mib": peak}
        )
        + "\n"
    )


@functools.cache
def held_out(config: Path) -> tuple:
    """The run's config and its held-out examples (built once for every model read)."""
    from areal_hpc.config import load_config
    from areal_hpc.data.registry import build_task

    cfg = load_config(str(config), [])
    return cfg, tuple(build_task(cfg.dataset, cfg.reward).eval)


def operand_copying(config: Path, model_dir: Path, questions: int = 200) -> float:
    """Share of the first ``questions`` held-out questions whose forced call copies the expression exactly."""
    import torch

    from areal_hpc.agents.calculator import tool_call
    from areal_hpc.data.calculator import CALL_OPEN, expression_of
    from areal_hpc.models.chat import prompt_ids
    from areal_hpc.models.hf import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    right = 0
    for example in held_out(config)[1][:questions]:
        ids = prompt_ids(tokenizer, example.prompt) + tokenizer.encode(CALL_OPEN, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eos_token_id
            )
        text = CALL_OPEN + tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        right += tool_call(text) == expression_of(example.prompt)
    return right / questions


def forced_search(config: Path, model_dir: Path, questions: int = 66) -> float:
    """Share of the first ``questions`` held-out questions answered right by the search agent decoded greedily
    in process, its first turn forced to start with ``<search>``: the loop's skill (copying names into
    searches and answers) apart from the habit of searching."""
    import asyncio

    import torch

    from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
    from areal_hpc.agents.groups import run_episode
    from areal_hpc.agents.registry import build_workflow
    from areal_hpc.data.rewards import RewardPool
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.rollout.client import Generation

    cfg, examples = held_out(config)
    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    forced = tokenizer.encode("<search>", add_special_tokens=False)

    def greedy():
        """A generate that decodes greedily in process, its first call's output starting with ``<search>``."""
        first = True

        async def generate(input_ids, params):
            nonlocal first
            prefix, first = (forced if first else []), False
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([list(input_ids) + prefix]),
                    max_new_tokens=params["max_new_tokens"] - len(prefix),
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                )
            ids = prefix + out[0, len(input_ids) + len(prefix) :].tolist()
            return Generation(list(input_ids), ids, [0.0] * len(ids), [0] * len(ids), "stop")

        return generate

    workflow, right = build_workflow(cfg.rollout), 0.0
    with RewardPool(cfg.reward.fn) as pool:
        for example in examples[:questions]:
            settings = EpisodeSettings(greedy(), tokenizer, Sampling(cfg.generation.max_new_tokens), Scorer(pool))
            [record] = asyncio.run(run_episode(workflow, EpisodeContext(settings), example))
            right += record.reward
    return right / min(questions, len(examples))


def read_seed(agent: Agent, root: Path, seed: int) -> dict:
    folder = run_dir(agent, root, seed)
    rl = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (folder / "sft_warmup" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rl if "eval/accuracy" in r}
    steps = [r for r in rl if "rollout/turns" in r]
    wall_file = root / f"seed{seed}" / "wall.json"
    timing = json.loads(wall_file.read_text()) if wall_file.exists() else {}
    return {
        "seed": seed,
        "evals": evals,
        "start": evals[0],
        "end": float(np.mean(list(evals.values())[-3:])),
        "sft_s": sft[-1]["time"] - sft[0]["time"],
        "rl_s": rl[-1]["time"] - rl[0]["time"],
        "wall_s": timing.get("wall_s"),
        "peak_pss_mib": timing.get("peak_pss_mib"),
        "tool_used": [(r["step"], r.get(agent.tool_metric, float("nan"))) for r in steps],
        "skill": [agent.skill(folder / "config.yaml", folder / m) for m in ("sft_warmup/model", "model")]
        if agent.skill
        else None,
        "turns": [(r["step"], r["rollout/turns"]) for r in steps],
    }


def report(agent: Agent, rows: list[dict]) -> str:
    steps = sorted(set.intersection(*(set(r["evals"]) for r in rows)))
    lines = ["| RL step | held-out success mean | min | max | gain over step 0 (mean) |", "|---|---|---|---|---|"]
    base = np.mean([r["start"] for r in rows])
    for step in steps:
        values = [r["evals"][step] for r in rows]
        lines.append(
            f"| {step} | {np.mean(values):.1%} | {min(values):.1%} | {max(values):.1%} | "
            f"{np.mean(values) - base:+.1%} |"
        )
    lines += [
        "",
        f"| seed | SFT start (step 0) | end (mean of last 3 evals) | gain | {agent.skill_label or 'skill'} after SFT / "
        "at the end | SFT s | RL s | job wall s | peak PSS of the run's processes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wall = f"{r['wall_s']:.0f}" if r["wall_s"] is not None else "-"
        peak = f"{r['peak_pss_mib']:.0f} MiB" if r["peak_pss_mib"] is not None else "-"
        skill = " / ".join(f"{share:.1%}" for share in r["skill"]) if r["skill"] else "-"
        lines.append(
            f"| {r['seed']} | {r['start']:.1%} | {r['end']:.1%} | {r['end'] - r['start']:+.1%} | "
            f"{skill} | {r['sft_s']:.0f} | {r['rl_s']:.0f} | {wall} | {peak} |"
        )
    start, end = np.mean([r["start"] for r in rows]), np.mean([r["end"] for r in rows])
    lines += ["", f"mean over {len(rows)} seeds: {start:.1%} -> {end:.1%} ({end - start:+.1%})"]
    return "\n".join(lines)


def plot(agent: Agent, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(set.intersection(*(set(r["evals"]) for r in rows)))
    values = np.array([[r["evals"][s] for s in steps] for r in rows]) * 100
    fig, (ax, tools) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    ax.fill_between(steps, values.min(0), values.max(0), alpha=0.25, label=f"range over {len(rows)} seeds")
    ax.plot(steps, values.mean(0), marker="o", label="mean")
    start = values[:, 0].mean()
    ax.axhline(start, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        f"SFT warm-up: {start:.0f}%", (steps[0], start), textcoords="offset points", xytext=(6, 6), color="grey"
    )
    ax.set(
        xlabel="RL step",
        ylabel="held-out success (%)",
        ylim=(0, 100),
        title=agent.title,
    )
    ax.legend(loc="center right")
    for r in rows:
        tool_steps, used = zip(*r["tool_used"])
        tools.plot(tool_steps, np.array(used) * agent.tool_scale, linewidth=1, label=f"seed {r['seed']}")
    tools.set(
        xlabel="RL step",
        ylabel=agent.tool_label,
        title="tool use while training (sampled)",
    )
    tools.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", choices=sorted(AGENTS), required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--run", action="store_true", help="run the seeds first (one at a time)")
    parser.add_argument("--md", type=Path, help="write the tables here (with the machine and the date)")
    parser.add_argument("--png", type=Path, help="write the curve here")
    parser.add_argument("overrides", nargs="*", help="config overrides for --run (key=value)")
    args = parser.parse_args(argv)
    agent = AGENTS[args.agent]
    if args.run:
        for seed in args.seeds:
            run_seed(agent, args.root, seed, args.overrides)
    rows = [read_seed(agent, args.root, seed) for seed in args.seeds]
    text = report(agent, rows)
    print(text)
    if args.md:
        header = (
            f"# {agent.name} over {len(rows)} seeds ({datetime.date.today().isoformat()})\n\n"
            f"machine: {platform.node()}: {os.cpu_count()} cores, {platform.machine()}, {platform.platform()}\n"
            f"config: {agent.config}, end to end (SFT warm-up + asynchronous GRPO)\n\n"
        )
        args.md.write_text(header + text + "\n")
    if args.png:
        plot(agent, rows, args.png)
    return 0


AGENTS = {
    "calculator": Agent(
        "configs/agent_calculator.yaml",
        "4-digit products with a calculator tool (greedy)",
        "reward/tool_used",
        "answers after a tool call (%)",
        100.0,
        operand_copying,
        "operands copied",
    ),
    "search": Agent(
        "configs/agent_search.yaml",
        "multi-hop questions with a search tool (greedy)",
        "rollout/turns",
        "model turns per episode",
        skill=forced_search,
        skill_label="answered with the first turn forced to search",
    ),
}


if __name__ == "__main__":
    sys.exit(main())
