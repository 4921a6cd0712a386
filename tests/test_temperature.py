"""The trainer uses the sampler's temperature: its logprobs equal those a real rollout server reports
at T = 0.7 and 1.3 (top-p / top-k truncation included, which leaves reported logprobs untruncated)
and for greedy rollouts (T = 1), and one decoupled-PPO step at T = 1.3 equals a float64 reference
written from the formula."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from areal_hpc.config import load_config
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.build import build_actor
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.train.trajectory_batch import build_batch, split_minibatches

from .conftest import embedded_server
from .test_algorithms import reference_sequence_advantages
from .trainer_processes import synthetic_batch

PROMPTS = ["What is 3 + 4?", "What is 12 + 30?", "What is 7 + 7?"]


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with logits scaled up six-fold (final norm): peaked enough that the temperature
    moves every logprob by far more than the tolerances here."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return save_model(model, load_tokenizer(tiny_model_dir), tmp_path_factory.mktemp("peaked") / "model")


def trainer_actor(model_dir, *overrides: str):
    cfg = load_config(None, [f"model.path={model_dir}", "rl.total_train_steps=1", *overrides])
    return build_actor(cfg, None)[0], cfg


@pytest.fixture(scope="module")
def server(peaked_model_dir, tmp_path_factory):
    with embedded_server(peaked_model_dir, tmp_path_factory.mktemp("server")) as (_, address):
        yield address


@pytest.mark.parametrize("gconfig, sampling, other_temperature", [
    ({"temperature": 0.7}, {"temperature": 0.7}, 1.0),
    ({"temperature": 1.3, "top_p": 0.8, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8, "top_k": 20}, 1.0),
    # greedy rollouts are requests at temperature 0, whose logprobs are reported at temperature 1
    ({"temperature": 0.7, "greedy": True}, {"temperature": 0.0}, 0.7),
])
def test_trainer_logprobs_equal_the_servers_at_the_sampling_temperature(peaked_model_dir, server, gconfig, sampling,
                                                                        other_temperature):
    tokenizer = load_tokenizer(peaked_model_dir)
    sampling = {"max_new_tokens": 24, "ignore_eos": True, **sampling}

    async def generate():
        async with RolloutClient([server]) as client:
            return await asyncio.gather(*(client.generate(prompt_ids(tokenizer, p), sampling) for p in PROMPTS))

    generations = asyncio.run(generate())
    batch = SequenceBatch([g.input_ids + g.output_ids for g in generations],
                          [[0] * len(g.input_ids) + [1] * len(g.output_ids) for g in generations])
    served = torch.tensor([lp for g in generations for lp in g.logprobs])

    def trainer_logprobs(**gconfig_of_trainer) -> torch.Tensor:
        actor, _ = trainer_actor(peaked_model_dir, *(f"gconfig.{k}={v}" for k, v in gconfig_of_trainer.items()))
        out = actor.actor.forward(batch)["logprobs"]  # position t: the logprob of token t + 1
        return torch.cat([lp[len(g.input_ids) - 1:-1] for lp, g in zip(out, generations)])

    torch.testing.assert_close(trainer_logprobs(**gconfig), served, atol=1e-4, rtol=0)
    # the check has teeth: logprobs at another temperature (T = 1 is what the trainer used to compute) are far off
    assert (trainer_logprobs(temperature=other_temperature) - served).abs().max() > 0.05


def reference_ppo_step(model_dir, trajectories, temperature: float, eps_clip: float, cap: float):
    """Loss and gradients of one decoupled-PPO step in float64, token by token from the formula:
    token-mean of −min(w, cap)·min(u·A, clip(u, 1 ± ε)·A), u = π_θ/π_prox, w = π_prox/π_behav, with
    π = softmax(logits / T), GRPO advantages, and π_prox = π_θ before the step (the on-policy first step)."""
    model = load_model(model_dir).double()
    advantages = reference_sequence_advantages([t.reward for t in trajectories], [t.group_id for t in trajectories],
                                               "grpo", 1e-6)
    n_tokens = sum(len(t.segments[0].output_ids) for t in trajectories)
    loss = torch.zeros((), dtype=torch.float64)
    for traj, advantage in zip(trajectories, advantages):
        segment = traj.segments[0]
        ids = segment.input_ids.tolist() + segment.output_ids.tolist()
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        for k, token in enumerate(segment.output_ids.tolist()):
            logp = torch.log_softmax(logits[len(segment.input_ids) - 1 + k] / temperature, dim=-1)[token]
            prox = logp.item()
            w = min(math.exp(prox - float(segment.output_logprobs[k])), cap)
            u = torch.exp(logp - prox)
            surrogate = torch.minimum(u * advantage, u.clamp(1 - eps_clip, 1 + eps_clip) * advantage)
            loss = loss - w * surrogate / n_tokens
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def test_one_ppo_step_at_temperature_equals_the_float64_reference(peaked_model_dir):
    temperature = 1.3
    actor, cfg = trainer_actor(peaked_model_dir, f"gconfig.temperature={temperature}", "optimizer.gradient_clipping=0",
                               "actor.max_tokens_per_mb=64")  # several micro-batches
    trajectories = synthetic_batch(len(load_tokenizer(peaked_model_dir)))
    batch = build_batch(trajectories, cfg.actor, cfg.gconfig.max_new_tokens)
    minibatches = split_minibatches(batch, trajectories, cfg.actor, cfg.gconfig.max_new_tokens)
    stats = actor.update(minibatches)

    want_loss, want_grads = reference_ppo_step(peaked_model_dir, trajectories, temperature, cfg.actor.eps_clip,
                                               cfg.actor.behav_imp_weight_cap)
    assert stats["actor/microbatches"] > 1
    assert stats["actor/loss"] == pytest.approx(want_loss, rel=1e-5)
    got_grads = {name: p.grad for name, p in actor.actor.model.named_parameters()}
    norm = math.sqrt(sum(float(g.square().sum()) for g in want_grads.values()))
    assert stats["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name].double(), want, rtol=1e-3, atol=1e-5 * norm, msg=name)
    # the same step at T = 1 is a different step: the temperature is not lost anywhere on the way
    assert abs(reference_ppo_step(peaked_model_dir, trajectories, 1.0, cfg.actor.eps_clip,
                                  cfg.actor.behav_imp_weight_cap)[0] - want_loss) > 100 * 1e-5 * abs(want_loss)
