"""A plan as a user sees it: a YAML/JSON record (the launcher's input), a readable table, a PNG."""

from __future__ import annotations

from dataclasses import asdict

from areal_hpc.sched.cost import Workload
from areal_hpc.sched.hardware import Cluster
from areal_hpc.sched.planner import Plan


def plan_dict(plan: Plan, cluster: Cluster, model: str, workload: Workload) -> dict:
    device = {p.name: p.device.name for p in cluster.pools}
    return {
        "cluster": cluster.name,
        "model": model,
        "allocation": plan.allocation,
        "staleness": plan.staleness,
        "workload": asdict(workload),
        "pools": {
            p.name: {
                "device": p.device.name,
                "partition": p.partition or p.name,
                "nodes": p.nodes,
                "per_node": p.per_node,
            }
            for p in cluster.pools
        },
        "train": [
            {
                "pool": g.pool,
                "device": device[g.pool],
                "devices": g.devices,
                "dp": g.dp,
                "tp": g.tp,
                "pp": g.pp,
                "tokens_per_s": round(g.tokens_per_s, 1),
            }
            for g in plan.train
        ],
        "rollout": [
            {
                "pool": r.pool,
                "device": device[r.pool],
                "replicas": y,
                "devices": y * r.devices,
                "tp": r.tp,
                "pp": r.pp,
                "batch": r.batch,
                "tokens_per_s": round(r.tokens_per_s, 1),
                "decode_step_s": [float(f"{r.step_1_s:.4g}"), float(f"{r.step_full_s:.4g}")],
            }
            for r, y in plan.rollout.replicas
        ],
        "predicted": {
            "tokens_per_s": round(plan.tokens_per_s, 1),
            "price_per_hour": round(plan.price_per_hour, 2),
            "tokens_per_dollar": round(plan.tokens_per_s * 3600 / plan.price_per_hour, 1),
            "step_s": round(plan.step_s, 3),
            "train_s": round(plan.train_s, 3),
            "generation_s": round(plan.generation_s, 3),
            "weight_sync_s": round(plan.sync_s, 3),
        },
    }


def table(headers: list[str], rows: list[list]) -> str:
    """Plain aligned columns (numbers right-aligned), readable in a terminal and in a log."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip() for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x%"))
        return True
    except ValueError:
        return False


def plan_text(d: dict) -> str:
    rows = [
        [
            "train",
            g["pool"],
            g["device"],
            g["devices"],
            f"dp{g['dp']} tp{g['tp']} pp{g['pp']}",
            f"{g['tokens_per_s']:,.0f}",
        ]
        for g in d["train"]
    ]
    rows += [
        [
            "rollout",
            r["pool"],
            r["device"],
            r["devices"],
            f"{r['replicas']} x tp{r['tp']} pp{r['pp']}",
            f"{r['tokens_per_s'] * r['replicas']:,.0f}",
        ]
        for r in d["rollout"]
    ]
    p = d["predicted"]
    return "\n".join(
        [
            f"plan for {d['model']} on {d['cluster']} (staleness {d['staleness']})",
            "",
            table(["group", "pool", "device", "devices", "parallelism", "tokens/s"], rows),
            "",
            f"allocation:      {d['allocation']}",
            f"throughput:      {p['tokens_per_s']:,.0f} tokens/s",
            f"cost:            ${p['price_per_hour']:,.2f}/h ({p['tokens_per_dollar']:,.0f} tokens per $)",
            f"step:            {p['step_s']:,.1f} s = max(train {p['train_s']:,.1f} s, generation "
            f"{p['generation_s']:,.1f} s) + weight sync {p['weight_sync_s']:,.1f} s"
            if d["staleness"]
            else f"step:            {p['step_s']:,.1f} s = train {p['train_s']:,.1f} s + generation "
            f"{p['generation_s']:,.1f} s + weight sync {p['weight_sync_s']:,.1f} s",
        ]
    )


def plot_plan(d: dict, path) -> None:
    """Devices per group (bar) and the step-time breakdown (stacked bar), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    labels = [f"train {g['device']}\ndp{g['dp']}tp{g['tp']}pp{g['pp']}" for g in d["train"]]
    labels += [f"rollout {r['device']}\n{r['replicas']}x tp{r['tp']}pp{r['pp']}" for r in d["rollout"]]
    counts = [g["devices"] for g in d["train"]] + [r["devices"] for r in d["rollout"]]
    left.barh(labels, counts, color=["tab:blue"] * len(d["train"]) + ["tab:orange"] * len(d["rollout"]))
    left.set_xlabel("devices")
    p = d["predicted"]
    right.bar(["train"], [p["train_s"]], color="tab:blue")
    right.bar(["rollout"], [p["generation_s"]], color="tab:orange", label="generation")
    for name in ("train", "rollout"):
        right.bar(
            [name],
            [p["weight_sync_s"]],
            bottom=[p["train_s"] if name == "train" else p["generation_s"]],
            color="tab:gray",
            label="weight sync" if name == "train" else None,
        )
    right.set_ylabel("seconds per step")
    right.legend()
    fig.suptitle(f"{d['model']} on {d['cluster']}: {p['tokens_per_s']:,.0f} tokens/s, ${p['price_per_hour']:,.2f}/h")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
