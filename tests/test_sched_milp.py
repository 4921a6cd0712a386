"""The rollout MILP and the planner against brute-force enumeration of the same cost model."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.errors import UserError
from areal_hpc.sched.cost import CostModel, Workload
from areal_hpc.sched.hardware import CATALOGUE, make_cluster
from areal_hpc.sched.model_spec import load_model_spec
from areal_hpc.sched.planner import HeteroPlanner
from areal_hpc.sched.rollout_milp import RolloutMILP

WORKLOAD = Workload(prompts=16, answers=8, prompt_len=256, gen_mean=2048, gen_max=4096)
COSTS = {name: CostModel(load_model_spec(name), WORKLOAD) for name in ("r1-distill-qwen-1.5b", "r1-distill-qwen-7b")}


@st.composite
def small_clusters(draw):
    """1-3 pools of random device types, at most 10 devices, random links between machines."""
    pools, total = [], 0
    for i in range(draw(st.integers(1, 3))):
        per_node, nodes = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 2))
        if total + per_node * nodes > 10:
            break
        total += per_node * nodes
        pools.append((f"p{i}", draw(st.sampled_from(sorted(CATALOGUE))), nodes, per_node))
    links = {f"{a[0]}-{b[0]}": draw(st.floats(1, 50)) for a, b in itertools.combinations_with_replacement(pools, 2)}
    return make_cluster("random", pools, links)


def brute_force_rollout(replicas, available, max_price=float("inf")):
    """(best total rate, its replica counts) over every count vector that fits the devices and the price."""
    best = (0.0, (0,) * len(replicas))

    def visit(i, free, price, rate, counts):
        nonlocal best
        if i == len(replicas):
            if rate > best[0]:
                best = (rate, tuple(counts))
            return
        r = replicas[i]
        y = 0
        while y * r.devices <= free[r.pool] and price + y * r.price_per_hour <= max_price + 1e-9:
            visit(i + 1, {**free, r.pool: free[r.pool] - y * r.devices}, price + y * r.price_per_hour,
                  rate + y * r.tokens_per_s, counts + [y])
            y += 1

    visit(0, dict(available), 0.0, 0.0, [])
    return best


def brute_force_plan(cluster, cost, staleness):
    """Best tokens/s over every training split, each split's rollout found by enumeration; the step
    is max(train, generation) + weight sync over the slowest link used (η = 0: the sum)."""
    pools = {p.name: p for p in cluster.pools}
    best = None
    for split in itertools.product(*[range(p.devices + 1) for p in cluster.pools]):
        counts = dict(zip(pools, split))
        used = [n for n, c in counts.items() if c]
        groups = [cost.train_group(pools[n], counts[n], cluster.bandwidth(n, n)) for n in used]
        if not groups or None in groups:
            continue
        free = {n: p.devices - counts[n] for n, p in pools.items()}
        replicas = [r for n, k in free.items() if k for r in cost.rollout_replicas(pools[n], k, cluster.bandwidth(n, n))]
        rate, replica_counts = brute_force_rollout(replicas, free)
        if rate == 0:
            continue
        train_s = cost.train_step_s(groups, min(cluster.bandwidth(a, b) for a in used for b in used))
        generation_s = cost.workload.step_tokens / rate
        sync_s = cost.weight_sync_s(min(cluster.bandwidth(a, r.pool) for a in used
                                        for r, y in zip(replicas, replica_counts) if y))
        step_s = (max(train_s, generation_s) if staleness else train_s + generation_s) + sync_s
        best = max(best or 0, cost.workload.step_tokens / step_s)
    return best


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=small_clusters(), model=st.sampled_from(sorted(COSTS)), price_cap=st.floats(1, 60))
def test_rollout_milp_equals_enumeration(cluster, model, price_cap):
    cost = COSTS[model]
    available = {p.name: p.devices for p in cluster.pools}
    replicas = [r for p in cluster.pools for r in cost.rollout_replicas(p, p.devices, cluster.bandwidth(p.name, p.name))]
    plan = RolloutMILP(replicas, available).solve(max_price=price_cap)
    assert plan.tokens_per_s == pytest.approx(brute_force_rollout(replicas, available, price_cap)[0], rel=1e-9)
    assert plan.price_per_hour <= price_cap + 1e-9
    assert all(plan.devices(pool) <= n for pool, n in available.items())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=small_clusters(), model=st.sampled_from(sorted(COSTS)), staleness=st.sampled_from([0, 4]))
def test_planner_equals_enumeration(cluster, model, staleness):
    """Both the exhaustive path and the partition + binary search + refinement path find the optimum."""
    cost = COSTS[model]
    expected = brute_force_plan(cluster, cost, staleness)
    for exhaustive in (True, False):
        planner = HeteroPlanner(cluster, cost, staleness)
        if expected is None:
            with pytest.raises(UserError):
                planner.plan(exhaustive)
            continue
        assert planner.plan(exhaustive).tokens_per_s == pytest.approx(expected, rel=1e-6)
