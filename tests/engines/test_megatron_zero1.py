"""ZeRO-1 on the Megatron engine (``actor.parallel.distributed_optimizer``): Megatron's distributed
optimizer over dp2 takes the same steps as the replicated optimizer over dp2 (float32 and bf16) while
each rank holds half the Adam state; its checkpoint resumes in another data-parallel size (dp2 -> dp1
and dp1 -> dp2, the state resharded) with the step an uninterrupted run takes. The ranks run this
module as their script, one phase per launch:

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \\
        python -m tests.engines.test_megatron_zero1 MODEL OUT FOLDER train|resume
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from areal_hpc.config import OptimizerConfig
from areal_hpc.engines.megatron.convert import ModelShape
from areal_hpc.engines.megatron.model import check_layout
from areal_hpc.engines.sequence_batch import balanced_parts
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.parallel.mesh import build_mesh, init_distributed
from tests import native_ranks
from tests.trainer_processes import end_rank, run_ranks

STEPS = 3  # then the checkpoint, then one more step


def engine_on(model_dir, mesh, compute_dtype: str = "float32"):
    """``tests.megatron_ranks.engine_on``'s settings (Adam eps raised, clipping at 0.5)."""
    from areal_hpc.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(
        str(model_dir),
        "policy",
        mesh=mesh,
        lr=1e-3,
        total_steps=STEPS + 1,
        optimizer=OptimizerConfig(gradient_clipping=0.5, eps=1e-4),
        max_tokens_per_mb=native_ranks.MAX_TOKENS_PER_MB,
        tokenizer=load_tokenizer(model_dir),
        compute_dtype=compute_dtype,
    )


def step(engine, seed: int, mesh) -> dict[str, float]:
    """One step of the PPO-like loss on this rank's share of seeded batch ``seed``."""
    batch = native_ranks.seeded_batch(seed=seed)
    share = balanced_parts([len(s) for s in batch.sequences], mesh.dims.dp)[mesh.data_rank]
    stats = engine.train_step(batch.select(share), native_ranks.ppo_like_loss)
    return {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}


def adam_elements(engine) -> int:
    """How many elements of Adam's first moment this rank holds."""
    return sum(state["exp_avg"].numel() for state in engine.optimizer.state.values())


def meshes(world: int) -> dict:
    """dp=``world`` with the distributed optimizer (key True) and without."""
    return {
        zero1: build_mesh(ParallelDims(dp=world, distributed_optimizer=zero1), torch.device("cpu"))
        for zero1 in (True, False)
    }


def train(model_dir: str, folder: Path) -> dict:
    """A float32 ZeRO-1 engine (over dp2 also a bf16 one, and replicated twins of both to compare with)
    takes ``STEPS`` steps, saves ``folder/dp{dp}`` and takes one more step."""
    world = dist.get_world_size()
    mesh = meshes(world)
    # ZeRO-1 first: the first engine readies Megatron, and only a ZeRO-1 one has it make the gloo groups
    kinds = [(True, "float32"), (True, "bfloat16"), (False, "float32"), (False, "bfloat16")][: 4 if world > 1 else 1]
    engines = {(zero1, dtype): engine_on(model_dir, mesh[zero1], dtype) for zero1, dtype in kinds}
    result = {"steps": {key: [] for key in engines}}
    for seed in range(STEPS):
        for key, engine in engines.items():
            result["steps"][key].append(step(engine, seed, mesh[key[0]]))
    result["weights"] = {key: native_ranks.weights_of(engine) for key, engine in engines.items()}
    result["adam_elements"] = {key: adam_elements(engine) for key, engine in engines.items()}
    zero1 = engines[True, "float32"]
    zero1.save(folder / f"dp{world}")
    step(zero1, STEPS, mesh[True])
    result["next_step"] = native_ranks.weights_of(zero1)
    return result


def resume(model_dir: str, folder: Path) -> dict:
    """A fresh float32 ZeRO-1 engine loads the other data-parallel size's checkpoint and takes the next
    step; a replicated engine refuses the checkpoint's optimizer state."""
    world = dist.get_world_size()
    mesh = meshes(world)
    engine = engine_on(model_dir, mesh[True])
    engine.load(folder / f"dp{3 - world}")
    step(engine, STEPS, mesh[True])
    result = {"next_step": native_ranks.weights_of(engine)}
    try:
        engine_on(model_dir, mesh[False]).load(folder / f"dp{world}")
    except UserError as error:
        result["replicated_resume_error"] = str(error)
    return result


