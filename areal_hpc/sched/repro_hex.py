"""AReaL-Hex's published tables beside the planner's predictions (``areal-hpc repro hex``).

The cost model's phases are rooflines on the devices' datasheet figures (``cost.py``). Four global
efficiency factors are fitted to the homogeneous H800 rows (Table 3, Table 2's H800 column) and Table 1's
two cost ratios, and one device factor (H20's training) to Table 1's training ratio; every heterogeneous
and same-budget row is then a prediction. Rows say which is which; ``MISSES`` says, row by row, why a row
is more than 15% off the paper.
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
PRICE = {"H800": 5.28, "H20": 1.85}  # $/h per device, the paper's
BUDGET = 86.64  # $/h of 8 H800 + 24 H20, the paper's same-budget line
TABLE1 = {"inference": 2.72, "training": 3.12}  # cost per token: H20 cheaper to generate, H800 to train
PAPER = {  # per model: (uniform, optimised) on 24 H800, hex throughput, sync H800, sync hex, vs H800, vs H20
    "1.5B": (1.17e4, 1.84e4, 1.79e4, 4.75, 10.06, 1.36, 2.80),
    "7B": (3.57e3, 5.98e3, 6.00e3, 14.79, 58.34, 1.31, 2.76),
    "14B": (1.29e3, 2.16e3, 2.30e3, 26.00, 112.93, 1.50, 2.29),
}
# Global factors, and H20's training factor (Table 1's training ratio needs H20 slower than its FLOP/s;
# see NOTES). decode_hbm and decode_mfu set where decode turns from HBM-bound to compute-bound, which
# Table 1's generation ratio pins: H20 has 1.19x an H800's HBM bandwidth but 0.15x its FLOP/s.
FITTED = ("overall", "decode_hbm", "decode_mfu", "sync", "H20.train")
# Written from `areal-hpc repro hex --calibrate`, fitted to the rows marked "fit".
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
        return {
            "table": self.table,
            "row": self.row,
            "unit": self.unit,
            "paper": self.paper,
            "ours": round(self.ours, 4 if self.unit == "x" else 1),
            "ratio": round(self.ratio, 3),
            "role": self.role,
        }


def planner(
    cluster: str, size: str, efficiency: Efficiency, workload: Workload = WORKLOAD, budget: float = float("inf")
) -> HeteroPlanner:
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
    rows = [
        Measurement(f"{side} cost ratio", ratio, lambda e, side=side: cost_per_token_ratio(e, side, w))
        for side, ratio in TABLE1.items()
    ]
    for size, (uniform, optimised, _, sync_h800, *_) in PAPER.items():
        rows += [
            Measurement(
                f"{size} uniform",
                uniform,
                lambda e, s=size: uniform_split(planner("paper-24h800", s, e, w)).tokens_per_s,
            ),
            Measurement(
                f"{size} optimised", optimised, lambda e, s=size: planner("paper-24h800", s, e, w).plan().tokens_per_s
            ),
            Measurement(f"{size} sync", sync_h800, lambda e, s=size: planner("paper-24h800", s, e, w).plan().sync_s),
        ]
    return rows


def calibrate(workload: Workload = WORKLOAD) -> Efficiency:
    return fit_efficiency(measurements(workload), list(FITTED), CALIBRATED)


def describe(e: Efficiency) -> str:
    return ", ".join(f"{name} {e.factor(name):.3g}" for name in FITTED) + " (fitted)"


def hex_rows(e: Efficiency = CALIBRATED, w: Workload = WORKLOAD) -> list[Row]:
    rows = [
        Row(
            "1",
            "7B generation $/token, H800 / H20",
            "x",
            TABLE1["inference"],
            cost_per_token_ratio(e, "inference", w),
            "fit",
        ),
        Row(
            "1",
            "7B training $/token, H20 / H800",
            "x",
            TABLE1["training"],
            cost_per_token_ratio(e, "training", w),
            "fit",
        ),
    ]
    for size, (uniform, optimised, hex_paper, sync_h800, sync_hex, vs_h800, vs_h20) in PAPER.items():
        h800, hexp = planner("paper-24h800", size, e, w).plan(), planner("paper-8h800-24h20", size, e, w).plan()
        h800_budget = planner("paper-24h800", size, e, w, BUDGET).plan()
        h20_budget = planner("paper-48h20", size, e, w, BUDGET).plan()
        per_token = (h800.price_per_hour / h800.tokens_per_s) / (hexp.price_per_hour / hexp.tokens_per_s)
        rows += [
            Row(
                "3",
                f"{size} uniform, 24 H800",
                "tok/s",
                uniform,
                uniform_split(planner("paper-24h800", size, e, w)).tokens_per_s,
                "fit",
            ),
            Row("3", f"{size} optimised, 24 H800", "tok/s", optimised, h800.tokens_per_s, "fit"),
            Row("2", f"{size} weight sync, 24 H800", "s", sync_h800, h800.sync_s, "fit"),
            Row("2", f"{size} weight sync, 8 H800 + 24 H20", "s", sync_hex, hexp.sync_s, "prediction"),
            Row("4", f"{size} 8 H800 + 24 H20", "tok/s", hex_paper, hexp.tokens_per_s, "prediction"),
            Row(
                "4",
                f"{size} cost per token, 24 H800 / hex",
                "x",
                126.72 / 86.64 * hex_paper / optimised,
                per_token,
                "prediction",
            ),
            Row(
                "Fig3",
                f"{size} same budget, hex / all-H800",
                "x",
                vs_h800,
                hexp.tokens_per_s / h800_budget.tokens_per_s,
                "prediction",
            ),
            Row(
                "Fig3",
                f"{size} same budget, hex / all-H20",
                "x",
                vs_h20,
                hexp.tokens_per_s / h20_budget.tokens_per_s,
                "prediction",
            ),
        ]
    cost_rows = [r for r in rows if "cost per token" in r.row]
    rows.append(
        Row(
            "4",
            "mean cost per token, 24 H800 / hex",
            "x",
            1.46,
            sum(r.ours for r in cost_rows) / len(cost_rows),
            "prediction",
        )
    )
    return rows


def all_h20_bound() -> float:
    """The most hex (8 H800 + 24 H20) can beat Fig. 3's same-budget all-H20 cluster by, from Table 1 alone.

    Table 1 puts an H20 at 1 / (3.12 x 5.28/1.85) = 0.112 of an H800's training tokens/s and 2.72 / (5.28/1.85)
    = 0.953 of its generation tokens/s. If a cluster's tokens/s add up over its devices, hex trains like
    8 + 24 x 0.112 = 10.7 H800s and generates like 30.9, and 46 H20 (the budget's) like 5.2 and 43.8: whatever
    share of the work is training, hex is at most 10.7 / 5.2 = 2.07x faster (before its slower weight sync).
    """
    per_h800 = PRICE["H800"] / PRICE["H20"]
    speed = {"training": 1 / (TABLE1["training"] * per_h800), "inference": TABLE1["inference"] / per_h800}
    h20 = int(BUDGET // PRICE["H20"])
    return max((8 + 24 * s) / (h20 * s) for s in speed.values())


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
    "1.5B same budget, hex / all-H20": f"the paper's own numbers cap this ratio at {all_h20_bound():.2f}x: Table 1 "
    "puts an H20 at 0.112 of an H800's training speed and 0.953 of its generation speed, so 46 H20 ($85.1/h) train "
    "like 5.2 H800s and generate like 43.8, hex's 8 H800 + 24 H20 like 10.7 and 30.9; with tokens/s that add up over "
    "devices no split makes hex more than 10.7 / 5.2 faster, and its weight sync over 1.5 GB/s (Table 2: 58 s for "
    "7B, against 15 s over 5 GB/s) only lowers that. Ours is 1.5-1.8x with a free sync, 1.0-1.1x with it. Even "
    "that cap reaches the paper's 2.3-2.8x only with an H20 training at 0.076-0.098 of an H800 (Table 1: 0.112); "
    "the paper gives neither the all-H20 baseline's split and parallelism nor its batch size",
    "7B same budget, hex / all-H20": "as for 1.5B",
    "14B same budget, hex / all-H20": "as for 1.5B",
    "14B same budget, hex / all-H800": "the paper's 16 H800 ($84.5/h) reach 2,300 / 1.50 = 1,533 tok/s, 0.71 of its "
    "24 H800's 2,160: they scale at least in proportion to the devices (16/24 = 0.67). Ours fall to 0.57 (1,147 of "
    "2,009): a 14B trainer needs 6 H800 in both (the memory estimator, sched/memory.py: 59 GB of bf16 weights and "
    "gradients, 177 GB of float32 Adam state and the LM head's logits of a 16k-token micro-batch, on 80 GB "
    "devices), so only the rollout side shrinks (18 to 10 devices) and the plan is generation-bound. The paper "
    "gives neither its micro-batch size nor this baseline's parallelism: with 8k-token micro-batches a 14B trainer "
    "fits on 4 H800 and this row is 1.09",
}


NOTES = [
    "each phase is a roofline on the datasheet figures (hardware.py): prefill max(2·params·prompt FLOPs, one read of "
    "the weights), decode max(weights + KV read over HBM bandwidth, 2·params·batch FLOPs) with the batch bounded by "
    "the KV slots memory leaves, training 8·params FLOPs a token with the pipeline bubble and TP/PP traffic, weight "
    "sync the bf16 weights over the slowest link. The factors are global, so an H20 (4.0 TB/s, 148 TFLOP/s) decodes "
    "HBM-bound at small batches and compute-bound at large ones, an H800 (3.35 TB/s, 989 TFLOP/s) HBM-bound always",
    "fit rows calibrate five factors by least squares on log ratios: overall, decode_hbm, decode_mfu and sync "
    "(global) on the homogeneous H800 rows and Table 1's cost ratios, H20.train on Table 1's training ratio; "
    "prediction rows were not used to fit. decode_mfu against decode_hbm sets where decode turns compute-bound, "
    "which Table 1's generation ratio pins (2.72x, where HBM bandwidth alone would give 4.0/3.35 x 5.28/1.85 = 3.4x)",
    "H20.train (0.75) is the one device factor left: at the paper's prices and the datasheets' 148 and 989 TFLOP/s "
    "H20's training $/token would be 2.34x an H800's, Table 1 measures 3.12x. An H20 has more HBM bandwidth and "
    "NVLink than an H800, so no roofline term makes it train slower than its FLOP/s share. Devices without "
    "published rows (H100, A100, L40S, Ascend 910B) keep factor 1",
    "the fitted overall factor (~0.26) says the paper's end-to-end tokens/s is ~4x below our rooflines at typical "
    "kernel efficiencies; AReaL's Table 7 on the same H800s needs ~0.6 (`repro areal-eta`): the two papers' "
    "tokens/s are not on one scale, so only ratios carry over between them",
    "the paper prints no batch size: 64 sequences/step is assumed; it sets how much the 1.5 GB/s weight sync "
    "costs the hex plan. With 512 sequences/step (`--sequences 512`) the sync hardly matters and hex's edge grows",
    "cost per token rows: the paper's value is its $/h ratio (1.46x) times hex's tokens/s over 24 H800's (Table 4); "
    "the mean row compares with the headline 1.46x",
    "simplifications: training groups use one device type each (data parallel across types with the batch split "
    "by speed, not pipeline stages across types); rollout replicas use one device type; machines of one pool "
    "are interchangeable, so the device split is a count per pool",
] + [f"{row} (more than {TOLERANCE:.0%} off): {why}" for row, why in MISSES.items()]
