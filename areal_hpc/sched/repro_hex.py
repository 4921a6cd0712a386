"""AReaL-Hex's published tables beside the planner's predictions (``areal-hpc repro hex``).

Three global efficiency factors are fitted to the homogeneous H800 rows (Table 3, Table 2's H800
column) and H20's own training and decode factors to Table 1's two cost ratios; every heterogeneous
and same-budget row is then a prediction. Rows say which is which; ``MISSES`` says, row by row, why
a row is more than 15% off the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hpc.sched.calibrate import Measurement, fit_efficiency
from areal_hpc.sched.catalog import EFFICIENCY_AREAL_HEX
from areal_hpc.sched.cost import CostModel, Efficiency, Workload, load_efficiency
from areal_hpc.sched.hardware import load_cluster
from areal_hpc.sched.model_spec import load_model_spec
from areal_hpc.sched.planner import HeteroPlanner

MODELS = {"1.5B": "r1-distill-qwen-1.5b", "7B": "r1-distill-qwen-7b", "14B": "r1-distill-qwen-14b"}
# The paper prints neither its batch nor its lengths: an R1-distill math run is assumed, 1k-token
# prompts and 8k-token answers on average, 4 prompts x 16 answers (0.6M tokens) per step. The step
# size sets how much the weight sync costs; `repro hex --sequences N` shows its effect.
WORKLOAD = Workload(prompts=4, answers=16, prompt_len=1024, gen_mean=8192, gen_max=16384)
BUDGET = 86.64  # $/h of 8 H800 + 24 H20, the paper's same-budget line
TABLE1 = {"inference": 2.72, "training": 3.12}  # cost per token: H20 cheaper to generate, H800 to train
PAPER = {  # per model: (uniform, optimised) on 24 H800, hex throughput, sync H800, sync hex, vs H800, vs H20
    "1.5B": (1.17e4, 1.84e4, 1.79e4, 4.75, 10.06, 1.36, 2.80),
    "7B": (3.57e3, 5.98e3, 6.00e3, 14.79, 58.34, 1.31, 2.76),
    "14B": (1.29e3, 2.16e3, 2.30e3, 26.00, 112.93, 1.50, 2.29),
}
# Global factors (H800 is the reference device) and H20's own training and decode factors. decode_mfu
# keeps its default: with H20's decode factor fitted, the rows leave it undetermined.
FITTED = ("overall", "decode_hbm", "sync", "H20.train", "H20.decode")
# Written from `areal-hpc repro hex --calibrate` (2026-11-23), fitted to the rows marked "fit".
CALIBRATED = load_efficiency(EFFICIENCY_AREAL_HEX)


@dataclass(frozen=True)
class Row:
    table: str
    row: str
    unit: str
    paper: float
    ours: float
    role: str  # "fit": used to calibrate; "prediction": not

    @property
    def ratio(self) -> float:
        return self.ours / self.paper

    def to_dict(self) -> dict:
        return {"table": self.table, "row": self.row, "unit": self.unit, "paper": self.paper,
                "ours": round(self.ours, 4 if self.unit == "x" else 1), "ratio": round(self.ratio, 3), "role": self.role}


def planner(cluster: str, size: str, efficiency: Efficiency, workload: Workload = WORKLOAD,
            budget: float = float("inf")) -> HeteroPlanner:
    cost = CostModel(load_model_spec(MODELS[size]), workload, efficiency)
    return HeteroPlanner(load_cluster(cluster), cost, budget=budget)


def uniform_split(p: HeteroPlanner):
    """Table 3's baseline: half the devices train, half generate."""
    return p.evaluate({pool.name: pool.devices // 2 for pool in p.cluster.pools})


def cost_per_token_ratio(e: Efficiency, side: str, workload: Workload = WORKLOAD) -> float:
    """Table 1: $/token of H800 over H20 for generation (side="inference"), H20 over H800 for training."""
    cost = CostModel(load_model_spec(MODELS["7B"]), workload, e)
    pools = {p.name: p for p in load_cluster("paper-8h800-24h20").pools}
    per_dollar = {}
    for name, pool in pools.items():
        if side == "inference":
            per_dollar[name] = max(r.tokens_per_s / r.price_per_hour for r in cost.rollout_replicas(pool, 8, 5))
        else:
            per_dollar[name] = cost.train_group(pool, 8, 5).tokens_per_s / (8 * pool.device.price_per_hour)
    return per_dollar["H20"] / per_dollar["H800"] if side == "inference" else per_dollar["H800"] / per_dollar["H20"]


def measurements(w: Workload = WORKLOAD) -> list[Measurement]:
    """The rows the factors are fitted to: homogeneous H800 throughput and weight-sync times, and
    Table 1's cost ratios (the only published numbers on H20 alone: its decode and training speeds)."""
    rows = [Measurement(f"{side} cost ratio", ratio, lambda e, side=side: cost_per_token_ratio(e, side, w))
            for side, ratio in TABLE1.items()]
    for size, (uniform, optimised, _, sync_h800, *_) in PAPER.items():
        rows += [Measurement(f"{size} uniform", uniform,
                             lambda e, s=size: uniform_split(planner("paper-24h800", s, e, w)).tokens_per_s),
                 Measurement(f"{size} optimised", optimised,
                             lambda e, s=size: planner("paper-24h800", s, e, w).plan().tokens_per_s),
                 Measurement(f"{size} sync", sync_h800,
                             lambda e, s=size: planner("paper-24h800", s, e, w).plan().sync_s)]
    return rows


def calibrate(workload: Workload = WORKLOAD) -> Efficiency:
    return fit_efficiency(measurements(workload), list(FITTED), CALIBRATED)


def describe(e: Efficiency) -> str:
    return ", ".join(f"{name} {e.factor(name):.3g}" for name in FITTED) + " (fitted)"


def hex_rows(e: Efficiency = CALIBRATED, w: Workload = WORKLOAD) -> list[Row]:
    rows = [Row("1", "7B generation $/token, H800 / H20", "x", TABLE1["inference"],
                cost_per_token_ratio(e, "inference", w), "fit"),
            Row("1", "7B training $/token, H20 / H800", "x", TABLE1["training"],
                cost_per_token_ratio(e, "training", w), "fit")]
    for size, (uniform, optimised, hex_paper, sync_h800, sync_hex, vs_h800, vs_h20) in PAPER.items():
        h800, hexp = planner("paper-24h800", size, e, w).plan(), planner("paper-8h800-24h20", size, e, w).plan()
        h800_budget = planner("paper-24h800", size, e, w, BUDGET).plan()
        h20_budget = planner("paper-48h20", size, e, w, BUDGET).plan()
        per_token = (h800.price_per_hour / h800.tokens_per_s) / (hexp.price_per_hour / hexp.tokens_per_s)
        rows += [
            Row("3", f"{size} uniform, 24 H800", "tok/s", uniform,
                uniform_split(planner("paper-24h800", size, e, w)).tokens_per_s, "fit"),
            Row("3", f"{size} optimised, 24 H800", "tok/s", optimised, h800.tokens_per_s, "fit"),
            Row("2", f"{size} weight sync, 24 H800", "s", sync_h800, h800.sync_s, "fit"),
            Row("2", f"{size} weight sync, 8 H800 + 24 H20", "s", sync_hex, hexp.sync_s, "prediction"),
            Row("4", f"{size} 8 H800 + 24 H20", "tok/s", hex_paper, hexp.tokens_per_s, "prediction"),
            Row("4", f"{size} cost per token, 24 H800 / hex", "x", 126.72 / 86.64 * optimised / hex_paper,
                per_token, "prediction"),
            Row("Fig3", f"{size} same budget, hex / all-H800", "x", vs_h800,
                hexp.tokens_per_s / h800_budget.tokens_per_s, "prediction"),
            Row("Fig3", f"{size} same budget, hex / all-H20", "x", vs_h20,
                hexp.tokens_per_s / h20_budget.tokens_per_s, "prediction"),
        ]
    cost_rows = [r for r in rows if "cost per token" in r.row]
    rows.append(Row("4", "mean cost per token, 24 H800 / hex", "x", 1.46,
                    sum(r.ours for r in cost_rows) / len(cost_rows), "prediction"))
    return rows


TOLERANCE = 0.15  # a row within this share of the paper needs no explanation
MISSES = {
    "1.5B weight sync, 24 H800": "the paper's sync time is not proportional to the weight bytes (1.34, 0.97, 0.88 s "
    "per GB for 1.5B, 7B, 14B); one bandwidth factor splits the difference. A fixed cost plus bandwidth would fit "
    "this column within 4% but miss the hex column by up to 27%: the paper does not say how its sync runs (broadcast "
    "tree, sharded over links, through disk), so neither mechanism is pinned",
    "14B weight sync, 24 H800": "as for 1.5B: the per-GB sync time falls with model size in the paper, not in a "
    "bandwidth model",
    "1.5B weight sync, 8 H800 + 24 H20": "as for the H800 column: on the hex cluster the paper's 1.5B sync takes 2.8 s "
    "per GB, its 7B and 14B 3.8 s per GB",
    "7B uniform, 24 H800": "the paper does not give the uniform baseline's parallelism; ours gives each half its best "
    "layout (the 1.5B and 14B uniform rows are within 13%)",
    "7B cost per token, 24 H800 / hex": "compounds two rows within 15%: 7B on 8 H800 + 24 H20 (0.86) and optimised on "
    "24 H800 (1.03)",
    "1.5B same budget, hex / all-H20": "Table 1's H20 costs (fitted), Table 3's H800 rows and Table 4's hex rows "
    "leave an all-H20 cluster within 1.4-1.9x of hex even with a free weight sync; the paper's 2.3-2.8x needs H20 "
    "training 3-4x slower than Table 1 measures (H20.train 0.2-0.25 gives these rows, and a training $/token ratio "
    "of 9-12x instead of 3.12x). The paper gives neither the all-H20 baseline's device count, split and "
    "parallelism nor its batch size",
    "7B same budget, hex / all-H20": "as for 1.5B",
    "14B same budget, hex / all-H20": "as for 1.5B",
    "14B same budget, hex / all-H800": "training memory is now the estimator's (sched/memory.py, within 5% of measured "
    "CPU peaks and 6% of an H200 torch-engine step): it counts the LM head's logits (bf16 out, float32 softmax) and "
    "1F1B's in-flight micro-batches, so fewer 14B training layouts fit an 80 GB H800 than under the former rough "
    "formula (which put this row at 1.15) and the all-H800 plan of this budget is slower. The paper gives neither "
    "its micro-batch size nor this baseline's parallelism, which set that memory",
}


NOTES = [
    "fit rows calibrate five factors by least squares on log ratios: overall, decode_hbm and sync on the homogeneous "
    "H800 rows (H800 is the reference device), H20.train and H20.decode on Table 1's cost ratios, the only published "
    "numbers on H20 alone; prediction rows were not used to fit. Devices without published rows (H100, A100, L40S, "
    "Ascend 910B) keep factor 1",
    "the fitted overall factor (~0.26) says the paper's end-to-end tokens/s is ~4x below our rooflines at typical "
    "kernel efficiencies; AReaL's Table 7 on the same H800s needs ~0.6 (`repro areal-eta`): the two papers' "
    "tokens/s are not on one scale, so only ratios carry over between them",
    "the paper prints no batch size: 64 sequences/step is assumed; it sets how much the 1.5 GB/s weight sync "
    "costs the hex plan. With 512 sequences/step (`--sequences 512`) the sync hardly matters and hex's edge grows",
    "cost per token rows: the paper's value is its $/h ratio (1.46x) times its own throughput ratio; the mean row "
    "compares with the headline 1.46x",
    "simplifications: training groups use one device type each (data parallel across types with the batch split "
    "by speed, not pipeline stages across types); rollout replicas use one device type; machines of one pool "
    "are interchangeable, so the device split is a count per pool",
] + [f"{row} (more than {TOLERANCE:.0%} off): {why}" for row, why in MISSES.items()]