def main(model_dir: str, out: str, folder: str, phase: str) -> None:
    init_distributed(torch.device("cpu"))
    result = {"train": train, "resume": resume}[phase](model_dir, Path(folder))
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result.pop("adam_elements", None), every, dst=0)
    if dist.get_rank() == 0:
        torch.save({**result, "adam_elements": every}, out)


def launch(world: int, model_dir, folder: Path, phase: str) -> dict:
    return run_ranks(
        world,
        model_dir,
        folder / f"{phase}{world}.pt",
        str(folder),
        phase,
        timeout=120,
        module="tests.engines.test_megatron_zero1",
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("zero1")
    return {
        (phase, world): launch(world, tiny_model_dir, folder, phase)
        for phase, world in (("train", 1), ("train", 2), ("resume", 1), ("resume", 2))
    }


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero1_takes_the_replicated_optimizers_steps(runs, dtype):
    """Reduce-scatter, sharded Adam and all-gather against all-reduce and replicated Adam over dp2: the same
    sums and elementwise updates. Measured over 3 steps: the first step's loss identical and gradient norms
    within 1.1e-7 (Megatron's norm sums the squares in another order), so the float32 weights after a step
    within 6e-8 and later losses within 1e-7 relative (the float32 check is the tight one). In bf16 a master
    weight that close to a rounding boundary flips its bf16 copy by one unit in the last place, and Adam,
    which steps by up to lr whatever a gradient's size, turns the changed gradients into weights up to
    2.4e-4 apart after 3 steps at lr 1e-3 (measured), losses and norms up to 1e-4 relative. Each rank holds
    exactly half of the Adam moments."""
    got = runs["train", 2]
    later = {"float32": 1e-6, "bfloat16": 1e-3}[dtype]  # relative, after the first step
    for step, (want, have) in enumerate(zip(got["steps"][False, dtype], got["steps"][True, dtype], strict=True)):
        assert have["loss"] == (want["loss"] if step == 0 else pytest.approx(want["loss"], rel=later))
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], rel=later if step else 0, abs=1e-6)
    apart = {"float32": 1e-5, "bfloat16": 5e-4}[dtype]
    for name, tensor in got["weights"][False, dtype].items():
        torch.testing.assert_close(got["weights"][True, dtype][name], tensor, rtol=0, atol=apart, msg=name)
    sharded, replicated = ([ranks[key] for ranks in got["adam_elements"]] for key in ((True, dtype), (False, dtype)))
    assert replicated[0] == replicated[1] == sum(sharded) and max(sharded) < replicated[0]


@pytest.mark.distributed
@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)], ids=["dp2_to_dp1", "dp1_to_dp2"])
def test_zero1_checkpoint_resumes_in_another_data_parallel_size(runs, saved, resumed):
    """The resumed run's next step equals the saving run's own next step: the same weights, Adam moments
    and schedule, in other shards (measured within 7.5e-9: dp1 and dp2 sum the micro-batch gradients in
    another order; the step itself moves weights by up to 1.4e-4). A replicated optimizer refuses the
    sharded state in one line."""
    uninterrupted, restored = runs["train", saved]["next_step"], runs["resume", resumed]["next_step"]
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(restored[name], tensor, rtol=0, atol=1e-6, msg=name)
    error = runs["resume", resumed]["replicated_resume_error"]
    assert "'distributed_optimizer': 1" in error and "\n" not in error


@pytest.mark.parametrize(
    "model, sizes, message",
    [
        (
            "tiny_model_dir",
            dict(dp=2, fsdp=True),
            "distributed_optimizer=true shards the optimizer state that fsdp=true",
        ),
        ("tiny_moe_dir", dict(dp=2), "does not build distributed_optimizer=true for a Mixture-of-Experts model"),
    ],
)
def test_zero1_layouts_not_built_are_one_user_error(model, sizes, message, request):
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(request.getfixturevalue(model)))
    with pytest.raises(UserError, match=message) as error:
        check_layout(ParallelDims(**sizes, distributed_optimizer=True), shape)
    assert "\n" not in str(error.value)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    end_rank()
