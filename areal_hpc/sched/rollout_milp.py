"""AReaL-Hex's rollout MILP, solved with HiGHS: how many replicas of each configuration ψ to run.

The printed model is bilinear (workload x_ψ times 1/y_ψ). The workload is continuous, so at the
optimum every replica finishes together (x_ψ ∝ y_ψ·h_ψ) and Θ = B·len / Σ y_ψ·h_ψ: minimising Θ
is maximising Σ y_ψ·h_ψ, a linear integer program over the replica counts y_ψ alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import highspy
import numpy as np

from areal_hpc.sched.cost import RolloutReplica


@dataclass(frozen=True)
class RolloutPlan:
    """Replica counts per configuration, the rollout token rate and its price."""

    replicas: tuple[tuple[RolloutReplica, int], ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s * y for r, y in self.replicas)

    @property
    def price_per_hour(self) -> float:
        return sum(r.price_per_hour * y for r, y in self.replicas)

    def devices(self, pool: str | None = None) -> int:
        return sum(r.devices * y for r, y in self.replicas if pool is None or r.pool == pool)


class RolloutMILP:
    """Replica counts y_ψ for the configurations ``replicas`` on ``available[pool]`` devices per pool.

    ``solve()`` maximises the token rate within an optional price cap; ``solve(min_rate=R)``
    instead finds the cheapest set of replicas (one at least) whose rate reaches R, within the cap
    too. Both return None if infeasible.
    """

    def __init__(self, replicas: list[RolloutReplica], available: dict[str, int]):
        self.replicas, self.available = undominated(replicas), available

    def solve(self, max_price: float = float("inf"), min_rate: float | None = None) -> RolloutPlan | None:
        if not self.replicas:
            return RolloutPlan(()) if min_rate is None or min_rate <= 0 else None
        h = quiet_highs()
        rate = np.array([r.tokens_per_s for r in self.replicas])
        price = np.array([r.price_per_hour for r in self.replicas])
        y = [h.addIntegral(lb=0, ub=self.available[r.pool] // r.devices) for r in self.replicas]
        for pool, count in self.available.items():
            members = [(v, r.devices) for v, r in zip(y, self.replicas) if r.pool == pool]
            if members:
                h.addConstr(sum(v * d for v, d in members) <= count)
        spend = sum(v * p for v, p in zip(y, price))
        served = sum(v * q for v, q in zip(y, rate / rate.max()))  # scaled: HiGHS tolerances are absolute
        if max_price < float("inf"):
            h.addConstr(spend <= max_price)
        if min_rate is None:
            h.maximize(served)
        else:
            h.addConstr(served >= min_rate / rate.max())
            h.addConstr(sum(y) >= 1)  # a plan generates: at least one replica, however low the rate asked
            h.minimize(spend)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        counts = np.rint(h.vals(y)).astype(int)
        return RolloutPlan(tuple((r, int(c)) for r, c in zip(self.replicas, counts) if c > 0))


def undominated(replicas: list[RolloutReplica]) -> list[RolloutReplica]:
    """The configurations that no mix of the same pool's smaller (or equal) ones matches in rate on at
    most as many devices. A replica's price is its devices' price, so such a mix also costs no more:
    swapping it in keeps every plan feasible and at least as good, and the MILP shrinks (a plan's
    cheapest-cover solve is otherwise slow)."""
    kept = []
    for pool in dict.fromkeys(r.pool for r in replicas):
        mine = sorted((r for r in replicas if r.pool == pool), key=lambda r: (r.devices, -r.tokens_per_s))
        best = [0.0] * (mine[-1].devices + 1)  # the best rate of the kept configurations on at most k devices
        for r in mine:
            if r.tokens_per_s <= best[r.devices]:
                continue
            kept.append(r)
            for k in range(r.devices, len(best)):  # unbounded knapsack: any number of replicas of r
                best[k] = max(best[k], best[k - 1], best[k - r.devices] + r.tokens_per_s)
    return kept


def quiet_highs() -> highspy.Highs:
    """A silent, single-threaded HiGHS instance. highspy >= 1.16 prints a banner on stdout when a
    process builds its first one, before any option can be set: stdout points at /dev/null meanwhile,
    so that ``areal-hpc plan --json`` prints JSON only. These MILPs have a few dozen variables: worker
    threads and the feasibility-jump heuristic cost ~10 ms of start-up per solve, the solve itself <1 ms."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    return h
