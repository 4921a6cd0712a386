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

from areal_hpc.algo.preference import LOSSES, PairLossConfig, margin_gradients, pair_losses, sequence_coefficients
from areal_hpc.config import PreferenceConfig, load_config
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import RegularisedRewardOutputs, ValueOutputs, packed_policy_outputs
from areal_hpc.errors import UserError
from areal_hpc.models.hf import (
    CheckpointError,
    attach_language_head,
    detach_language_head,
    load_critic,
    load_model,
    load_tokenizer,
    save_model,
)
from areal_hpc.train.preference import PairScorer, PreferenceTrainer, pair_batch, weighted_outputs_loss
from areal_hpc.train.preference_pairs import load_pairs, pairs_from_episodes, split_conversations
from tests.conftest import run_cli

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
@given(
    st.lists(st.floats(-60, 60, allow_nan=False), min_size=1, max_size=12),
    st.sampled_from(LOSSES),
    st.floats(0.01, 2.0),
    st.sampled_from([0.0, 0.1, 0.3]),
)
def test_pair_losses_and_their_margin_gradients_match_float64_loops(margins, loss, beta, smoothing):
    cfg = PairLossConfig(loss=loss, beta=beta, label_smoothing=smoothing)
    mean, gradient = margin_gradients(torch.tensor(margins, dtype=torch.float64), cfg)
    want = sum(reference_loss(h, cfg) for h in margins) / len(margins)
    assert mean.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    h_step = 1e-5
    for i, h in enumerate(margins):  # central differences of the loop, pair by pair
        numeric = (reference_loss(h + h_step, cfg) - reference_loss(h - h_step, cfg)) / (2 * h_step) / len(margins)
        assert gradient[i].item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)


@FAST
@given(
    st.lists(
        st.tuples(st.floats(-30, 30), st.floats(-30, 30), st.floats(-30, -0.01), st.integers(1, 9)),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([0.0, 0.5, 2.0]),
    st.sampled_from(["sigmoid", "bradley_terry"]),
)
def test_regularised_objective_and_sequence_derivatives_match_a_float64_loop(pairs, nll_weight, loss_name):
    """The pair loss of the scores plus α·(chosen mean token NLL) of the log-likelihoods: the objective and its
    derivatives by each sequence's score and by each sequence's log-likelihood, separately (a reward model's
    two outputs; for DPO the score is the log-likelihood and the two add up)."""
    cfg = PairLossConfig(loss=loss_name, beta=0.3)
    scores = torch.tensor([v for c, r, _, _ in pairs for v in (c, r)], dtype=torch.float64)
    chosen_likelihood = torch.tensor([ll for _, _, ll, _ in pairs], dtype=torch.float64)
    tokens = torch.tensor([n for _, _, _, n in pairs])
    loss, by_score, by_likelihood, _ = sequence_coefficients(
        scores[0::2], scores[1::2], cfg, nll_weight, chosen_likelihood, tokens
    )

    def objective(values: list[float], likelihoods: list[float]) -> float:
        n = len(pairs)
        mean_pair_loss = sum(reference_loss(values[2 * i] - values[2 * i + 1], cfg) for i in range(n)) / n
        chosen_nll = sum(-likelihoods[2 * i] / pairs[i][3] for i in range(n)) / n
        return mean_pair_loss + nll_weight * chosen_nll

    flat = scores.tolist()
    likelihoods = [v for _, _, ll, _ in pairs for v in (ll, -1.0)]  # a rejected side's likelihood is not used
    assert loss.item() == pytest.approx(objective(flat, likelihoods), rel=1e-9, abs=1e-12)
    for k in range(len(flat)):
        for derivative, argument in ((by_score, 0), (by_likelihood, 1)):
            up, down = [list(flat), list(likelihoods)], [list(flat), list(likelihoods)]
            up[argument][k] += 1e-6
            down[argument][k] -= 1e-6
            numeric = (objective(*up) - objective(*down)) / 2e-6
            assert derivative[k].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8)


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


