"""DPO, cDPO, IPO and Bradley-Terry against float64 loops written from the papers; the per-token weights the
trainer hands the engine against autograd through the whole objective on a real model; the pair loader's
shapes and bad input; `areal-hpc pairs`, `dpo` and `rm` end to end on the tiny model.
"""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.preference import LOSSES, PairLossConfig, margin_gradients, pair_losses
from areal_hpc.config import PreferenceConfig
from areal_hpc.data.preference_pairs import load_pairs, pairs_from_episodes, split_conversations
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import ValueOutputs, packed_policy_outputs
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_critic, load_model, load_tokenizer
from areal_hpc.train.preference import PairScorer, pair_batch

FAST = settings(deadline=None, max_examples=60)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(h: float, cfg: PairLossConfig) -> float:
    """One pair's loss as the papers write it: DPO eq. 7 with cDPO's smoothing, IPO eq. 17, Bradley-Terry."""
    if cfg.loss == "ipo":
        return (h - 1 / (2 * cfg.beta)) ** 2
    if cfg.loss == "bradley_terry":
        return -log_sigmoid(h)
    eps = cfg.label_smoothing
    return -(1 - eps) * log_sigmoid(cfg.beta * h) - eps * log_sigmoid(-cfg.beta * h)


@FAST
@given(st.lists(st.floats(-60, 60, allow_nan=False), min_size=1, max_size=12), st.sampled_from(LOSSES),
       st.floats(0.01, 2.0), st.sampled_from([0.0, 0.1, 0.3]))
def test_pair_losses_and_their_margin_gradients_match_float64_loops(margins, loss, beta, smoothing):
    cfg = PairLossConfig(loss=loss, beta=beta, label_smoothing=smoothing)
    mean, gradient = margin_gradients(torch.tensor(margins, dtype=torch.float64), cfg)
    want = sum(reference_loss(h, cfg) for h in margins) / len(margins)
    assert mean.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    h_step = 1e-5
    for i, h in enumerate(margins):  # central differences of the loop, pair by pair
        numeric = (reference_loss(h + h_step, cfg) - reference_loss(h - h_step, cfg)) / (2 * h_step) / len(margins)
        assert gradient[i].item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)


def test_losses_at_numeric_extremes_stay_finite():
    margins = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4], dtype=torch.float64)
    for loss in ("sigmoid", "bradley_terry"):
        values = pair_losses(margins, PairLossConfig(loss=loss, beta=1.0))
        assert torch.isfinite(values).all()
        assert values[0].item() == pytest.approx(1e4) and values[-1].item() == pytest.approx(0.0, abs=1e-12)


def test_bad_loss_settings_are_one_line():
    with pytest.raises(ValueError, match="loss='kto'; valid: sigmoid, ipo, bradley_terry"):
        PairLossConfig(loss="kto")
    with pytest.raises(ValueError, match="label_smoothing=0.7"):
        PairLossConfig(label_smoothing=0.7)


# --------------------------------------------------------------- the engine's weights are the objective's gradient

