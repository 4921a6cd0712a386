"""bf16 mixed precision on the Megatron engine (``model.compute_dtype=bfloat16``) against the float32
engine from the same tiny checkpoint over 20 optimizer steps of a PPO-like loss; the dtypes of the
parameters, main gradients, master weights, Adam state and rollout push; the saved folder; the
optimizer checkpoint's round trip. Both engines run in one gloo process, this module as its script:

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \\
        python -m tests.engines.test_megatron_bf16 MODEL OUT CHECKPOINT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from areal_hpc.config import OptimizerConfig
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_model, load_tokenizer
from tests import native_ranks
from tests.trainer_processes import end_rank, run_ranks

STEPS = 20


def engine_on(model_dir, compute_dtype: str):
    """``tests.megatron_ranks.engine_on``'s settings (Adam eps raised, clipping at 0.5) over ``STEPS``."""
    from areal_hpc.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(
        str(model_dir),
        "policy",
        lr=1e-3,
        total_steps=STEPS,
        optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
        max_tokens_per_mb=native_ranks.MAX_TOKENS_PER_MB,
        tokenizer=load_tokenizer(model_dir),
        compute_dtype=compute_dtype,
    )


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def main(model_dir: str, out: str, checkpoint: str) -> None:
    """Rank 0 of one: both engines' steps (each on a fresh seeded batch), then the bf16 engine's dtypes,
    push, saved folder and a second bf16 engine resuming from it, written to ``out``."""
    engines = {dtype: engine_on(model_dir, dtype) for dtype in ("float32", "bfloat16")}
    steps = {dtype: [] for dtype in engines}
    for seed in range(STEPS):
        batch = native_ranks.seeded_batch(seed=seed)
        targets = torch.cat(batch.fields["weights"]) > 0
        for dtype, engine in engines.items():
            outputs, stats = native_ranks.step(engine, batch)
            steps[dtype].append(
                {
                    "loss": stats["loss"],
                    "grad_norm": stats["grad_norm"],
                    "logprobs": torch.cat(outputs["logprobs"])[targets],
                }
            )
    bf16 = engines["bfloat16"]
    params = list(bf16.model.parameters())
    masters = [m for group in bf16.optimizer.param_groups for m in group["params"]]
    pushed = native_ranks.weights_of(bf16)
    result = {
        "steps": steps,
        "dtypes": {
            "parameters": dtypes(params),
            "main_grad": dtypes(p.main_grad for p in params),
            "master_weights": dtypes(masters),
            "pushed": dtypes(pushed.values()),
            "adam_state": dtypes(v for state in bf16.optimizer.state.values() for v in state.values()),
        },
        # fp32 masters, not bf16 ones widened: steps smaller than a bf16 spacing are kept
        "masters_below_bf16_spacing": sum(int((m != m.bfloat16().float()).sum()) for m in masters),
    }
    bf16.save(Path(checkpoint))
    saved = load_model(checkpoint).state_dict()
    result["saved_differs_from_pushed"] = [
        name for name, t in pushed.items() if not torch.equal(saved[name], t.float())
    ]
    restored = engine_on(model_dir, "bfloat16")
    restored.load(Path(checkpoint))
    for twin in (bf16, restored):  # the next step: the same fp32 masters, Adam moments and schedule?
        native_ranks.step(twin, native_ranks.seeded_batch(seed=STEPS))
    trained, loaded = native_ranks.weights_of(bf16), native_ranks.weights_of(restored)
    result["restored_step_diff"] = max((trained[k].float() - loaded[k].float()).abs().max().item() for k in trained)
    try:
        engine_on(model_dir, "float32").load(Path(checkpoint))
    except UserError as error:
        result["float32_resume_error"] = str(error)
    torch.save(result, out)


@pytest.fixture(scope="module")
def bf16_run(tiny_model_dir, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("bf16")
    return run_ranks(
        1,
        tiny_model_dir,
        folder / "out.pt",
        str(folder / "checkpoint"),
        timeout=120,
        module="tests.engines.test_megatron_bf16",
    )


@pytest.mark.distributed
def test_bf16_steps_follow_float32(bf16_run):
    """Loss, gradient norm and logprobs of the bf16 engine stay within bf16's precision of the float32
    engine's over 20 steps. bf16 keeps 8 significant bits (a relative spacing of 2^-8 = 3.9e-3): the
    logits carry rounding of that order from the bf16 matmuls, and the weights drift apart by as much
    each step. Measured on the tiny model, on two hosts (one an AMD EPYC with AVX512-BF16): logprobs
    (about -6.5) within 2.1e-3 / 6.8e-3 relative,
    gradient norms within 4.4e-3 / 4.0e-2 relative (on the second host one step of 20 at 4.0e-2, three
    above 1e-2, their mean 6.4e-3: the norm moves more than the logprobs as the weights drift), losses (a weighted
    mean of ratio x advantage, Σ weights = 1, |adv| ~ 1, some near 0, hence absolute) within 7e-4.
    Tolerances: 2e-2 relative on logprobs (5 bf16 spacings), 8e-2 relative on one step's gradient norm and
    2e-2 on their mean over the steps, 5e-3 absolute on the loss: above what bf16 gives on both hosts,
    far below what a lost master weight or a bf16 gradient sum (errors growing with the step) would give."""
    float32, bf16 = bf16_run["steps"]["float32"], bf16_run["steps"]["bfloat16"]
    norm_errors = []
    for step, (want, got) in enumerate(zip(float32, bf16, strict=True)):
        torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=2e-2, atol=0, msg=f"logprobs, step {step}")
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=8e-2), step
        assert got["loss"] == pytest.approx(want["loss"], abs=5e-3), step
        norm_errors.append(abs(got["grad_norm"] / want["grad_norm"] - 1))
    assert sum(norm_errors) / len(norm_errors) < 2e-2, norm_errors


@pytest.mark.distributed
def test_bf16_parameters_with_fp32_main_grads_masters_and_adam_state(bf16_run):
    assert bf16_run["dtypes"] == {
        "parameters": ["bfloat16"],
        "main_grad": ["float32"],
        "master_weights": ["float32"],
        "adam_state": ["float32"],
        "pushed": ["bfloat16"],
    }
    assert bf16_run["masters_below_bf16_spacing"] > 0


@pytest.mark.distributed
def test_bf16_checkpoint_loads_and_resumes_the_step(bf16_run):
    """The saved folder is the pushed bf16 weights (loaded as float32 by ``load_model``); a bf16 engine
    loading it takes the same next step (fp32 masters and Adam state restored); a float32 run refuses
    its optimizer state in one line."""
    assert bf16_run["saved_differs_from_pushed"] == []
    assert bf16_run["restored_step_diff"] == 0.0
    assert "'bf16': 1" in bf16_run["float32_resume_error"]


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_rank()
