"""Every parallel layout of the torch engine (pipeline stages included) takes the same PPO step as one
process, the PPO critic too.

Each case runs the real trainer path in real gloo processes (``tests/trainer_processes.py``:
``build_actor`` on the mesh of ``actor.parallel``, ``TrainerRanks`` scattering shares by data-parallel
coordinate, the collective ``rollout_weights`` gathering full Hugging Face tensors) and compares the
updated weights, the loss and the gradient norm with a single-process run of the same engine on the
same seeded batch; one case runs under ``srun`` across the two nodes of the dev Slurm cluster.
(``tests/engines/test_torch_parallel.py`` checks the engine itself: per-token logprobs, empty shares,
checkpoints across layouts.)
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from areal_hpc.runtime.bootstrap import RENDEZVOUS
from tests.conftest import REPO
from tests.slurm_jobs import wait_for_end
from tests.trainer_processes import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# layout name -> (processes, overrides)
LAYOUTS = {
    "dp2": (2, ()),
    "fsdp2": (2, ("actor.parallel.fsdp=true",)),
    "tp2": (2, ("actor.parallel.tp=2",)),
    "tp2xfsdp2": (4, ("actor.parallel.tp=2", "actor.parallel.fsdp=true")),
    "pp2": (2, ("actor.parallel.pp=2",)),
    "cp2": (2, ("actor.parallel.cp=2",)),
}
# Two optimizer steps (the second starts from sharded Adam state), with Adam's eps raised so its steps
# are near-linear in the gradient: with the default, m/sqrt(v) ~ +-1 on elements whose gradient is ~0
# turns float32 rounding (sums in another order) into lr-sized differences. (The PPO critic, whose
# gradient norm is ~10, differed from one process by up to 4e-6 that way; with eps=1e-4, by 1.2e-7.)
STEP = ("actor.ppo_n_minibatches=2", "optimizer.eps=1e-4")


@functools.cache
def single_process(engine: str, model_dir: str, folder: str, extra: tuple[str, ...] = ()) -> dict:
    return run_ranks(
        1, model_dir, f"{folder}/{engine}-single{'-'.join(extra)}.pt", f"actor.engine={engine}", *STEP, *extra
    )


def assert_same_step(ours: dict, reference: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert ours["weights"].keys() == reference["weights"].keys()
    for engine, weights in reference["weights"].items():
        assert ours["weights"][engine].keys() == weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(ours["weights"][engine][name], tensor, rtol=rtol, atol=atol, msg=name)
    assert ours["stats"]["actor/loss_tokens"] == reference["stats"]["actor/loss_tokens"]
    for key in ("actor/loss", "actor/grad_norm"):
        assert ours["stats"][key] == pytest.approx(reference["stats"][key], rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_takes_the_same_step_as_one_process(layout, tiny_model_dir, reference_folder, tmp_path):
    processes, overrides = LAYOUTS[layout]
    engine = "torch"
    reference = single_process(engine, str(tiny_model_dir), reference_folder)
    ours = run_ranks(processes, tiny_model_dir, tmp_path / "out.pt", f"actor.engine={engine}", *STEP, *overrides)
    assert_same_step(ours, reference)


@pytest.mark.parametrize("engine", ["torch", "megatron"])
def test_ppo_critic_trains_the_same_under_tensor_parallelism(engine, tiny_model_dir, reference_folder, tmp_path):
    """Actor and critic through the trainer with tp2, against the torch engine in one process."""
    ppo = ("actor.adv_estimator=ppo",)
    reference = single_process("torch", str(tiny_model_dir), reference_folder, ppo)
    ours = run_ranks(
        2, tiny_model_dir, tmp_path / "out.pt", f"actor.engine={engine}", *STEP, *ppo, "actor.parallel.tp=2"
    )
    assert set(ours["weights"]) == {"actor", "critic"}
    assert_same_step(ours, reference)


def test_moe_expert_parallel_steps_through_the_trainer_ranks(tiny_moe_dir, tmp_path):
    """Two optimizer steps of a Qwen3-MoE with its experts split over two ranks, through the actor's
    PPO loss and the trainer ranks (tests/engines/test_torch_parallel.py covers experts that get no rows)."""
    reference = run_ranks(1, tiny_moe_dir, tmp_path / "single.pt", "actor.engine=torch", *STEP)
    ours = run_ranks(2, tiny_moe_dir, tmp_path / "out.pt", "actor.engine=torch", *STEP, "actor.parallel.ep=2")
    assert_same_step(ours, reference)


@pytest.mark.slurm
@pytest.mark.parametrize("engine", ["torch", "megatron"])
def test_tensor_parallel_step_under_srun_across_two_nodes(engine, tiny_model_dir, reference_folder, tmp_path):
    """Two ranks placed by ``srun`` on train1 and rollout1 (SLURM_PROCID, a name-resolve rendezvous), against
    the torch engine in one process."""
    reference = single_process("torch", str(tiny_model_dir), reference_folder)
    out, log = tmp_path / "srun.pt", tmp_path / "srun.log"
    script = tmp_path / "tp2.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=areal-hpc-test-tp2 -p all -N 2 -n 2 --ntasks-per-node=1 --mem-per-cpu=1500M
#SBATCH --output={log} --chdir={REPO}
export {RENDEZVOUS}={tmp_path}/rendezvous/$SLURM_JOB_ID OMP_NUM_THREADS=1
srun {sys.executable} -m tests.trainer_processes {tiny_model_dir} {out} actor.engine={engine} {" ".join(STEP)} \\
    actor.parallel.tp=2
""")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30, env=environ
    )
    assert submitted.returncode == 0, submitted.stderr
    states = wait_for_end(submitted.stdout.strip(), 240)
    assert [state for state, _, _ in states.values()] == ["COMPLETED"], log.read_text() if log.exists() else states
    assert_same_step(torch.load(out, weights_only=False), reference)