def write_pairs(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


ARITHMETIC_PAIRS = [{"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + d)}
                    for a, b, d in [(3, 4, 1), (12, 9, -2), (40, 2, 10), (7, 7, 3), (25, 11, -1), (8, 30, 2)]]


@pytest.mark.parametrize("objective", ["dpo", "rm"])
def test_weighted_outputs_give_the_objectives_gradient(tiny_model_dir, tmp_path, objective):
    """The trainer's surrogate Σ weight·output, summed over the engine's micro-batches, has the gradient of the
    pair loss computed directly by autograd through the model (all pairs in one forward)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_model_dir)
    pairs, _ = load_pairs(PreferenceConfig(path=write_pairs(tmp_path / "p.jsonl", ARITHMETIC_PAIRS), eval_size=1),
                          0, tokenizer, 4096, say=lambda line: None)
    if objective == "dpo":
        model, outputs, cfg = load_model(tiny_model_dir), packed_policy_outputs, PairLossConfig(beta=0.5)
    else:
        model, outputs, cfg = load_critic(tiny_model_dir), ValueOutputs(), PairLossConfig(loss="bradley_terry")
    engine = TorchTrainEngine(model, outputs, max_tokens_per_mb=24, tokenizer=tokenizer)  # pairs split over passes
    reference = torch.randn(len(pairs) * 2, dtype=torch.float64) if objective == "dpo" else 0.0
    batch = pair_batch(pairs)
    scorer = PairScorer(objective)

    # direct: one forward of everything, the loss as a function of the parameters
    packed, _ = batch.packed()
    per_position = outputs(model, packed)[scorer.output].double()
    scores = scorer._reduce(batch, per_position) - reference
    direct = pair_losses(scores[0::2] - scores[1::2], cfg).mean()
    direct_grads = torch.autograd.grad(direct, [p for p in model.parameters()])

    # the trainer's way: scores without gradient, then the engine's weighted pass
    model.zero_grad()
    scores = scorer.scores(engine, batch) - reference
    loss, gradient = margin_gradients(scores[0::2] - scores[1::2], cfg)
    weights = scorer.weights(batch, torch.stack([gradient, -gradient], dim=1).reshape(-1))
    assert loss.item() == pytest.approx(direct.item(), rel=1e-5)
    batch.set_packed("weights", weights.float())
    for indices, packed_mb, fields in engine._passes(batch):
        assert len(indices) < len(batch)  # the budget really splits pairs across micro-batches
        ((fields["weights"] * outputs(model, packed_mb)[scorer.output]).sum()).backward()
    for p, want in zip(model.parameters(), direct_grads):
        torch.testing.assert_close(p.grad, want.float(), rtol=2e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------ the pair loader

def test_conversation_pairs_split_at_the_last_assistant_turn():
    shared = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "2+2?"}]
    row = {"chosen": shared + [{"role": "assistant", "content": "4"}],
           "rejected": shared + [{"role": "assistant", "content": "5"}]}
    split = split_conversations(row, "chosen", "rejected", "prompt")
    assert (split["prompt"], split["chosen"], split["rejected"]) == (shared, "4", "5")
    diverging = {**row, "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "5"}]}
    assert split_conversations(diverging, "chosen", "rejected", "prompt")["chosen"] is None  # dropped later
    assert split_conversations({"prompt": "p", "chosen": "a", "rejected": "b"}, "chosen", "rejected", "prompt") == \
        {"prompt": "p", "chosen": "a", "rejected": "b"}


def test_bad_pairs_are_dropped_and_counted_in_one_line(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    rows = ARITHMETIC_PAIRS + [{"prompt": "What is 1+1?", "chosen": "2", "rejected": None},
                               {"prompt": "What is 2+2?", "chosen": "4", "rejected": "4"},
                               {"prompt": "What is 3+3?", "chosen": "6" * 300, "rejected": "7"}]
    said = []
    cfg = PreferenceConfig(path=write_pairs(tmp_path / "p.jsonl", rows), eval_path=write_pairs(tmp_path / "e.jsonl",
                                                                                               ARITHMETIC_PAIRS[:2]))
    train, held_out = load_pairs(cfg, 0, tokenizer, 64, say=said.append)
    assert (len(train), len(held_out)) == (6, 2)
    assert said == ["dropped 3 training pairs: 1 with a missing side (first: p.jsonl/6); 1 with identical sides "
                    "(first: p.jsonl/7); 1 longer than 64 tokens (first: p.jsonl/8)"]
    sequence, mask = train[0].sequences()[0]
    assert tokenizer.decode([t for t, m in zip(sequence, mask) if m]) == "7" + tokenizer.eos_token


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "p", "good": "a", "rejected": "b"}],
     "config key 'preference.chosen_field': .* has no column 'chosen'; its columns are prompt, good, rejected"),
    ([{"question": "p", "chosen": "a", "rejected": "b"}],
     "config key 'preference.prompt_field': .* has no column 'prompt'; its columns are question, chosen, rejected"),
    ([{"prompt": "p", "chosen": "a", "rejected": "a"}], "no usable training pair"),
])
def test_unusable_pair_files_are_one_clear_error(tiny_model_dir, tmp_path, rows, message):
    cfg = PreferenceConfig(path=write_pairs(tmp_path / "p.jsonl", rows * 4), eval_size=1)
    with pytest.raises(UserError, match=message):
        load_pairs(cfg, 0, load_tokenizer(tiny_model_dir), 4096, say=lambda line: None)


def test_pairs_from_episodes_take_best_against_worst_where_rewards_differ():
    episodes = [{"prompt": "a", "completion": c, "reward": r, "answer": "1"}
                for c, r in [("1", 1.0), ("2", 0.0), ("1 ", 1.0)]]
    episodes += [{"prompt": "b", "completion": c, "reward": 0.0, "answer": "9"} for c in ("3", "4", "5")]
    assert pairs_from_episodes(episodes, 3) == [{"prompt": "a", "chosen": "1", "rejected": "2", "answer": "1",
                                                 "chosen_reward": 1.0, "rejected_reward": 0.0}]
