"""On-policy distillation from a served teacher: the per-token advantage against a float64 loop, its
policy gradient against the exact gradient of the reverse KL (every token of a vocabulary enumerated),
the advantages of a batch mixing reward and teacher, and a run against a real ``areal-hpc serve`` teacher;
bad teachers are refused in one line."""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.advantages import distillation_advantages, sequence_advantages
from areal_hpc.algo.ppo import PPOLossConfig, decoupled_ppo_loss
from areal_hpc.config import ActorConfig
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.rollout.teacher import TeacherClient
from areal_hpc.train.actor import PPOActor, loss_config
from areal_hpc.train.trajectory_batch import build_batch
from tests.conftest import embedded_server, run_cli
from tests.system.test_async_rl import SMALL_RUN, metrics

LOGPROBS = st.floats(-30.0, 0.0, allow_nan=False)
PEAK = 3.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(LOGPROBS, LOGPROBS, st.booleans()), min_size=1, max_size=40))
def test_distillation_advantage_matches_a_float64_loop(rows):
    teacher, student, mask = (torch.tensor(column, dtype=torch.float64) for column in zip(*rows))
    got = distillation_advantages(teacher, student, mask.bool())
    want = [t - s if m else 0.0 for t, s, m in rows]
    assert got.tolist() == pytest.approx(want, rel=0, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_its_policy_gradient_is_minus_the_reverse_kl_gradient_over_a_whole_vocabulary(seed):
    """One position, every token y of a vocabulary of 11 as a sample of weight pi(y): our decoupled-PPO loss
    with the distillation advantage, on-policy, has exactly the gradient of KL(pi || teacher) (float64)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(11, generator=generator, dtype=torch.float64)).requires_grad_()
    teacher = torch.log_softmax(3 * torch.randn(11, generator=generator, dtype=torch.float64), 0)
    logp = torch.log_softmax(logits, 0)
    advantages = distillation_advantages(teacher, logp.detach(), torch.ones(11, dtype=torch.bool))
    cu_seqlens = torch.arange(12)  # each token its own sequence of one action
    loss, _ = decoupled_ppo_loss(
        logp,
        logp.detach(),
        logp.detach(),
        advantages,
        torch.ones(11, dtype=torch.bool),
        cu_seqlens,
        logp.detach().exp(),
        PPOLossConfig(eps_clip=0.2),
    )
    (ppo_gradient,) = torch.autograd.grad(loss, logits, retain_graph=True)
    reverse_kl = (logp.exp() * (logp - teacher)).sum()
    (kl_gradient,) = torch.autograd.grad(reverse_kl, logits)
    assert torch.allclose(ppo_gradient, kl_gradient, rtol=1e-10, atol=1e-12)
    assert kl_gradient.abs().max() > 1e-3  # a teacher the student differs from


def _trajectory(prompt, output, logprobs, group, reward):
    segment = Segment(prompt, output, logprobs, [0] * len(output))
    return Trajectory([segment], group_id=group, rewards=[Reward(reward, source="rule")])


def test_a_batch_scales_the_reward_and_its_loss_pulls_the_proximal_policy_towards_the_teacher():
    """build_batch: the reward's advantages x reward_weight, the teacher's scores in the packed layout;
    the policy loss: kl_weight x (teacher - proximal logprob) added on the targets, against the policy
    of the step's start (not the sampler's, which may be versions behind)."""
    trajectories = [
        _trajectory([1, 2, 3], [4, 5], [-0.5, -1.0], "g", 1.0),
        _trajectory([1, 2], [6, 7, 8], [-2.0, -0.1, -0.3], "g", 0.0),
    ]
    teacher = [[np.nan, np.nan, np.nan, -0.2, -3.0], [np.nan, np.nan, -1.0, -0.1, -0.9]]
    batch = build_batch(trajectories, ActorConfig(), 8, 1.0, teacher, reward_weight=2.0)
    grpo = sequence_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "grpo").tolist()
    for values, reward_advantage in zip(batch.fields["advantages"], grpo):
        assert values.tolist() == pytest.approx([2 * reward_advantage] * len(values))
    # position t is about token t+1: the first sequence's targets are positions 2 and 3
    assert torch.cat(batch.fields["teacher_logprobs"]).tolist() == pytest.approx(
        [0, 0, -0.2, -3.0, 0] + [0, -1.0, -0.1, -0.9, 0]
    )

    packed, fields = batch.packed()
    fields["weights"] = torch.full((len(packed.target_mask),), 0.1)
    proximal = torch.linspace(-2.0, -0.1, len(packed.target_mask))
    fields["prox_logprobs"] = proximal
    logprobs = (proximal + 0.05).requires_grad_()
    outputs = {"logprobs": logprobs, "entropy": torch.zeros_like(logprobs)}
    loss, _ = PPOActor(None, ActorConfig(), distill_weight=0.5)._policy_loss(outputs, packed, fields)
    pulled = fields["advantages"] + 0.5 * torch.where(packed.target_mask, fields["teacher_logprobs"] - proximal, 0.0)
    want, _ = decoupled_ppo_loss(
        logprobs,
        proximal,
        fields["behav_logprobs"],
        pulled,
        packed.target_mask,
        packed.cu_seqlens,
        fields["weights"],
        loss_config(ActorConfig()),
    )
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    without, _ = PPOActor(None, ActorConfig())._policy_loss(
        outputs, packed, {**fields, "teacher_logprobs": 0 * proximal}
    )
    assert abs(without.item() - want.item()) > 1e-3  # the teacher's term matters here


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its output layer scaled up: far from uniform, so that a logprob of the wrong
    token is far from the right one's."""
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAK)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("peaked") / "model")


