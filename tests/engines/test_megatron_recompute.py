"""Activation recomputation on the Megatron engine (``actor.recompute``): "selective" (each layer's core
attention) and "full" (each layer's forward from its input, one layer at a time) take the same steps
as no recomputation -- loss, gradient norm and weights -- from the same tiny checkpoint, in float32.
The three engines run in one gloo process, this module as its script:

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \\
        python -m tests.engines.test_megatron_recompute MODEL OUT
"""

from __future__ import annotations

import sys

import pytest
import torch

from areal_hpc.config import OptimizerConfig
from tests import native_ranks
from tests.trainer_processes import end_rank, run_ranks

STEPS = 3
RECOMPUTE = ("none", "selective", "full")


def engine_on(model_dir, recompute: str):
    """``tests.megatron_ranks.engine_on``'s settings (Adam eps raised, clipping at 0.5)."""
    from areal_hpc.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(
        str(model_dir),
        "policy",
        lr=1e-3,
        total_steps=STEPS,
        optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
        max_tokens_per_mb=native_ranks.MAX_TOKENS_PER_MB,
        recompute=recompute,
    )


def forward_calls(engine, batch) -> dict[str, int]:
    """One training step of ``engine`` on ``batch``; how often its layers' core attentions and MLPs ran
    forward during it, and its loss and gradient norm."""
    counts = {"core_attention": 0, "mlp": 0}

    def count(part: str):
        return lambda *args: counts.__setitem__(part, counts[part] + 1)

    layers = [layer for chunk in engine.stage.chunks for layer in chunk.decoder.layers]
    hooks = [
        getattr(module, part).register_forward_hook(count(part))
        for layer in layers
        for module, part in ((layer.self_attention, "core_attention"), (layer, "mlp"))
    ]
    stats = engine.train_step(batch, native_ranks.ppo_like_loss)
    for hook in hooks:
        hook.remove()
    return {**counts, "loss": stats["loss"], "grad_norm": stats["grad_norm"]}


def main(model_dir: str, out: str) -> None:
    """Rank 0 of one: each engine's ``STEPS`` steps on the same seeded batches, then its weights."""
    engines = {recompute: engine_on(model_dir, recompute) for recompute in RECOMPUTE}
    result = {recompute: {"steps": []} for recompute in RECOMPUTE}
    for seed in range(STEPS):
        batch = native_ranks.seeded_batch(seed=seed)
        for recompute, engine in engines.items():
            result[recompute]["steps"].append(forward_calls(engine, batch))
    for recompute, engine in engines.items():
        result[recompute]["weights"] = native_ranks.weights_of(engine)
    torch.save(result, out)


@pytest.mark.distributed
def test_recompute_takes_the_same_steps(tiny_model_dir, tmp_path):
    """The recomputed forward is the same float32 arithmetic as the first one, so losses, gradient norms
    and weights agree to rounding (measured: identical); 1e-6 would catch a recomputation that drew other
    random numbers or lost a packed-sequence boundary."""
    got = run_ranks(1, tiny_model_dir, tmp_path / "out.pt", timeout=120, module="tests.engines.test_megatron_recompute")
    plain = got["none"]
    for recompute, doubled in (("selective", {"core_attention"}), ("full", {"core_attention", "mlp"})):
        for step, (want, have) in enumerate(zip(plain["steps"], got[recompute]["steps"], strict=True)):
            assert have["loss"] == pytest.approx(want["loss"], abs=1e-6), (recompute, step)
            assert have["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-6), (recompute, step)
            for part in ("core_attention", "mlp"):  # the recomputation ran: once more in the backward
                assert have[part] == want[part] * (2 if part in doubled else 1), (recompute, part)
        for name, tensor in plain["weights"].items():
            torch.testing.assert_close(
                got[recompute]["weights"][name], tensor, rtol=0, atol=1e-6, msg=f"{recompute}: {name}"
            )


if __name__ == "__main__":
    main(*sys.argv[1:3])
    end_rank()
