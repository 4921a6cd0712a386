"""AReaL-Hex planner wall time on 24-1024 GPUs vs the paper's scheduler, and vs exhaustive enumeration.

    .venv/bin/python bench/planner.py [--model r1-distill-qwen-14b] [--repeats 3] [--machine TEXT] [--save]

Clusters are H800 + H20 mixes (a quarter H800), 8 devices per machine, the paper's links and
prices; the RL batch grows with the cluster (64 sequences of 1k+8k tokens per 32 GPUs). Each size
plans from a cold cost model (no cached replica speeds). The paper's times (Table 5: 14.9 s, 23.1 s,
46.7 s, 120 s at 24-56 GPUs) are quoted, not re-run; up to 56 GPUs the same run also enumerates
every device split exhaustively, to time it and to check the search reaches its optimum.
Also writes `repro_hex-<date>.*` and `repro_eta-<date>.*`: the `areal-hpc repro` tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from datetime import date
from importlib.metadata import version

from recording import machine, machine_and_versions, run_and_record, save

from areal_hpc.sched import repro_eta, repro_hex
from areal_hpc.sched.cost import CostModel
from areal_hpc.sched.hardware import make_cluster
from areal_hpc.sched.model_spec import load_model_spec
from areal_hpc.sched.planner import HeteroPlanner

PAPER_S = {24: 14.9, 32: 23.1, 40: 46.7, 56: 120.0}
SIZES = (24, 32, 40, 56, 256, 1024)
LINKS = {"H800-H800": 5, "H20-H20": 5, "H800-H20": 1.5}


def mixed_cluster(gpus: int):
    h800 = max(8, gpus // 4 // 8 * 8)
    return make_cluster(
        f"{h800} H800 + {gpus - h800} H20",
        [("H800", "H800", h800 // 8, 8), ("H20", "H20", (gpus - h800) // 8, 8)],
        LINKS,
    )


def plan_once(gpus: int, model: str, exhaustive: bool):
    workload = replace(repro_hex.WORKLOAD, prompts=max(1, gpus // 32) * repro_hex.WORKLOAD.prompts)
    planner = HeteroPlanner(mixed_cluster(gpus), CostModel(load_model_spec(model), workload, repro_hex.CALIBRATED))
    start = time.perf_counter()
    plan = planner.plan(exhaustive)
    return time.perf_counter() - start, plan, len(planner.evaluated)


def run(args) -> dict:
    rows = []
    for gpus in SIZES:
        runs = [plan_once(gpus, args.model, exhaustive=False) for _ in range(args.repeats)]
        seconds, plan, evaluated = statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]
        row = {
            "gpus": gpus,
            "cluster": mixed_cluster(gpus).summary(),
            "search_s": round(seconds, 3),
            "splits_evaluated": evaluated,
            "allocation": plan.allocation,
            "tokens_per_s": round(plan.tokens_per_s, 1),
            "price_per_hour": round(plan.price_per_hour, 2),
        }
        if gpus in PAPER_S:
            exhaustive_s, best, splits = plan_once(gpus, args.model, exhaustive=True)
            row.update(
                paper_s=PAPER_S[gpus],
                speedup_vs_paper=round(PAPER_S[gpus] / seconds, 1),
                exhaustive_s=round(exhaustive_s, 2),
                exhaustive_splits=splits,
                search_vs_optimum=round(plan.tokens_per_s / best.tokens_per_s, 4),
            )
        rows.append(row)
        print({k: row[k] for k in ("gpus", "search_s", "splits_evaluated")}, flush=True)
    result = {
        "benchmark": "planner",
        "date": date.today().isoformat(),
        "machine": args.machine,
        "model": args.model,
        "repeats": args.repeats,
        "rows": rows,
        "versions": {
            "python": platform.python_version(),
            "highspy": version("highspy"),
            "pymetis": version("pymetis"),
            "scipy": version("scipy"),
        },
        "min_speedup_24_56": min(r["speedup_vs_paper"] for r in rows if "speedup_vs_paper" in r),
        "seconds_1024": next(r["search_s"] for r in rows if r["gpus"] == 1024),
    }
    print(json.dumps({k: result[k] for k in ("benchmark", "min_speedup_24_56", "seconds_1024")}))
    return result


def report(r: dict) -> str:
    lines = [
        f"# AReaL-Hex planner wall time ({r['date']})",
        "",
        machine_and_versions(r),
        f"Model {r['model']}; median of {r['repeats']} cold runs; H800 + H20 clusters (a quarter H800).",
        "",
        "| GPUs | cluster | ours (s) | paper (s) | speedup | exhaustive (s) | search / optimum | splits | "
        "plan | tokens/s | $/h |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['gpus']} | {row['cluster']} | {row['search_s']:.2f} | {row.get('paper_s', '-')} | "
            f"{str(row['speedup_vs_paper']) + 'x' if 'speedup_vs_paper' in row else '-'} | "
            f"{row.get('exhaustive_s', '-')} | {row.get('search_vs_optimum', '-')} | "
            f"{row['splits_evaluated']} | `{row['allocation']}` | {row['tokens_per_s']:,.0f} | "
            f"{row['price_per_hour']:,.2f} |"
        )
    lines += [
        "",
        f"Targets: >= 10x faster than the paper at 24-56 GPUs (lowest here: {r['min_speedup_24_56']}x); "
        f"1024 GPUs under 60 s (here: {r['seconds_1024']:.1f} s). The paper's times are from its Table 5 "
        "(its own hardware), not re-run here: quote the ratio with that in mind.",
    ]
    return "\n".join(lines)


def record_repro(args, name: str, title: str, setting: str, rows, notes) -> None:
    """A `repro` table, recorded beside the timing (the same factors the CLI uses)."""
    result = {
        "date": date.today().isoformat(),
        "machine": args.machine,
        "setting": setting,
        "rows": [row.to_dict() for row in rows],
        "notes": notes,
    }
    text = [
        f"# {title} ({result['date']})",
        "",
        setting,
        "",
        "| table | row | paper | ours | ours/paper | role |",
        "|---|---|---|---|---|---|",
    ]
    text += [f"| {r.table} | {r.row} | {r.paper:.4g} | {r.ours:.4g} | {r.ratio:.2f} | {r.role} |" for r in rows]
    text += ["", "Deviations from the paper:", ""] + [f"- {note}" for note in notes]
    print("\n".join(text))
    if args.save:
        save(name, result, "\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="r1-distill-qwen-14b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default=machine(), help="how to describe this machine in the record")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    run_and_record("planner", args, run, report)
    w = repro_hex.WORKLOAD
    record_repro(
        args,
        "repro_hex",
        "AReaL-Hex reproduction (`areal-hpc repro hex`)",
        f"Efficiency: {repro_hex.describe(repro_hex.CALIBRATED)}. Workload: {w.sequences} sequences/step "
        f"of {w.prompt_len}+{w.gen_mean} tokens.",
        repro_hex.hex_rows(),
        repro_hex.NOTES,
    )
    w = repro_eta.WORKLOAD
    record_repro(
        args,
        "repro_eta",
        "AReaL throughput vs staleness (`areal-hpc repro areal-eta`)",
        f"1.5B on 8 H800; overall efficiency {repro_eta.OVERALL}; {w.sequences} sequences/step, answers "
        f"log-normal (mean {w.gen_mean}, spread {repro_eta.SPREAD}, cut at {w.gen_max}).",
        repro_eta.eta_rows(),
        repro_eta.NOTES,
    )


if __name__ == "__main__":
    main()
