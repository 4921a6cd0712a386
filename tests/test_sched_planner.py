"""HeteroPlanner in the paper's setting: heterogeneity pays at equal budget; objectives and budgets hold."""

import re

import pytest

from areal_hpc.errors import UserError
from areal_hpc.sched import repro_hex
from areal_hpc.sched.cost import CostModel
from areal_hpc.sched.hardware import CLUSTERS, load_cluster
from areal_hpc.sched.model_spec import load_model_spec
from areal_hpc.sched.planner import HeteroPlanner


def planner(cluster, model="r1-distill-qwen-7b", **options) -> HeteroPlanner:
    cost = CostModel(load_model_spec(model), repro_hex.WORKLOAD, repro_hex.CALIBRATED)
    return HeteroPlanner(load_cluster(CLUSTERS / f"{cluster}.yaml"), cost, **options)


@pytest.mark.parametrize("model", ["r1-distill-qwen-1.5b", "r1-distill-qwen-7b", "r1-distill-qwen-14b"])
def test_heterogeneous_beats_homogeneous_at_the_same_budget(model):
    mixed = planner("paper-8h800-24h20", model).plan()
    budget = mixed.price_per_hour
    for homogeneous in ("paper-24h800", "paper-48h20"):
        best = planner(homogeneous, model, budget=budget).plan()
        assert best.price_per_hour <= budget + 1e-9
        assert mixed.tokens_per_s > best.tokens_per_s


def test_plan_trains_on_h800_and_generates_on_h20():
    plan = planner("paper-8h800-24h20").plan()
    assert {g.pool for g in plan.train} == {"H800"}
    assert plan.rollout.devices("H20") == 24


def test_allocation_string_counts_every_device():
    plan = planner("paper-8h800-24h20").plan()
    parts = plan.allocation.split("+")
    assert all(re.fullmatch(r"(sglang:d\d+t\d+(p\d+)?|megatron:d\d+p\d+t\d+)", p) for p in parts)
    devices = 0
    for part in parts:
        dims = dict((k, int(v)) for k, v in re.findall(r"([dtp])(\d+)", part.split(":")[1]))
        devices += dims["d"] * dims["t"] * dims.get("p", 1)
    assert devices == sum(g.devices for g in plan.train) + plan.rollout.devices()


def test_min_cost_reaches_the_target_for_less():
    fastest = planner("paper-8h800-24h20").plan()
    target = fastest.tokens_per_s / 2
    cheapest = planner("paper-8h800-24h20", objective="min-cost", target=target).plan()
    assert cheapest.tokens_per_s >= target * (1 - 1e-6)
    assert cheapest.price_per_hour < fastest.price_per_hour


def test_budget_caps_the_price_and_a_bigger_budget_never_plans_slower():
    plans = [planner("paper-8h800-24h20", budget=b).plan() for b in (30, 60, 90)]
    assert all(p.price_per_hour <= b + 1e-9 for p, b in zip(plans, (30, 60, 90)))
    assert plans[0].tokens_per_s <= plans[1].tokens_per_s <= plans[2].tokens_per_s


def test_a_budget_below_any_plan_is_a_user_error():
    with pytest.raises(UserError, match="budget"):
        planner("paper-24h800", budget=5).plan()


def test_large_cluster_search_beats_every_whole_machine_split():
    """256 devices, too many splits to enumerate: the search (partition, binary search on the training
    share, refinement) evaluates a few dozen splits and beats every split by whole machines."""
    from dataclasses import replace

    from areal_hpc.sched.hardware import make_cluster

    workload = replace(repro_hex.WORKLOAD, prompts=8 * repro_hex.WORKLOAD.prompts)
    big = make_cluster("big", [("H800", "H800", 8, 8), ("H20", "H20", 24, 8)],
                       {"H800-H800": 5, "H20-H20": 5, "H800-H20": 1.5})
    search = HeteroPlanner(big, CostModel(load_model_spec("r1-distill-qwen-7b"), workload, repro_hex.CALIBRATED))
    plan = search.plan()
    assert len(search.evaluated) < 200
    grid = [search.evaluate({"H800": 8 * a, "H20": 8 * b}) for a in range(9) for b in range(25)]
    assert plan.tokens_per_s >= max(p.tokens_per_s for p in grid if p is not None)