@pytest.mark.distributed
def test_a_run_distils_from_a_served_teacher(peaked_model_dir, tmp_path):
    """The teacher is the student's own start, served by `areal-hpc serve`: the first batch (sampled by those
    same weights at temperature 1) has a reverse KL of 0, and the teacher's logprob of every token the
    student sampled with those weights is the one the student recorded, token for token."""
    from areal_hpc.data.shards.reader import TrajectoryStore
    from areal_hpc.train.distill import Teacher

    with embedded_server(peaked_model_dir, tmp_path / "teacher") as (_, address):
        result = run_cli(
            "train",
            "--config",
            "configs/quickstart.yaml",
            f"model.path={peaked_model_dir}",
            f"cluster.fileroot={tmp_path}",
            *SMALL_RUN,
            "rl.total_train_steps=2",
            "rl.eval_every_steps=0",
            f"distill.teacher_url=http://{address}",
            "distill.reward_weight=0",
            timeout=400,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        run = tmp_path / "quickstart" / "trial0"
        with TrajectoryStore(run / "shards") as store:
            first_weights = [t for t in store.trajectories() if not t.segments[0].output_versions.any()]
        assert first_weights
        scores, _ = asyncio.run(_score(Teacher, f"http://{address}", first_weights))
    records = [r for r in metrics(run) if "distill/reverse_kl" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["distill/reverse_kl"]) < 1e-3, records
    for trajectory, teacher in zip(first_weights, scores):
        segment = trajectory.segments[0]
        assert np.allclose(teacher[len(segment.input_ids) :], segment.output_logprobs, atol=1e-3)
        assert segment.output_logprobs.std() > 0.1  # tokens the student was unsure of: an order would show


async def _score(teacher_class, url, trajectories):
    async with TeacherClient(url) as client:
        return await teacher_class(client).score(trajectories, 1.0)


def test_bad_teachers_are_refused_in_one_line(tiny_model_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: same size, other tokens
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    base = [
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        *SMALL_RUN,
    ]
    with embedded_server(tiny_model_dir, tmp_path / "teacher") as (_, address):
        mismatch = run_cli(*base, f"distill.teacher_url=http://{address}", f"distill.teacher_tokenizer={other}")
        gae = run_cli(*base, f"distill.teacher_url=http://{address}", "actor.adv_estimator=ppo")
    unreachable = run_cli(*base, "distill.teacher_url=http://127.0.0.1:9")
    for result, message in [
        (mismatch, "is not the student's: "),
        (gae, "needs a sequence advantage estimator"),
        (unreachable, "the teacher at http://127.0.0.1:9 cannot be reached"),
    ]:
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert not (tmp_path / "quickstart").exists()  # refused before the run's processes started
