"""AReaL's throughput-vs-staleness table (Table 7) beside the simulator's (``areal-hpc repro areal-eta``).

One plan (1.5B on one machine of 8 H800, planned for asynchronous RL) is simulated at every η
with long-tailed answer lengths. The cost model's default efficiencies are used with one global factor
(``overall``) fitted to the η = 0 row (AReaL's absolute tokens/s and AReaL-Hex's are not on one
scale); the η > 0 rows and the interruption gains are predictions.
"""

from __future__ import annotations

import numpy as np

from areal_hpc.sched.calibrate import Measurement, fit_efficiency
from areal_hpc.sched.cost import CostModel, Efficiency, Workload
from areal_hpc.sched.hardware import make_cluster
from areal_hpc.sched.model_spec import load_model_spec
from areal_hpc.sched.planner import HeteroPlanner
from areal_hpc.sched.report import plan_dict
from areal_hpc.sched.repro_hex import Row
from areal_hpc.sched.simulator import sample_lengths, simulator_for_plan

PAPER = {0: 27.1e3, 1: 47.8e3, 2: 47.8e3, 4: 49.0e3, 8: 51.5e3, 16: 52.0e3}
INTERRUPTIBLE_GAIN = {"1.5B": ("r1-distill-qwen-1.5b", 1.12), "7B": ("r1-distill-qwen-7b", 1.17)}
# 8k context: short math prompts, answers long-tailed up to the context (AReaL's setting).
WORKLOAD = Workload(prompts=64, answers=16, prompt_len=256, gen_mean=4500, gen_max=7936)
SPREAD, STEPS = 0.6, 12  # log-normal spread: about 10% of answers reach the context limit
# Written by `areal-hpc repro areal-eta --calibrate`, fitted to the η = 0 row.
OVERALL = 0.597


def eight_h800():
    return make_cluster("areal-8h800", [("H800", "H800", 1, 8)], {})


def simulate(
    eta: int, efficiency: Efficiency, model: str = "r1-distill-qwen-1.5b", interruptible: bool = True
) -> float:
    cost = CostModel(load_model_spec(model), WORKLOAD, efficiency)
    cluster = eight_h800()
    plan = plan_dict(HeteroPlanner(cluster, cost, staleness=4).plan(), cluster, model, WORKLOAD)
    lengths = sample_lengths(
        np.random.default_rng(0), WORKLOAD.sequences * (STEPS + 20 + eta), WORKLOAD.gen_mean, WORKLOAD.gen_max, SPREAD
    )
    return simulator_for_plan(plan, eta, interruptible).run(lengths, STEPS).tokens_per_s


def calibrate() -> float:
    fitted = fit_efficiency(
        [Measurement("eta 0", PAPER[0], lambda e: simulate(0, e))], ["overall"], Efficiency(overall=OVERALL)
    )
    return fitted.overall


def eta_rows(overall: float = OVERALL) -> list[Row]:
    e = Efficiency(overall=overall)
    rows = [
        Row("7", f"eta {eta}", "tok/s", paper, simulate(eta, e), "fit" if eta == 0 else "prediction")
        for eta, paper in PAPER.items()
    ]
    for size, (model, gain) in INTERRUPTIBLE_GAIN.items():
        ours = simulate(8, e, model) / simulate(8, e, model, interruptible=False)
        rows.append(Row("text", f"{size} interruptible / not, eta 8", "x", gain, ours, "prediction"))
    return rows


NOTES = [
    "the eta 0 row calibrates one global factor (overall, 0.60 against the cost model's default efficiencies); "
    "the other rows are predictions of the simulator on the same plan",
    "the workload is assumed (AReaL prints the context, not the length distribution): 256-token prompts, answers "
    "log-normal with mean 4,500 and spread 0.6, cut at the 8k context (~10% cut)",
    "eta 1 is within 5%; eta >= 2 saturates at ~2.1x eta 0 where AReaL measured 1.8-1.9x, climbing slowly to eta 16: "
    "the simulator's rollout never slows as staler data piles up (no KV-cache pressure, no queueing)",
    "non-interruptible generation is modelled as draining: no new sequence starts until every in-flight one "
    "ends, then the weights load. That idles the slots behind the longest answer, so the simulated gain of "
    "interruption (1.6x) is larger than AReaL's measured +12% / +17%, whose servers keep the batch fuller",
]
