"""Cost-model sanity: model sizes, monotonicity in bandwidth and devices, memory limits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.errors import UserError
from areal_hpc.sched.cost import CostModel, Efficiency, Workload, load_efficiency
from areal_hpc.sched.hardware import CATALOGUE, NodePool
from areal_hpc.sched.model_spec import load_model_spec

MODELS = ["r1-distill-qwen-1.5b", "r1-distill-qwen-7b", "r1-distill-qwen-14b", "r1-distill-qwen-32b"]
COSTS = {name: CostModel(load_model_spec(name), Workload(prompts=8, answers=8)) for name in MODELS}


def pool(device: str, per_node: int = 8, nodes: int = 4) -> NodePool:
    return NodePool(device, CATALOGUE[device], nodes, per_node)


@pytest.mark.parametrize(
    "name, billions",
    [
        ("r1-distill-qwen-1.5b", 1.777),
        ("r1-distill-qwen-7b", 7.616),
        ("r1-distill-qwen-14b", 14.770),
        ("r1-distill-qwen-32b", 32.764),
    ],
)
def test_parameter_counts_match_the_published_models(name, billions):
    assert load_model_spec(name).params / 1e9 == pytest.approx(billions, abs=0.001)


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    device=st.sampled_from(sorted(CATALOGUE)),
    slow=st.floats(0.5, 50),
    factor=st.floats(1, 20),
    devices=st.sampled_from([2, 4, 8, 16]),
)
def test_more_bandwidth_is_never_slower(model, device, slow, factor, devices):
    cost, p = COSTS[model], pool(device, per_node=4)
    fast = slow * factor
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            a, b = cost.rollout_replica(p, tp, pp, slow), cost.rollout_replica(p, tp, pp, fast)
            assert (a is None) == (b is None)
            assert a is None or b.tokens_per_s >= a.tokens_per_s
    a, b = cost.train_group(p, devices, slow), cost.train_group(p, devices, fast)
    assert (a is None) == (b is None)
    assert a is None or cost.train_step_s([b], fast) <= cost.train_step_s([a], slow)
    assert cost.weight_sync_s(fast) <= cost.weight_sync_s(slow)


def test_faster_links_inside_a_machine_are_never_slower():
    cost, base = COSTS["r1-distill-qwen-14b"], pool("H800")
    faster = NodePool("H800", CATALOGUE["H100"], 4, 8)  # same FLOP/s and HBM, 450 instead of 200 GB/s NVLink
    assert cost.rollout_replica(faster, 4, 1, 5).tokens_per_s >= cost.rollout_replica(base, 4, 1, 5).tokens_per_s
    assert cost.train_group(faster, 8, 5).tokens_per_s >= cost.train_group(base, 8, 5).tokens_per_s


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(MODELS), device=st.sampled_from(sorted(CATALOGUE)), devices=st.integers(1, 31))
def test_more_devices_never_mean_fewer_feasible_plans(model, device, devices):
    cost, p = COSTS[model], pool(device)
    fewer = {(r.tp, r.pp) for r in cost.rollout_replicas(p, devices, 5)}
    more = {(r.tp, r.pp) for r in cost.rollout_replicas(p, devices + 1, 5)}
    assert fewer <= more
    # a training group that fits on n devices also fits (pipelined further, or data-parallel) on 2n
    if cost.train_group(p, devices, 5) is not None:
        assert cost.train_group(p, 2 * devices, 5) is not None


def test_memory_limits_what_fits():
    big, small = COSTS["r1-distill-qwen-32b"], pool("L40S", per_node=1, nodes=1)
    assert big.rollout_replica(small, 1, 1, 5) is None  # 65 GB of bf16 weights on a 48 GB card
    assert big.train_group(small, 1, 5) is None
    assert COSTS["r1-distill-qwen-1.5b"].train_group(pool("H100"), 1, 5) is not None


def test_decode_is_memory_bound_on_h800_and_efficiency_scales_speed():
    cost = COSTS["r1-distill-qwen-7b"]
    replica = cost.rollout_replica(pool("H800"), 1, 1, 5)
    assert replica.step_full_s > replica.step_1_s  # each running sequence adds its KV reads
    slower = CostModel(cost.model, cost.workload, Efficiency(overall=0.5)).rollout_replica(pool("H800"), 1, 1, 5)
    assert slower.tokens_per_s == pytest.approx(replica.tokens_per_s / 2, rel=0.05)


@pytest.mark.parametrize("factor", [0.25, 0.6, 1.7])
def test_a_device_factor_scales_that_device_only(factor):
    """``H20.train`` scales H20's training compute and ``H20.decode`` its decode reads and FLOPs; one
    device alone (no collectives) runs exactly that factor faster or slower; other devices do not change."""
    cost = COSTS["r1-distill-qwen-1.5b"]
    scaled = CostModel(cost.model, cost.workload, Efficiency().replace(**{"H20.train": factor, "H20.decode": factor}))
    h20, h800 = pool("H20"), pool("H800")
    assert scaled.train_group(h20, 1, 5).tokens_per_s == pytest.approx(
        factor * cost.train_group(h20, 1, 5).tokens_per_s
    )
    assert scaled.rollout_replica(h20, 1, 1, 5).step_full_s == pytest.approx(
        cost.rollout_replica(h20, 1, 1, 5).step_full_s / factor
    )
    assert scaled.train_group(h800, 8, 5) == cost.train_group(h800, 8, 5)
    assert scaled.rollout_replica(h800, 2, 1, 5) == cost.rollout_replica(h800, 2, 1, 5)


def test_efficiency_yaml_reads_per_device_factors(tmp_path):
    path = tmp_path / "eff.yaml"
    path.write_text("overall: 0.5\nper_device:\n  H20: {train: 0.7, decode: 0.9}\n")
    e = load_efficiency(path)
    assert (e.overall, e.factor("H20.train"), e.factor("H20.decode"), e.factor("H800.train")) == (0.5, 0.7, 0.9, 1.0)
    path.write_text("per_device:\n  H20: {prefill: 0.7}\n")
    with pytest.raises(UserError, match="per_device must map device types to"):
        load_efficiency(path)
    path.write_text("per_device:\n  H2O: {train: 0.7}\n")
    with pytest.raises(UserError, match="unknown device type 'H2O', did you mean 'H20'"):
        load_efficiency(path)


def test_decode_turns_compute_bound_on_h20_at_large_batches_and_stays_hbm_bound_on_h800():
    """With the paper's calibrated global factors, H20 (148 TFLOP/s, 4.0 TB/s) is compute-bound at a full
    batch and an H800 (989 TFLOP/s, 3.35 TB/s) HBM-bound: fewer decode FLOP/s slow H20's full batch only."""
    from areal_hpc.sched.repro_hex import CALIBRATED

    cost = CostModel(load_model_spec("r1-distill-qwen-7b"), Workload(prompt_len=1024, gen_mean=8192), CALIBRATED)
    fewer_flops = CostModel(cost.model, cost.workload, CALIBRATED.replace(decode_mfu=CALIBRATED.decode_mfu / 2))
    h20, h800 = cost.rollout_replica(pool("H20"), 2, 1, 5), cost.rollout_replica(pool("H800"), 2, 1, 5)
    assert fewer_flops.rollout_replica(pool("H20"), 2, 1, 5).step_full_s > 1.5 * h20.step_full_s
    assert fewer_flops.rollout_replica(pool("H20"), 2, 1, 5).step_1_s == pytest.approx(h20.step_1_s)
    assert fewer_flops.rollout_replica(pool("H800"), 2, 1, 5) == h800


