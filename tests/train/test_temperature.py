"""The trainer uses the sampler's temperature: its logprobs equal those a real rollout server reports
at T = 0.7 and 1.3 (top-p / top-k truncation included, which leaves reported logprobs untruncated)
and for greedy rollouts (T = 1), and one decoupled-PPO step at T = 1.3 equals a float64 reference
written from the formula. Agents' turns through the login-node proxy are trained at the temperature
each turn was sampled at, not the run's. The temperature rule itself (``algo.temperature``) is
checked as properties, and against every place that applies it."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.agents.engine import Sampling
from areal_hpc.algo.temperature import (
    MIN_TEMPERATURE,
    is_greedy,
    is_servable,
    logprob_temperature,
    requested_temperature,
    run_temperature,
)
from areal_hpc.config import GenerationConfig, load_config
from areal_hpc.data.shards import TrajectoryStore
from areal_hpc.engines.base import sampler_temperature
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.proxy.openai_api import sampling_params
from areal_hpc.resolve import Host, resolve
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.embedded_engine import RequestError, SamplingParams
from areal_hpc.rollout.sampling import SlotSampler
from areal_hpc.train.build import build_actor
from areal_hpc.train.trajectory_batch import build_batch, split_minibatches
from tests.algo.test_algorithms import reference_sequence_advantages
from tests.conftest import embedded_server
from tests.proxy_helpers import call, proxy_config, running_proxy, start_session, write_keys
from tests.trainer_processes import synthetic_batch

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
    loaded = load_config(None, [f"model.path={model_dir}", "rl.total_train_steps=1", *overrides])
    cfg = resolve(loaded, Host.probe()).cfg
    return build_actor(cfg, None)[0], cfg


@pytest.fixture(scope="module")
def server(peaked_model_dir, tmp_path_factory):
    with embedded_server(peaked_model_dir, tmp_path_factory.mktemp("server")) as (_, address):
        yield address


@pytest.mark.parametrize(
    "generation, sampling, other_temperature",
    [
        ({"temperature": 0.7}, {"temperature": 0.7}, 1.0),
        ({"temperature": 1.3, "top_p": 0.8, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8, "top_k": 20}, 1.0),
        # greedy rollouts are requests at temperature 0, whose logprobs are reported at temperature 1
        ({"temperature": 0.7, "greedy": True}, {"temperature": 0.0}, 0.7),
    ],
)
def test_trainer_logprobs_equal_the_servers_at_the_sampling_temperature(
    peaked_model_dir, server, generation, sampling, other_temperature
):
    tokenizer = load_tokenizer(peaked_model_dir)
    sampling = {"max_new_tokens": 24, "ignore_eos": True, **sampling}

    async def generate():
        async with RolloutClient([server]) as client:
            return await asyncio.gather(*(client.generate(prompt_ids(tokenizer, p), sampling) for p in PROMPTS))

    generations = asyncio.run(generate())
    batch = SequenceBatch(
        [g.input_ids + g.output_ids for g in generations],
        [[0] * len(g.input_ids) + [1] * len(g.output_ids) for g in generations],
    )
    served = torch.tensor([lp for g in generations for lp in g.logprobs])

    def trainer_logprobs(**trainer_generation) -> torch.Tensor:
        actor, _ = trainer_actor(peaked_model_dir, *(f"generation.{k}={v}" for k, v in trainer_generation.items()))
        out = actor.actor.forward(batch)["logprobs"]  # position t: the logprob of token t + 1
        return torch.cat([lp[len(g.input_ids) - 1 : -1] for lp, g in zip(out, generations)])

    torch.testing.assert_close(trainer_logprobs(**generation), served, atol=1e-4, rtol=0)
    # the check has teeth: logprobs at another temperature (T = 1 is what the trainer used to compute) are far off
    assert (trainer_logprobs(temperature=other_temperature) - served).abs().max() > 0.05


def reference_ppo_step(model_dir, trajectories, temperature: float, eps_clip: float, cap: float):
    """Loss and gradients of one decoupled-PPO step in float64, token by token from the formula:
    token-mean of −min(w, cap)·min(u·A, clip(u, 1 ± ε)·A), u = π_θ/π_prox, w = π_prox/π_behav, with
    π = softmax(logits / T), T a segment's recorded temperature or else ``temperature`` (no greedy
    segments), GRPO advantages, and π_prox = π_θ before the step (the on-policy first step)."""
    model = load_model(model_dir).double()
    advantages = reference_sequence_advantages(
        [t.reward for t in trajectories], [t.group_id for t in trajectories], "grpo", 1e-6
    )
    n_tokens = sum(t.n_output_tokens for t in trajectories)
    loss = torch.zeros((), dtype=torch.float64)
    for traj, advantage in zip(trajectories, advantages):
        ids = [int(i) for s in traj.segments for i in [*s.input_ids, *s.output_ids]]
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        start = 0
        for segment in traj.segments:
            start += len(segment.input_ids)
            t = temperature if segment.temperature is None else segment.temperature
            for k, token in enumerate(segment.output_ids.tolist()):
                logp = torch.log_softmax(logits[start - 1 + k] / t, dim=-1)[token]
                prox = logp.item()
                w = min(math.exp(prox - float(segment.output_logprobs[k])), cap)
                u = torch.exp(logp - prox)
                surrogate = torch.minimum(u * advantage, u.clamp(1 - eps_clip, 1 + eps_clip) * advantage)
                loss = loss - w * surrogate / n_tokens
            start += len(segment.output_ids)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def test_one_ppo_step_at_temperature_equals_the_float64_reference(peaked_model_dir):
    temperature = 1.3
    actor, cfg = trainer_actor(
        peaked_model_dir,
        f"generation.temperature={temperature}",
        "optimizer.gradient_clipping=0",
        "actor.max_tokens_per_mb=64",
    )  # several micro-batches
    trajectories = synthetic_batch(len(load_tokenizer(peaked_model_dir)))
    batch = build_batch(trajectories, cfg.actor, cfg.generation.max_new_tokens, run_temperature(cfg.generation))
    minibatches = split_minibatches(batch, trajectories, cfg.actor, cfg.generation.max_new_tokens)
    stats = actor.update(minibatches)

    want_loss, want_grads = reference_ppo_step(
        peaked_model_dir, trajectories, temperature, cfg.actor.eps_clip, cfg.actor.behav_imp_weight_cap
    )
    assert stats["actor/microbatches"] > 1
    assert stats["actor/loss"] == pytest.approx(want_loss, rel=1e-5)
    got_grads = {name: p.grad for name, p in actor.actor.model.named_parameters()}
    norm = math.sqrt(sum(float(g.square().sum()) for g in want_grads.values()))
    assert stats["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name].double(), want, rtol=1e-3, atol=1e-5 * norm, msg=name)
    # the same step at T = 1 is a different step: the temperature is not lost anywhere on the way
    assert abs(
        reference_ppo_step(peaked_model_dir, trajectories, 1.0, cfg.actor.eps_clip, cfg.actor.behav_imp_weight_cap)[0]
        - want_loss
    ) > 100 * 1e-5 * abs(want_loss)


def test_proxy_turns_are_trained_at_the_temperature_they_were_sampled_at(peaked_model_dir, server, tmp_path):
    """Agents pick their temperature per request: a session of two turns at T = 0.5 and 1.3, another of one
    at T = 0.5, through a real proxy and the real ``openai`` client, are recorded with those temperatures,
    and a trainer whose run samples at T = 1 computes their logprobs equal to those the server reported
    and takes the decoupled-PPO step of the float64 reference at each turn's temperature."""
    keys = tmp_path / "keys.yaml"
    write_keys(keys, {"agents": {"keys": ["tk"]}})
    cfg = proxy_config(peaked_model_dir, tmp_path / "proxy", [server], keys)
    served, session_ids = {}, []
    with running_proxy(cfg) as (base, proxy, _):
        for temperatures, reward in [((0.5, 1.3), 1.0), ((0.5,), 0.0)]:
            session_id, key = start_session(base, "tk")
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            messages = [{"role": "user", "content": "What is 2+3?"}]
            for temperature in temperatures:
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=8, temperature=temperature, logprobs=True
                )
                served.setdefault(session_id, []).append([t.logprob for t in reply.choices[0].logprobs.content])
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "Sure?"},
                ]
            assert call(base, "/rl/set_reward", {"reward": reward}, key)[0] == 200
            assert call(base, "/rl/end_session", {}, key)[0] == 200
            session_ids.append(session_id)
        with TrajectoryStore(proxy.sink.writer.directory) as store:
            by_session = {t.session_id: t for t in store.trajectories()}
    records = [by_session[s] for s in session_ids]
    assert [[s.temperature for s in r.segments] for r in records] == [[0.5, 1.3], [0.5]]
    for record, session_id in zip(records, session_ids):
        for segment, logprobs in zip(record.segments, served[session_id], strict=True):
            assert segment.output_logprobs.tolist() == pytest.approx(logprobs, abs=1e-6)

    actor, run = trainer_actor(peaked_model_dir, "generation.temperature=1.0")
    batch = build_batch(records, run.actor, run.generation.max_new_tokens, run_temperature(run.generation))
    targets = [torch.tensor(mask[1:] + [0], dtype=torch.bool) for mask in batch.loss_masks]  # position t: token t+1
    behaviour = torch.cat([b[t] for b, t in zip(batch.fields["behav_logprobs"], targets)])

    def trainer_logprobs(of: SequenceBatch) -> torch.Tensor:
        return torch.cat([lp[t] for lp, t in zip(actor.actor.forward(of)["logprobs"], targets)])

    torch.testing.assert_close(trainer_logprobs(batch), behaviour, atol=1e-4, rtol=0)
    # the check has teeth: at the run's temperature (what the trainer used to compute for them) they are far off
    at_run_temperature = SequenceBatch(batch.sequences, batch.loss_masks, batch.fields)
    assert (trainer_logprobs(at_run_temperature) - behaviour).abs().max() > 0.05

    stats = actor.update(split_minibatches(batch, records, run.actor, run.generation.max_new_tokens))
    want_loss, want_grads = reference_ppo_step(
        peaked_model_dir, records, 1.0, run.actor.eps_clip, run.actor.behav_imp_weight_cap
    )
    assert stats["actor/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    norm = math.sqrt(sum(float(g.square().sum()) for g in want_grads.values()))
    assert stats["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


@given(st.just(0.0) | st.floats(0, 2) | st.floats(0, 2 * MIN_TEMPERATURE))
def test_a_requested_temperature_is_greedy_below_the_minimum_and_itself_above(temperature):
    sampled = requested_temperature(temperature)
    assert sampled == (temperature if temperature >= MIN_TEMPERATURE else 0.0)
    assert is_servable(sampled) and requested_temperature(sampled) == sampled
    assert is_greedy(sampled) == (temperature < MIN_TEMPERATURE)
    # the proxy sends exactly that, and a rollout server takes it
    params = sampling_params({"temperature": temperature}, 16, 16, [0])
    assert params["temperature"] == sampled
    assert SamplingParams.from_json({"temperature": params["temperature"]}).temperature == sampled


@given(st.floats(-1, MIN_TEMPERATURE, exclude_max=True).filter(lambda t: t != 0))
def test_a_rollout_server_refuses_a_temperature_it_cannot_sample_at(temperature):
    assert not is_servable(temperature)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams.from_json({"temperature": temperature})


@given(st.just(0.0) | st.floats(MIN_TEMPERATURE, 4))
def test_logprobs_are_at_the_sampling_temperature_and_at_1_for_greedy(temperature):
    assert logprob_temperature(temperature) == (1.0 if temperature == 0 else temperature)
    sampler = SlotSampler(1, torch.device("cpu"))
    sampler.set(0, temperature, top_k=-1, top_p=1.0)
    assert bool(sampler.greedy[0]) == is_greedy(temperature)
    assert float(sampler.temperature[0]) == pytest.approx(logprob_temperature(temperature), rel=1e-7)


@given(st.floats(0.01, 4), st.booleans())
def test_a_run_samples_at_its_temperature_or_greedily_and_trains_at_the_logprob_temperature(temperature, greedy):
    generation = GenerationConfig(temperature=temperature, greedy=greedy)
    assert (
        run_temperature(generation) == Sampling.from_config(generation).temperature == (0.0 if greedy else temperature)
    )
    cfg = load_config(None, [f"generation.temperature={temperature}", f"generation.greedy={str(greedy).lower()}"])
    assert (
        sampler_temperature(cfg)
        == logprob_temperature(run_temperature(cfg.generation))
        == (1.0 if greedy else temperature)
    )