ARITHMETIC_PAIRS = [
    {"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + d)}
    for a, b, d in [(3, 4, 1), (12, 9, -2), (40, 2, 10), (7, 7, 3), (25, 11, -1), (8, 30, 2)]
]


@pytest.mark.parametrize("objective, nll_weight", [("dpo", 0.0), ("dpo", 1.5), ("rm", 0.0), ("rm", 1.5)])
def test_weighted_outputs_give_the_objectives_gradient(tiny_model_dir, tmp_path, objective, nll_weight):
    """The trainer's surrogate Σ weight·output, summed over the engine's micro-batches, has the gradient of the
    objective computed directly by autograd through the model (all pairs in one forward): DPO with RPO's
    NLL term, a reward model with its language-model regulariser (the NLL read through the language head)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_model_dir)
    pairs, _ = load_pairs(
        PreferenceConfig(path=write_pairs(tmp_path / "p.jsonl", ARITHMETIC_PAIRS), eval_size=1),
        0,
        tokenizer,
        4096,
        say=lambda line: None,
    )
    cfg = load_config(
        "configs/preference_arithmetic.yaml", ["preference.beta=0.5", f"preference.nll_weight={nll_weight}"]
    )
    if objective == "dpo":
        model, outputs, loss_cfg = load_model(tiny_model_dir), packed_policy_outputs, PairLossConfig(beta=0.5)
    else:
        model, loss_cfg = load_critic(tiny_model_dir), PairLossConfig(loss="bradley_terry")
        outputs = RegularisedRewardOutputs() if nll_weight else ValueOutputs()
        if nll_weight:
            attach_language_head(model, tiny_model_dir)
    engine = TorchTrainEngine(model, outputs, max_tokens_per_mb=24, tokenizer=tokenizer)  # pairs split over passes
    reference = torch.randn(len(pairs), 2, dtype=torch.float64) if objective == "dpo" else None
    trainer = PreferenceTrainer(engine, objective, cfg, {"train": reference} if objective == "dpo" else None)
    batch = pair_batch(pairs)
    scorer = PairScorer(objective)

    # direct: one forward of everything, the objective as a function of the parameters
    packed, _ = batch.packed()
    per_position = outputs(model, packed)
    scores = scorer.reduce(packed, per_position[scorer.output].double())
    if reference is not None:
        scores = scores - reference.reshape(-1)
    direct = pair_losses(scores[0::2] - scores[1::2], loss_cfg).mean()
    if nll_weight:
        likelihood = scorer.reduce(packed, per_position["logprobs"].double(), "logprobs")[0::2]
        direct = direct - nll_weight * (likelihood / torch.tensor([len(p.chosen_ids) for p in pairs])).mean()
    direct_grads = torch.autograd.grad(direct, list(model.parameters()))

    # the trainer's way: numbers without gradient, then the engine's weighted pass
    model.zero_grad()
    stats, weighted = trainer.weigh(batch, pairs, list(range(len(pairs))))
    assert stats["loss"] == pytest.approx(direct.item(), rel=1e-5)
    assert weighted == [scorer.output] + (["logprobs"] if objective == "rm" and nll_weight else [])
    for indices, packed_mb, fields in engine._passes(batch):
        assert len(indices) < len(batch)  # the budget really splits pairs across micro-batches
        weighted_outputs_loss(weighted)(outputs(model, packed_mb), packed_mb, fields)[0].backward()
    for p, want in zip(model.parameters(), direct_grads):
        torch.testing.assert_close(p.grad, want.float(), rtol=2e-4, atol=1e-6)


def untied_copy(model_dir, folder):
    """The tiny model with an output layer of its own (not tied to the input embeddings)."""
    model = load_model(model_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 2 + 1)
    save_model(model, load_tokenizer(model_dir), folder)
    return folder


def test_a_reward_models_language_head_is_the_causal_lms_output_layer(tiny_model_dir, tmp_path):
    tied = load_critic(tiny_model_dir)
    attach_language_head(tied, tiny_model_dir)
    assert tied.language_head.weight is tied.get_input_embeddings().weight  # one parameter, trained once
    untied_dir = untied_copy(tiny_model_dir, tmp_path / "untied")
    untied = load_critic(untied_dir)
    attach_language_head(untied, untied_dir)
    want = load_model(untied_dir).lm_head.weight
    torch.testing.assert_close(untied.language_head.weight, want, rtol=0, atol=0)
    assert untied.language_head.weight is not untied.get_input_embeddings().weight
    detach_language_head(untied)
    assert not any(name.startswith("language_head") for name in untied.state_dict())

    broken = load_critic(untied_dir)
    (untied_dir / "model.safetensors").unlink()
    save_model(broken, load_tokenizer(untied_dir), tmp_path / "no_head")  # a critic's checkpoint: no lm_head
    config = json.loads((tmp_path / "no_head" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with pytest.raises(
        CheckpointError,
        match=r"no_head: the checkpoint has no tensor 'lm_head.weight' \(its config "
        r"does not tie the output layer to the embeddings\)",
    ):
        attach_language_head(load_critic(tmp_path / "no_head"), tmp_path / "no_head")
    pairs = write_pairs(tmp_path / "pairs.jsonl", ARITHMETIC_PAIRS)
    refused = run_cli(*pair_run_args("rm", tmp_path / "no_head", tmp_path, pairs, "preference.nll_weight=1"))
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "no_head: the checkpoint has no tensor 'lm_head.weight' (its config does not tie the output layer to the "
            "embeddings); the reward model's language-model regulariser reads that output layer "
            "(preference.nll_weight=0 trains without it)"
        )
    )
    assert not (tmp_path / "rm" / "trial0" / "model").exists()


# ------------------------------------------------------------------------------------------ the pair loader


def test_conversation_pairs_split_at_the_last_assistant_turn():
    shared = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    row = {
        "chosen": shared + [{"role": "assistant", "content": "4"}],
        "rejected": shared + [{"role": "assistant", "content": "5"}],
    }
    split = split_conversations(row, "chosen", "rejected", "prompt")
    assert (split["prompt"], split["chosen"], split["rejected"]) == (shared, "4", "5")
    diverging = {**row, "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "5"}]}
    assert split_conversations(diverging, "chosen", "rejected", "prompt")["chosen"] is None  # dropped later
    assert split_conversations({"prompt": "p", "chosen": "a", "rejected": "b"}, "chosen", "rejected", "prompt") == {
        "prompt": "p",
        "chosen": "a",
        "rejected": "b",
    }


def test_bad_pairs_are_dropped_and_counted_in_one_line(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    rows = ARITHMETIC_PAIRS + [
        {"prompt": "What is 1+1?", "chosen": "2", "rejected": None},
        {"prompt": "What is 2+2?", "chosen": "4", "rejected": "4"},
        {"prompt": "What is 3+3?", "chosen": "6" * 300, "rejected": "7"},
    ]
    said = []
    cfg = PreferenceConfig(
        path=write_pairs(tmp_path / "p.jsonl", rows), eval_path=write_pairs(tmp_path / "e.jsonl", ARITHMETIC_PAIRS[:2])
    )
    train, held_out = load_pairs(cfg, 0, tokenizer, 64, say=said.append)
    assert (len(train), len(held_out)) == (6, 2)
    assert said == [
        "dropped 3 training pairs: 1 with a missing side (first: p.jsonl/6); 1 with identical sides "
        "(first: p.jsonl/7); 1 longer than 64 tokens (first: p.jsonl/8)",
        "2 of 2 held-out pairs ask a prompt that training pairs ask too: their accuracy partly measures "
        "memory; hold out other prompts with preference.eval_path (areal-hpc pairs --split eval)",
    ]
    sequence, mask = train[0].sequences()[0]
    assert tokenizer.decode([t for t, m in zip(sequence, mask) if m]) == "7" + tokenizer.eos_token


def test_held_out_pairs_of_training_prompts_are_counted_and_others_are_not(tiny_model_dir, tmp_path):
    """A file that repeats its prompts (a task drawing from few problems) split by seed: the held-out pairs
    whose prompt training pairs ask too are counted, exactly; prompts of their own are not."""
    tokenizer = load_tokenizer(tiny_model_dir)
    repeated = [dict(row, rejected=str(int(row["chosen"]) + 10 * k)) for row in ARITHMETIC_PAIRS for k in (1, 2, 3)]
    said = []
    train, held_out = load_pairs(
        PreferenceConfig(path=write_pairs(tmp_path / "r.jsonl", repeated), eval_size=6),
        0,
        tokenizer,
        64,
        say=said.append,
    )
    asked = {tuple(p.prompt_ids) for p in train}
    shared = sum(tuple(p.prompt_ids) in asked for p in held_out)
    assert shared > 0 and said == [
        f"{shared} of 6 held-out pairs ask a prompt that training pairs ask too: their "
        "accuracy partly measures memory; hold out other prompts with "
        "preference.eval_path (areal-hpc pairs --split eval)"
    ]
    said.clear()
    others = [dict(row, prompt=row["prompt"].replace("+", " plus ")) for row in ARITHMETIC_PAIRS]
    load_pairs(
        PreferenceConfig(
            path=write_pairs(tmp_path / "r.jsonl", repeated), eval_path=write_pairs(tmp_path / "o.jsonl", others)
        ),
        0,
        tokenizer,
        64,
        say=said.append,
    )
    assert said == []


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "p", "good": "a", "rejected": "b"}],
            "config key 'preference.chosen_field': .* has no column 'chosen'; its columns are prompt, good, rejected",
        ),
        (
            [{"question": "p", "chosen": "a", "rejected": "b"}],
            "config key 'preference.prompt_field': .* has no column 'prompt'; "
            "its columns are question, chosen, rejected",
        ),
        ([{"prompt": "p", "chosen": "a", "rejected": "a"}], "no usable training pair"),
    ],
)
def test_unusable_pair_files_are_one_clear_error(tiny_model_dir, tmp_path, rows, message):
    cfg = PreferenceConfig(path=write_pairs(tmp_path / "p.jsonl", rows * 4), eval_size=1)
    with pytest.raises(UserError, match=message):
        load_pairs(cfg, 0, load_tokenizer(tiny_model_dir), 4096, say=lambda line: None)


def test_pairs_from_episodes_take_best_against_worst_where_rewards_differ():
    episodes = [
        {"prompt": "a", "completion": c, "reward": r, "answer": "1"} for c, r in [("1", 1.0), ("2", 0.0), ("1 ", 1.0)]
    ]
    episodes += [{"prompt": "b", "completion": c, "reward": 0.0, "answer": "9"} for c in ("3", "4", "5")]
    assert pairs_from_episodes(episodes, 3) == [
        {"prompt": "a", "chosen": "1", "rejected": "2", "answer": "1", "chosen_reward": 1.0, "rejected_reward": 0.0}
    ]


@FAST
@given(
    st.lists(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6), min_size=1, max_size=5),
    st.dictionaries(st.sampled_from("abcdef"), st.sampled_from([0.0, 0.5, 1.0]), min_size=6),
)
def test_all_pairing_is_every_distinct_completion_against_every_one_rewarded_lower(groups, reward_of):
    """Against an enumeration: per prompt, the set of (chosen, rejected) texts of ``--pairing all`` is every
    ordered pair of distinct sampled texts whose rewards differ, the higher chosen; each once."""
    n = max(map(len, groups))
    episodes = []
    for g, texts in enumerate(groups):
        padded = texts + [texts[-1]] * (n - len(texts))  # pairs_from_episodes reads n consecutive episodes
        episodes += [{"prompt": f"p{g}", "completion": t, "reward": reward_of[t], "answer": ""} for t in padded]
    rows = pairs_from_episodes(episodes, n, "all")
    got = [(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    want = {
        (f"p{g}", a, b)
        for g, texts in enumerate(groups)
        for a in set(texts)
        for b in set(texts)
        if reward_of[a] > reward_of[b]
    }
    assert len(got) == len(set(got)) and set(got) == want
    assert all(r["chosen_reward"] > r["rejected_reward"] for r in rows)
    best_worst = pairs_from_episodes(episodes, n)
    assert {(r["prompt"], r["chosen"], r["rejected"]) for r in best_worst} <= want
    assert len(best_worst) == sum(len({reward_of[t] for t in texts}) > 1 for texts in groups)


# --------------------------------------------------------------------------------------- the commands, end to end


def pair_run_args(command: str, model, fileroot, pairs: str, *extra: str) -> list[str]:
    return [
        command,
        "--config",
        "configs/quickstart.yaml",
        f"model.path={model}",
        f"cluster.fileroot={fileroot}",
        f"experiment.name={command}",
        f"preference.path={pairs}",
        "preference.eval_size=4",
        "preference.total_train_steps=3",
        "preference.eval_every_steps=2",
        "preference.batch_size=4",
        "stats.tensorboard=false",
        *extra,
    ]


@pytest.mark.slow
def test_dpo_caches_its_reference_and_reports_task_accuracy(tiny_model_dir, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", ARITHMETIC_PAIRS * 2)
    args = pair_run_args("dpo", tiny_model_dir, tmp_path, pairs, "preference.eval_task=true", "dataset.eval_size=8")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "dpo" / "trial0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/pair_accuracy" in r] == [0, 2, 3]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 3]  # the task, greedy
    assert all(math.isfinite(r["train/loss"]) for r in records if "train/loss" in r)
    assert (run / "model" / "config.json").is_file() and (run / "dpo_curves.png").stat().st_size > 0
    assert "reference log-likelihoods read from" not in first.stdout
    again = run_cli(*args, "experiment.trial=trial1")  # another trial, same model and pairs: the cached reference
    assert again.returncode == 0 and "reference log-likelihoods read from" in again.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trained_reward_model_scores_the_rl_rollouts(tiny_model_dir, tmp_path):
    """`areal-hpc rm`, then `areal-hpc train reward.model=...`: every trajectory's reward is the reward model's
    score of its tokens; held-out accuracy is still the task's rule."""
    from areal_hpc.data.shards.reader import TrajectoryStore
    from areal_hpc.models.hf import read_checkpoint
    from areal_hpc.train.reward_model import RewardModelScore

    pairs = write_pairs(tmp_path / "pairs.jsonl", ARITHMETIC_PAIRS * 2)
    trained = run_cli(*pair_run_args("rm", tiny_model_dir, tmp_path, pairs, "preference.nll_weight=1"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "rm: held-out pair accuracy before" in trained.stdout
    records = [json.loads(line) for line in (tmp_path / "rm" / "trial0" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert steps and all(r["train/chosen_nll"] > 0 for r in steps)  # the regulariser was on
    assert all(r["train/loss"] > r["train/chosen_nll"] for r in steps)  # the objective: Bradley-Terry + 1 x NLL
    reward_model = tmp_path / "rm" / "trial0" / "model"
    assert not any(name.startswith("language_head") for name in read_checkpoint(reward_model))  # the critic alone
    result = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        f"reward.model={reward_model}",
        "rl.total_train_steps=2",
        "rl.eval_every_steps=2",
        "dataset.train_size=32",
        "dataset.eval_size=8",
        "rl.sft_warmup_steps=0",
        "rollout.consumer_batch_size=2",
        "generation.n_samples=2",
        "generation.max_new_tokens=4",
        "stats.tensorboard=false",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "quickstart" / "trial0"
    score = RewardModelScore(str(reward_model))
    with TrajectoryStore(run / "shards") as store:
        trajectories = list(store.trajectories())
    assert trajectories
    for traj in trajectories:
        segment = traj.segments[0]
        want = score("", "", segment.input_ids.tolist(), segment.output_ids.tolist())
        assert traj.reward == pytest.approx(want, abs=1e-4)
    assert len({round(t.reward, 6) for t in trajectories}) > 2  # real scores, not a rule's 0/1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]


@pytest.fixture(scope="module")
def critic_score(tiny_model_dir, tmp_path_factory):
    """A reward model's scorer on a saved critic of the tiny model (its head random, fixed once saved)."""
    from areal_hpc.train.reward_model import RewardModelScore

    torch.manual_seed(0)
    folder = save_model(load_critic(tiny_model_dir), load_tokenizer(tiny_model_dir), tmp_path_factory.mktemp("critic"))
    return RewardModelScore(str(folder))


@settings(deadline=None, max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    budget=st.sampled_from([1, 64, 16384]),
    seed=st.integers(0, 2**16),
)
def test_reward_model_scores_a_padded_batch_as_each_sequence_alone(critic_score, lengths, budget, seed):
    """Right-padded rows, longest first, in forwards of at most TOKENS_PER_FORWARD tokens (1: one row each;
    64: several rows; 16384: all): each score is the value after that sequence's last token, scored alone."""
    from areal_hpc.data.rewards import RewardRequest
    from areal_hpc.train import reward_model

    model = critic_score.load()
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        alone = [float(model(input_ids=torch.tensor([s])).logits[0, -1, 0]) for s in sequences]
    requests = [RewardRequest("", "", s[:1], s[1:], {}) for s in sequences]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reward_model, "TOKENS_PER_FORWARD", budget)
        assert critic_score.score_batch(requests) == pytest.approx(alone, abs=1e-5)


def test_bad_reward_models_and_pair_requests_are_one_line(tiny_model_dir, tmp_path):
    not_a_reward_model = run_cli(
        "train", "--config", "configs/quickstart.yaml", f"cluster.fileroot={tmp_path}", f"reward.model={tiny_model_dir}"
    )
    assert not_a_reward_model.returncode == 2
    assert (
        not_a_reward_model.stderr.strip()
        .splitlines()[-1]
        .endswith("without a value head; train a reward model with `areal-hpc rm` and give its <run>/model")
    )
    both = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"cluster.fileroot={tmp_path}",
        f"reward.model={tiny_model_dir}",
        "reward.fn=areal_hpc.reward.match:exact_match_reward",
    )
    assert both.returncode == 2 and "'reward.fn' and 'reward.model' are both set" in both.stderr
    one_sample = run_cli("pairs", "--model", str(tiny_model_dir), "--out", str(tmp_path / "p.jsonl"), "--samples", "1")
    assert one_sample.returncode == 2 and "--samples must be at least 2" in one_sample.stderr
    no_pairs = run_cli(
        "dpo", "--config", "configs/quickstart.yaml", f"model.path={tiny_model_dir}", f"cluster.fileroot={tmp_path}"
    )
    assert no_pairs.returncode == 2 and "config key 'preference.path' is empty" in no_pairs.stderr
