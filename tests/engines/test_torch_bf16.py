"""The torch engine's bf16 mixed precision under FSDP2 (``MixedPrecisionPolicy``) on two gloo ranks:
20 optimizer steps from the same tiny model train like float32 (loss, gradient norm, logprobs within
stated tolerances), the sharded master weights, gradients and Adam state stay float32 while a Linear
computes in bf16, and the weight push hands out every full tensor in float32.

This file is also the rank program (``run_ranks`` starts it as ``python -m tests.engines.test_torch_bf16 MODEL OUT``).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.sequence_batch import balanced_parts
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import load_model
from areal_hpc.parallel.mesh import build_mesh, init_distributed
from tests.native_ranks import MAX_TOKENS_PER_MB, seeded_batch
from tests.trainer_processes import end_rank, run_ranks

STEPS = 20


def completion_nll(outputs, packed, fields):
    """The batch's mean completion-token NLL (the weights carry the whole batch's normaliser)."""
    return -(fields["weights"] * outputs["logprobs"]).sum(), {}


def train(model_dir: str, mesh, compute_dtype: str) -> dict:
    """STEPS optimizer steps on this rank's share of one seeded batch, then the logprobs of the trained
    policy; the dtypes a Linear computed in (input, weight, output), the dtypes of what the optimizer
    holds, and rank 0's pushed weights."""
    engine = TorchTrainEngine(
        load_model(model_dir),
        PolicyOutputs(),
        mesh=mesh,
        lr=1e-3,
        total_steps=STEPS,
        optimizer=OptimizerConfig(gradient_clipping=1.0),
        max_tokens_per_mb=MAX_TOKENS_PER_MB,
        compute_dtype=compute_dtype,
    )
    computed = set()
    engine.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, inputs, output: computed.add((inputs[0].dtype, module.weight.dtype, output.dtype))
    )
    batch = seeded_batch()
    share = batch.select(balanced_parts([len(s) for s in batch.sequences], mesh.dims.dp)[mesh.data_rank])
    losses, grad_norms = [], []
    for _ in range(STEPS):
        stats = engine.train_step(share, completion_nll)
        losses.append(stats.get("loss", 0.0))
        grad_norms.append(stats["grad_norm"])
    params = list(engine.model.parameters())
    held = {
        "params": {p.dtype for p in params},
        "sharded": all(isinstance(p, DTensor) for p in params),
        "grads": {p.grad.dtype for p in params},
        "adam": {state["exp_avg"].dtype for state in engine.optimizer.state.values()},
    }
    pushed = {name: tensor.clone() for bucket in engine.rollout_weights(1 << 20) for name, tensor in bucket}
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "logprobs": engine.forward(share)["logprobs"],
        "computed": computed,
        "held": held,
        "pushed": pushed,
    }


def main(model_dir: str, out: str) -> None:
    rank, _ = init_distributed(torch.device("cpu"))
    mesh = build_mesh(ParallelDims(dp=2, fsdp=True), torch.device("cpu"))
    runs = {dtype: train(model_dir, mesh, dtype) for dtype in ("float32", "bfloat16")}
    every = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(
        {dtype: {k: v for k, v in run.items() if k != "pushed"} for dtype, run in runs.items()}, every, dst=0
    )
    if rank == 0:
        torch.save({"ranks": every, "pushed": {dtype: run["pushed"] for dtype, run in runs.items()}}, out)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    return run_ranks(
        2,
        tiny_model_dir,
        tmp_path_factory.mktemp("bf16") / "out.pt",
        timeout=120,
        module="tests.engines.test_torch_bf16",
    )


def whole(runs: dict, dtype: str, key: str) -> torch.Tensor:
    """Per-step totals over both ranks (loss: each rank's share) or rank 0's (grad norm: global)."""
    if key == "losses":
        return torch.tensor([r[dtype][key] for r in runs["ranks"]]).sum(0)
    return torch.tensor(runs["ranks"][0][dtype][key])


@pytest.mark.distributed
def test_bf16_trains_like_float32_within_stated_tolerances(runs):
    """bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per value); a layer sums a few
    hundred such products, so activations differ by ~1e-3 to 1e-2 relative, and 20 Adam steps carry
    the difference on. Measured (gloo, 2 ranks, torch 2.13 CPU): loss within 6.4e-3 abs (6.5 falling
    to 3.4), grad norm within 1.7e-2 rel, logprobs within 2.3e-2 nats (mean 2.9e-3). The tolerances are
    three times those: room for bf16's rounding on other hardware and kernels, yet far below what a
    wrong computation gives (a gradient averaged instead of summed halves the norm; float32 trains the
    loss down by 3 nats)."""
    loss32, loss16 = whole(runs, "float32", "losses"), whole(runs, "bfloat16", "losses")
    assert loss32[-1] < loss32[0] - 2  # it trains: the completions are being learnt
    torch.testing.assert_close(loss16, loss32, rtol=0, atol=2e-2)
    torch.testing.assert_close(
        whole(runs, "bfloat16", "grad_norms"), whole(runs, "float32", "grad_norms"), rtol=5e-2, atol=0
    )
    for rank in runs["ranks"]:
        for lp16, lp32 in zip(rank["bfloat16"]["logprobs"], rank["float32"]["logprobs"], strict=True):
            torch.testing.assert_close(lp16, lp32, rtol=0, atol=7e-2)
            assert (lp16 - lp32).abs().mean() < 1e-2


@pytest.mark.distributed
def test_bf16_computes_in_bf16_over_float32_masters_and_pushes_float32(runs, tiny_model_dir):
    bf16, f32 = torch.bfloat16, torch.float32
    for rank in runs["ranks"]:
        assert rank["bfloat16"]["computed"] == {(bf16, bf16, bf16)}  # the all-gathered weight and activations
        assert rank["float32"]["computed"] == {(f32, f32, f32)}
        assert rank["bfloat16"]["held"] == {"params": {f32}, "sharded": True, "grads": {f32}, "adam": {f32}}
    reference = load_model(tiny_model_dir).state_dict()
    pushed = runs["pushed"]["bfloat16"]
    assert list(pushed) == list(reference)  # every tensor, tied head included, under Hugging Face names
    for name, tensor in reference.items():
        assert pushed[name].dtype == f32 and pushed[name].shape == tensor.shape, name
    # the float32 masters themselves, not the bf16 copies the forward gathered
    assert not any(torch.equal(t, t.bfloat16().float()) for t in pushed.values() if t.dim() == 2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_rank()