def test_prefill_of_a_short_prompt_is_bound_by_reading_the_weights():
    cost = COSTS["r1-distill-qwen-7b"]
    e, dev = cost.eff, CATALOGUE["H800"]
    short = CostModel(cost.model, Workload(prompt_len=8), e)
    weights_s = cost.model.weight_bytes / (dev.hbm_gbs * 1e9 * e.decode_hbm * e.overall)
    assert short.prefill_s(pool("H800"), 1, 1) == pytest.approx(weights_s)
    long_s = 2 * cost.model.params * cost.workload.prompt_len / (dev.tflops * 1e12 * e.prefill_mfu * e.overall)
    assert cost.prefill_s(pool("H800"), 1, 1) == pytest.approx(long_s)


def test_tensor_parallel_collective_latency_is_paid_per_micro_batch_not_per_token():
    """A tp=2 trainer on NVLink loses little to its all-reduces (a 10 us latency per token would cost it 10x)."""
    cost = COSTS["r1-distill-qwen-14b"]
    no_links = CostModel(cost.model, cost.workload, Efficiency(latency_s=0.0, link=1e6))
    group, ideal = (
        next(g for g in c.train_layouts(pool("H800"), 8, 5) if (g.dp, g.tp, g.pp) == (4, 2, 1))
        for c in (cost, no_links)
    )
    assert 0.85 * ideal.tokens_per_s < group.tokens_per_s < ideal.tokens_per_s
