"""AReaL-Hex's rollout MILP, solved with HiGHS: how many replicas of each configuration ψ to run.

The printed model is bilinear (workload x_ψ times 1/y_ψ). The workload is continuous, so at the
optimum every replica finishes together (x_ψ ∝ y_ψ·h_ψ) and Θ = B·len / Σ y_ψ·h_ψ: minimising Θ
is maximising Σ y_ψ·h_ψ, a linear integer program over the replica counts y_ψ alone.
"""

from __future__ import annotations

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
    instead finds the cheapest set of replicas whose rate reaches R. Both return None if infeasible.
    """

    def __init__(self, replicas: list[RolloutReplica], available: dict[str, int]):
        self.replicas, self.available = replicas, available

    def solve(self, max_price: float = float("inf"), min_rate: float | None = None) -> RolloutPlan | None:
        if not self.replicas:
            return RolloutPlan(()) if min_rate is None or min_rate <= 0 else None
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 1e-9)
        rate = np.array([r.tokens_per_s for r in self.replicas])
        price = np.array([r.price_per_hour for r in self.replicas])
        y = [h.addIntegral(lb=0, ub=self.available[r.pool] // r.devices) for r in self.replicas]
        for pool, count in self.available.items():
            members = [(v, r.devices) for v, r in zip(y, self.replicas) if r.pool == pool]
            if members:
                h.addConstr(sum(v * d for v, d in members) <= count)
        spend = sum(v * p for v, p in zip(y, price))
        served = sum(v * q for v, q in zip(y, rate / rate.max()))  # scaled: HiGHS tolerances are absolute
        if min_rate is None:
            if max_price < float("inf"):
                h.addConstr(spend <= max_price)
            h.maximize(served)
        else:
            h.addConstr(served >= min_rate / rate.max())
            h.minimize(spend)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        counts = np.rint(h.vals(y)).astype(int)
        return RolloutPlan(tuple((r, int(c)) for r, c in zip(self.replicas, counts) if c > 0))
