"""AReaL-Hex's planner: split the devices between training and rollout, pick each side's parallelism.

For a training share γ of the compute, a device split (graph partition, plus a ratio-ordered seed)
gets its training plan by a constrained search (dp x tp x pp groups of one device type, chosen for
their combined step) and its rollout plan by the MILP, once per set of pools close enough for the
weight sync (a pool behind a slow link may stay idle); γ is binary-searched until training and
rollout step times balance, then local moves refine the split. A cluster with at most
``EXHAUSTIVE_LIMIT`` device splits has every split evaluated instead: exact under the cost model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from areal_hpc.errors import UserError
from areal_hpc.sched.cost import CostModel, PoolTrainLayout, powers_of_two
from areal_hpc.sched.hardware import Cluster
from areal_hpc.sched.partition import metis_split, ratio_split
from areal_hpc.sched.rollout_milp import RolloutMILP, RolloutPlan

EXHAUSTIVE_LIMIT = 512  # device splits: enumerate them all up to this many (8 H800 + 48 H20: 9 x 49)
REFINE_STARTS = 4  # hill climbs, from the best distinct splits the search found
CHEAPEST = 1e-9  # tokens/s: a min-cost target every plan meets, so the cheapest plan


@dataclass(frozen=True)
class Plan:
    """A placement and its predicted step: step = max(train, generation) + weight sync (η = 0: their sum)."""

    train: tuple[PoolTrainLayout, ...]
    rollout: RolloutPlan
    train_s: float
    generation_s: float
    sync_s: float
    staleness: int
    step_tokens: int
    train_price: float

    @property
    def step_s(self) -> float:
        if self.staleness == 0:
            return self.train_s + self.generation_s + self.sync_s
        return max(self.train_s, self.generation_s) + self.sync_s

    @property
    def tokens_per_s(self) -> float:
        return self.step_tokens / self.step_s

    @property
    def price_per_hour(self) -> float:
        return self.train_price + self.rollout.price_per_hour

    @property
    def allocation(self) -> str:
        """The allocation string (docs/tutorials/planning.md), e.g. ``sglang:d12t2+megatron:d1p1t8``."""
        parts = [f"sglang:d{y}t{r.tp}" + (f"p{r.pp}" if r.pp > 1 else "") for r, y in self.rollout.replicas]
        parts += [f"megatron:d{g.dp}p{g.pp}t{g.tp}" for g in self.train]
        return "+".join(parts)


class HeteroPlanner:
    """Plans one model on one cluster; ``plan()`` returns the best ``Plan`` for the objective.

    Objectives: ``max-throughput`` (optionally under ``budget`` $/h; devices left idle cost nothing)
    or ``min-cost`` (the cheapest plan reaching ``target`` tokens/s).
    """

    def __init__(
        self,
        cluster: Cluster,
        cost: CostModel,
        staleness: int = 4,
        budget: float = math.inf,
        objective: str = "max-throughput",
        target: float | None = None,
    ):
        if objective == "min-cost" and not target:
            raise UserError("--objective min-cost needs --target-throughput TOKENS_PER_S (a positive number)")
        self.cluster, self.cost, self.staleness = cluster, cost, staleness
        self.budget, self.objective, self.target = budget, objective, target
        self.pools = {p.name: p for p in cluster.pools}
        self.evaluated: dict[tuple, Plan | None] = {}

    def evaluate(self, train_counts: dict[str, int]) -> Plan | None:
        """The plan with exactly ``train_counts`` training devices per pool (None: infeasible)."""
        key = tuple(train_counts.get(name, 0) for name in self.pools)
        if key not in self.evaluated:
            self.evaluated[key] = self._evaluate(dict(zip(self.pools, key)))
        return self.evaluated[key]

    def _evaluate(self, counts: dict[str, int]) -> Plan | None:
        cl, cost = self.cluster, self.cost
        used = [name for name, n in counts.items() if n > 0]
        layouts = [cost.train_layouts(self.pools[name], counts[name], cl.bandwidth(name, name)) for name in used]
        if not layouts or not all(layouts):
            return None
        groups, train_s = cost.fastest_train(layouts, min(cl.bandwidth(a, b) for a in used for b in used))
        train_price = sum(counts[name] * self.pools[name].device.price_per_hour for name in used)
        free = {name: pool.devices - counts[name] for name, pool in self.pools.items() if pool.devices > counts[name]}
        # The weight sync runs over the slowest link from a training pool to a rollout pool used, so a
        # pool behind a slow link may be better left idle: try every link speed as the slowest allowed.
        link = {name: min(cl.bandwidth(a, name) for a in used) for name in free}
        best = None
        for slowest in sorted(set(link.values()), reverse=True):
            allowed = {name: n for name, n in free.items() if link[name] >= slowest}
            plan = self._with_rollout(groups, train_s, train_price, allowed, cost.weight_sync_s(slowest))
            if self.better(plan, best):
                best = plan
        return best

    def _with_rollout(
        self, groups, train_s: float, train_price: float, free: dict[str, int], sync_s: float
    ) -> Plan | None:
        """The best plan training on ``groups`` and generating on ``free`` devices per pool, the weight
        sync taking at most ``sync_s``: the MILP finds the best rate (or price), then, at that score, the
        cheapest (or fastest) replicas."""
        cl, cost, w = self.cluster, self.cost, self.cost.workload
        replicas = [
            r for name, n in free.items() for r in cost.rollout_replicas(self.pools[name], n, cl.bandwidth(name, name))
        ]
        milp = RolloutMILP(replicas, free)
        if self.objective == "max-throughput":
            cap = self.budget - train_price
            fastest = milp.solve(max_price=cap)
            if fastest is None or not fastest.replicas:
                return None
            # Past the training time (η > 0) a faster rollout gains nothing: take the cheapest that keeps up.
            needed = fastest.tokens_per_s if self.staleness == 0 else min(fastest.tokens_per_s, w.step_tokens / train_s)
            rollout = milp.solve(max_price=cap, min_rate=needed * (1 - 1e-9)) or fastest
        else:
            left_s = w.step_tokens / (self.target * (1 - 1e-9)) - sync_s  # the target step (to 1e-9), less the sync
            window = left_s - train_s if self.staleness == 0 else left_s  # what generation may take
            if train_s > left_s or window <= 0:
                return None
            cheapest = milp.solve(min_rate=w.step_tokens / window)
            if cheapest is None or not cheapest.replicas:
                return None
            rollout = milp.solve(max_price=cheapest.price_per_hour * (1 + 1e-9)) or cheapest
        sync_gbs = min(cl.bandwidth(g.pool, r.pool) for g in groups for r, _ in rollout.replicas)
        return Plan(
            groups,
            rollout,
            train_s,
            w.step_tokens / rollout.tokens_per_s,
            cost.weight_sync_s(sync_gbs),
            self.staleness,
            w.step_tokens,
            train_price,
        )

    def score(self, plan: Plan) -> tuple:
        """Larger is better under the objective: first the objective, then the other key as a tie-break."""
        if self.objective == "min-cost":
            return -plan.price_per_hour, plan.tokens_per_s
        return plan.tokens_per_s, -plan.price_per_hour

    def better(self, a: Plan | None, b: Plan | None) -> bool:
        """Whether plan ``a`` beats plan ``b`` under the objective (keys equal to 1e-9 tie)."""
        if a is None or b is None:
            return b is None and a is not None
        for x, y in zip(self.score(a), self.score(b)):
            if not math.isclose(x, y, rel_tol=1e-9):
                return x > y
        return False

    def _best(self, candidates) -> Plan | None:
        return self._best_plan(self.evaluate(counts) for counts in candidates)

    def _best_plan(self, plans) -> Plan | None:
        best = None
        for plan in plans:
            if self.better(plan, best):
                best = plan
        return best

    def plan(self, exhaustive: bool | None = None) -> Plan:
        """The best plan: every device split evaluated when there are at most ``EXHAUSTIVE_LIMIT`` of
        them (or ``exhaustive``), else the search's."""
        splits = math.prod(p.devices + 1 for p in self.cluster.pools)
        if exhaustive if exhaustive is not None else splits <= EXHAUSTIVE_LIMIT:
            ranges = [range(p.devices + 1) for p in self.cluster.pools]
            best = self._best(dict(zip(self.pools, c)) for c in itertools.product(*ranges))
        else:
            best = self._search()
        if best is None:
            raise UserError(self._why_infeasible())
        return best

    def _search(self) -> Plan | None:
        """Partition seeds over a binary search on the training share, single-pool and whole-pool seeds,
        then hill climbs from the best few."""
        self._search_share()
        self._seed_pools()
        # Multi-start: splits that train on several pools pay a cross-pool all-reduce, so the
        # landscape has several hills; climb from the best few distinct starting points.
        starts = sorted((p for p in self.evaluated.values() if p is not None), key=self.score, reverse=True)
        starts = starts[:REFINE_STARTS]
        # A high target can leave every seed short, and a low budget every seed too dear: climb from the
        # fastest plan (which meets any target that can be met) and the cheapest one (within any budget) too.
        if self.objective == "min-cost":
            starts.append(HeteroPlanner(self.cluster, self.cost, self.staleness)._search())
        elif self.budget < math.inf:
            starts.append(
                HeteroPlanner(self.cluster, self.cost, self.staleness, objective="min-cost", target=CHEAPEST)._search()
            )
        return self._best_plan(self._refine(start and self.evaluate(self._counts(start))) for start in starts)

    def _search_share(self) -> None:
        """Binary search on γ: more training compute while training is the slower side."""
        low, high = 0.0, 1.0
        for _ in range(14):
            share = (low + high) / 2
            seeds = [metis_split(self.cluster, share), ratio_split(self.cluster, share)]
            if self._needs_more_training(seeds, [self.evaluate(s) for s in seeds]):
                low = share
            else:
                high = share

    def _seed_pools(self) -> None:
        """Seeds the shares can miss: one pool alone training a move size of devices or all but a move
        size (the rest generating), and whole pools together."""
        self._best({name: n} for name, p in self.pools.items() for k in move_sizes(p) for n in {k, p.devices - k} if n)
        for size in range(2, len(self.pools) + 1):
            self._best(
                {name: self.pools[name].devices for name in chosen}
                for chosen in itertools.combinations(self.pools, size)
            )

    def _needs_more_training(self, seeds, plans) -> bool:
        feasible = [p for p in plans if p is not None]
        if not feasible:  # nothing trains (too few training devices) or nothing is left for rollout
            return any(self._train_infeasible(s) for s in seeds)
        plan = max(feasible, key=lambda p: p.tokens_per_s)
        if self.objective == "min-cost":
            return False  # feasible already: try a smaller, cheaper training share
        # A training-bound plan's rollout is cut down to just keep up: its generation then ends at
        # most as late as training does, a rollout-bound one's later.
        return plan.generation_s <= plan.train_s * (1 + 1e-6)

    def _train_infeasible(self, counts) -> bool:
        return any(
            self.cost.train_group(self.pools[n], c, self.cluster.bandwidth(n, n)) is None
            for n, c in counts.items()
            if c > 0
        ) or not any(counts.values())

    def _refine(self, best: Plan | None) -> Plan | None:
        """Hill-climb over moves of 1, 2, 4, .. devices per pool (and between two pools)."""
        if best is None:
            return None
        while True:
            counts = self._counts(best)
            moves = [{name: d} for name, p in self.pools.items() for k in move_sizes(p) for d in (k, -k)]
            moves += [
                {a: k, b: -k} for a in self.pools for b in self.pools if a != b for k in move_sizes(self.pools[a])
            ]
            # a pool leaves training, or joins it with all but a move size of its devices (the rest
            # generating): drops (or adds) a cross-pool all-reduce at once
            moves += [{name: -counts[name]} for name in self.pools] + [
                {name: p.devices - k - counts[name]} for name, p in self.pools.items() for k in {0} | move_sizes(p)
            ]
            candidates = []
            for move in moves:
                moved = {name: counts[name] + move.get(name, 0) for name in self.pools}
                if all(0 <= n <= self.pools[name].devices for name, n in moved.items()):
                    candidates.append(moved)
            step = self._best(candidates)
            if not self.better(step, best):
                return best
            best = step

    def _counts(self, plan: Plan) -> dict[str, int]:
        counts = dict.fromkeys(self.pools, 0)
        for group in plan.train:
            counts[group.pool] += group.devices
        return counts

    def _why_infeasible(self) -> str:
        m = self.cost.model
        fits = [
            p.name
            for p in self.cluster.pools
            if any(self.cost.train_group(p, n, self.cluster.bandwidth(p.name, p.name)) for n in range(1, p.devices + 1))
        ]
        if not fits:
            return (
                f"model {m.name} ({m.params / 1e9:.1f}B parameters) fits on no training group of cluster "
                f"{self.cluster.name} ({self.cluster.summary()}); add devices or pick a smaller model"
            )
        if self.objective == "min-cost":
            return (
                f"no plan on {self.cluster.name} reaches --target-throughput {self.target:,.0f} tokens/s; "
                f"lower the target or add devices"
            )
        if self.budget < math.inf:
            return (
                f"--budget-per-hour {self.budget:g} is below the cheapest feasible plan on {self.cluster.name} "
                f"(one training group plus one rollout replica); raise the budget"
            )
        return (
            f"model {m.name} leaves no devices for rollout on {self.cluster.name} ({self.cluster.summary()}); "
            f"add devices or pick a smaller model"
        )


def move_sizes(pool) -> set[int]:
    """Device counts to move at once: powers of two up to the pool, and one machine."""
    return set(powers_of_two(pool.devices)) | {pool.per_node}
