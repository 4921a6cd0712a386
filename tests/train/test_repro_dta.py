"""``areal-hpc repro dta`` and ``areal-hpc tree-cost`` as a user runs them: the tree-mask baseline the
repro times is itself exact (its gradients equal the flat engine's); the workloads are shaped as
documented; the quick repro prints its table; the cost fit reads a run's metrics.jsonl back into the
coefficients that made its times; bad input is one line and exit code 2."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.algo.tree_balance import TREE_FEATURES
from areal_hpc.config import ActorConfig, OptimizerConfig
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs
from areal_hpc.models.tiny import PRESETS
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.repro_dta import VOCAB, grpo, multi_turn, training_batch, tree_mask_step
from tests.algo.test_tree_balance import features_of
from tests.conftest import run_cli


def test_the_tree_mask_baseline_takes_the_flat_gradient():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, **PRESETS["tiny"]))
    batch = training_batch(multi_turn(episodes=3, prompt=20, reply=4, environment=4, turns=(2, 4)))
    gradients = []
    for mask in (False, True):
        engine = TorchTrainEngine(
            copy.deepcopy(model), PolicyOutputs(1.0), lr=0.0, optimizer=OptimizerConfig(gradient_clipping=0.0)
        )
        loss = PPOActor(engine, ActorConfig())._policy_loss
        if mask:
            tree_mask_step(engine, batch, loss)
        else:
            engine.optimizer.zero_grad()
            engine._micro_batch_gradients(batch, loss)
        gradients.append(torch.cat([p.grad.flatten() for p in engine.model.parameters()]))
    assert float((gradients[0] - gradients[1]).abs().max()) <= 1e-5 * float(gradients[0].abs().max())


def test_multi_turn_turns_extend_each_other_and_train_only_their_reply():
    sequences, masks = multi_turn(episodes=2, prompt=10, reply=5, environment=3, turns=(3, 6), groups=2).sequences()
    tree = build_prefix_tree(sequences)
    assert len(tree.roots) == 2  # one per task: its episodes share the prompt
    for previous, (turn, mask) in zip(sequences, zip(sequences[1:], masks[1:])):
        if turn[: len(previous)] == previous:  # the next turn of the same episode
            assert sum(mask) == len(turn) - mask.index(1) and mask.index(1) > len(previous)
    fixed = grpo(16, prompt=56, reply=14, groups=1, spread=0.0)
    assert {len(s) for s in fixed.sequences()[0]} == {70}


@pytest.mark.slow
def test_quick_repro_prints_the_table_beside_the_paper():
    done = run_cli("repro", "dta", "--quick", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "token compression, τ²-bench" in done.stdout and "9.43x" in done.stdout and "8.31x" in done.stdout
    assert "[5/5] GRPO n=8: dta" in done.stderr  # progress, one line per measured variant


def test_tree_cost_fits_a_runs_metrics(tmp_path):
    rng = np.random.default_rng(1)
    truth = np.array([1e-3, 2e-5, 0.0, 1e-6, 4e-4])
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(12):
            sequences = [rng.integers(0, 3, int(rng.integers(2, 40))).tolist() for _ in range(int(rng.integers(4, 30)))]
            features = features_of(sequences)
            record = {
                "step": step,
                **{f"actor/tree_{k}": float(v) for k, v in zip(TREE_FEATURES, features)},
                "actor/tree_seconds": float(features @ truth),
            }
            f.write(json.dumps(record) + "\n")
        f.write(json.dumps({"step": 12, "eval/accuracy": 0.5}) + "\n")  # other records are left alone
    done = run_cli("tree-cost", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "fitted on 12 steps" in done.stdout
    fitted = json.loads(done.stdout.splitlines()[-1].removeprefix("actor.tree_cost="))
    np.testing.assert_allclose(fitted, truth, rtol=1e-3, atol=1e-9)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["tree-cost", "/nonexistent/run"], "has no metrics.jsonl"),
        (["repro", "dta", "--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_input_is_one_line(arguments, message):
    done = run_cli(*arguments)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_run_without_tree_steps_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/loss": 0.1}) + "\n")
    done = run_cli("tree-cost", str(tmp_path))
    assert done.returncode == 2 and "found 0" in done.stderr
