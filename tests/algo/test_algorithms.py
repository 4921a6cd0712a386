"""Advantages, decoupled PPO (with SAPO's gate and M2PO's trust region), value loss, aggregation weights
and DAPO filters against plain float64 loops; micro-batch and packing invariance of the loss and its
gradients.

The references below are written per sequence / per group / per token in Python floats, independent of
the vectorised code they check.
"""

import itertools
import math
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from areal_hpc.algo.advantages import expand_to_tokens, gae, outcome_token_rewards, sequence_advantages
from areal_hpc.algo.filters import is_informative_group, overlong_penalty
from areal_hpc.algo.packing import pack
from areal_hpc.algo.ppo import (
    AGGREGATIONS,
    BEHAV_CORRECTIONS,
    PPOLossConfig,
    decoupled_ppo_loss,
    second_moment_cut,
    token_weights,
    value_loss,
)
from areal_hpc.builtins import POINTS
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_model

FAST = settings(deadline=None, max_examples=40)
lengths_st = st.lists(st.integers(1, 9), min_size=1, max_size=7)


def random_batch(lengths: list[int], seed: int) -> dict:
    """A packed float64 batch: the last position of each sequence is never a loss token; logprobs < 0."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lengths).cumsum(0)
    n_tokens = cu[-1].item()
    mask = torch.rand(n_tokens, generator=g) < 0.7
    mask[cu[1:] - 1] = False

    def randn():
        return torch.randn(n_tokens, generator=g, dtype=torch.float64)

    behav = -3 * torch.rand(n_tokens, generator=g, dtype=torch.float64) - 1e-3
    prox = (behav + 0.8 * randn()).clamp(max=-1e-3)
    return dict(
        cu=cu,
        mask=mask,
        behav=behav,
        prox=prox,
        logp=(prox + 0.3 * randn()).clamp(max=-1e-3),
        ref=(prox + 0.3 * randn()).clamp(max=-1e-3),
        adv=randn(),
        values=randn(),
        rewards=randn(),
    )


def sequences_of(cu) -> list[range]:
    return [range(int(a), int(b)) for a, b in itertools.pairwise(cu)]


# ----------------------------------------------------------------------------------------- advantages


def pstd(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def reference_sequence_advantages(rewards, groups, estimator, eps):
    n = len(rewards)
    members = {gid: [j for j in range(n) if groups[j] == gid] for gid in set(groups)}
    group_mean = [sum(rewards[j] for j in members[groups[i]]) / len(members[groups[i]]) for i in range(n)]
    centred = [rewards[i] - group_mean[i] for i in range(n)]
    if estimator == "grpo":
        return [centred[i] / (pstd([rewards[j] for j in members[groups[i]]]) + eps) for i in range(n)]
    if estimator == "dr_grpo":
        return centred
    if estimator == "lite_ppo":
        return [c / (pstd(centred) + eps) for c in centred]
    if estimator == "rloo":
        out = []
        for i in range(n):
            others = [rewards[j] for j in members[groups[i]] if j != i]
            out.append(rewards[i] - sum(others) / len(others) if others else 0.0)
        return out
    base = rewards if estimator == "reinforce_pp" else centred
    mean = sum(base) / n
    return [(b - mean) / (pstd(base) + eps) for b in base]


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, -0.3, 2.0])), min_size=1, max_size=20),
    st.sampled_from(list(POINTS["advantage_estimator"].builtins)),
)
def test_sequence_advantages_match_reference(pairs, estimator):
    groups, rewards = [p[0] for p in pairs], [p[1] for p in pairs]
    got = sequence_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), estimator, eps=1e-6)
    want = reference_sequence_advantages(rewards, groups, estimator, 1e-6)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_users_own_estimator_gets_float64_and_gives_the_rewards_dtype(tmp_path):
    (tmp_path / "estimators.py").write_text(
        "import torch\n"
        "def best_of_group(rewards, group_ids, eps):\n"
        "    assert rewards.dtype == torch.float64\n"
        "    best = torch.zeros_like(rewards).scatter_reduce(0, group_ids, rewards, 'amax', include_self=False)\n"
        "    return rewards - best[group_ids]\n"
    )
    rewards = torch.tensor([1.0, 0.5, 2.0, -1.0], dtype=torch.float32)
    got = sequence_advantages(rewards, torch.tensor([0, 0, 1, 1]), f"{tmp_path}/estimators.py:best_of_group")
    assert got.dtype == torch.float32 and got.tolist() == [0.0, -0.5, 0.0, -3.0]


@pytest.mark.parametrize(
    ("estimator", "says"),
    [("ppo", "names no code"), ("gpro", "is not a built-in"), ("no_such_module_here:f", "cannot import")],
)
def test_an_estimator_that_names_no_function_is_one_line_naming_the_key(estimator, says):
    with pytest.raises(UserError, match=f"config key 'actor.adv_estimator': .*{says}") as err:
        sequence_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), estimator)
    assert "\n" not in str(err.value)


@FAST
@given(lengths_st, st.integers(0, 2**31), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_backwards_loop(lengths, seed, gamma, lam):
    b = random_batch(lengths, seed)
    token_rewards = torch.where(b["mask"], b["rewards"], 0.0)
    adv, ret = gae(token_rewards, b["values"], b["mask"], b["cu"], gamma, lam)
    want_adv, want_ret = [0.0] * len(b["mask"]), [0.0] * len(b["mask"])
    for seq in sequences_of(b["cu"]):
        actions = [t for t in seq if b["mask"][t]]
        running, next_value = 0.0, 0.0
        for t in reversed(actions):
            v = b["values"][t].item()
            running = token_rewards[t].item() + gamma * next_value - v + gamma * lam * running
            want_adv[t], want_ret[t] = running, running + v
            next_value = v
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64))


def test_outcome_reward_lands_on_last_loss_position_and_expands():
    cu = torch.tensor([0, 4, 6, 9])
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 1, 0, 0]).bool()  # the middle sequence has no loss token
    got = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, cu)
    assert got.tolist() == [0, 0, 1, 0, 0, 0, 3, 0, 0]
    assert expand_to_tokens(torch.tensor([1, 2, 3]), cu).tolist() == [1, 1, 1, 1, 2, 2, 3, 3, 3]
    # gamma = lam = 1 with zero values: every action's return is its sequence's outcome reward
    _, returns = gae(got, torch.zeros(9), mask, cu, 1.0, 1.0)
    assert returns.tolist() == [0, 1, 1, 0, 0, 0, 3, 0, 0]


# -------------------------------------------------------------------------------- PPO loss and weights


def reference_weights(mask, cu, aggregation, n_tokens, n_seqs, max_len):
    out = [0.0] * len(mask)
    for seq in sequences_of(cu):
        length = sum(bool(mask[t]) for t in seq)
        for t in seq:
            if mask[t]:
                out[t] = {
                    "token-mean": 1 / n_tokens,
                    "seq-mean-token-mean": 1 / (n_seqs * length),
                    "seq-mean-token-sum-norm": 1 / (n_seqs * max_len),
                }[aggregation]
    return out


def binary_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def reference_loss(b, weights, cfg: PPOLossConfig, trust_keep=None) -> dict:
    """The loss and the token counts of its statistics, token by token."""
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    out = {
        "loss": 0.0,
        "behav_weight_sum": 0.0,
        "loss_tokens": 0,
        "kept_tokens": 0,
        "clipped_tokens": 0,
        "capped_tokens": 0,
    }
    for seq in sequences_of(b["cu"]):
        tokens = [t for t in seq if b["mask"][t]]
        seq_log_ratio = sum(b["logp"][t].item() - b["prox"][t].item() for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            logp, prox, behav, adv = (b[k][t].item() for k in ("logp", "prox", "behav", "adv"))
            u = math.exp(seq_log_ratio if cfg.importance_level == "sequence" else logp - prox)
            w = math.exp(prox - behav)
            out["loss_tokens"] += 1
            out["behav_weight_sum"] += w  # before any correction: its mean is 1 when behav is the sampler's
            out["capped_tokens"] += w > cfg.behav_imp_weight_cap
            if cfg.policy_loss == "m2po":
                if not trust_keep[t]:
                    continue
            elif cfg.behav_correction == "none":
                w = 1.0
            elif cfg.behav_correction == "cap":
                w = min(w, cfg.behav_imp_weight_cap)
            elif cfg.behav_correction == "mask" and w > cfg.behav_imp_weight_cap:
                continue
            elif cfg.behav_correction == "kpop":
                p, q = math.exp(prox), math.exp(behav)
                if max(binary_kl(p, q), binary_kl(q, p)) > cfg.kpop_threshold:
                    continue
            out["kept_tokens"] += 1
            if cfg.policy_loss == "sapo":
                tau = cfg.sapo_tau_pos if adv > 0 else cfg.sapo_tau_neg
                objective = 4 / tau / (1 + math.exp(-tau * (u - 1))) * adv
            elif cfg.policy_loss == "m2po":
                objective = u * adv
            else:
                clipped = min(max(u, 1 - cfg.eps_clip), 1 + eps_high)
                out["clipped_tokens"] += clipped * adv < u * adv
                objective = min(u * adv, clipped * adv)
            ref_log_ratio = b["ref"][t].item() - logp
            k3 = math.exp(ref_log_ratio) - ref_log_ratio - 1
            out["loss"] += weights[t] * (-w * objective + cfg.kl_coef * k3)
    return out


def reference_trust_keep(log_ratios: list[float], threshold: float) -> list[bool]:
    """M2PO's masking as the paper states it: drop the largest (log r)² one at a time until the mean of the
    rest is within the threshold."""
    keep = [True] * len(log_ratios)
    while any(keep) and sum(r * r for r, k in zip(log_ratios, keep) if k) / sum(keep) > threshold:
        keep[max((i for i in range(len(keep)) if keep[i]), key=lambda i: log_ratios[i] ** 2)] = False
    return keep


@FAST
@given(lengths_st, st.integers(0, 2**31), st.sampled_from(AGGREGATIONS))
def test_token_weights_match_reference(lengths, seed, aggregation):
    b = random_batch(lengths, seed)
    n_tokens, n_seqs = int(b["mask"].sum()), len(lengths)
    got = token_weights(b["mask"], b["cu"], aggregation, n_tokens, n_seqs, 16, dtype=torch.float64)
    want = reference_weights(b["mask"], b["cu"], aggregation, n_tokens, n_seqs, 16)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def batch_trust_keep(b, threshold: float) -> list[bool]:
    """Per position: within M2PO's trust region of the batch's loss tokens (the reference masking)."""
    positions = [t for t in range(len(b["mask"])) if b["mask"][t]]
    kept = reference_trust_keep([b["prox"][t].item() - b["behav"][t].item() for t in positions], threshold)
    keep = [False] * len(b["mask"])
    for t, k in zip(positions, kept):
        keep[t] = k
    return keep


@FAST
@given(
    lengths_st,
    st.integers(0, 2**31),
    st.sampled_from(BEHAV_CORRECTIONS),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from([None, 0.28]),
    st.sampled_from([0.0, 0.1]),
    st.sampled_from(list(POINTS["policy_loss"].builtins)),
)
def test_decoupled_loss_matches_reference(lengths, seed, correction, level, eps_high, kl_coef, policy_loss):
    b = random_batch(lengths, seed)
    cfg = PPOLossConfig(
        eps_clip=0.2,
        eps_clip_high=eps_high,
        behav_correction=correction,
        behav_imp_weight_cap=1.5,
        kpop_threshold=0.05,
        importance_level=level,
        kl_coef=kl_coef,
        policy_loss=policy_loss,
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.7,
        m2_threshold=0.3,
    )
    weights = token_weights(b["mask"], b["cu"], "seq-mean-token-mean", 1, len(lengths), 1, dtype=torch.float64)
    keep = batch_trust_keep(b, cfg.m2_threshold)
    logp = b["logp"].clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(
        logp,
        b["prox"],
        b["behav"],
        b["adv"],
        b["mask"],
        b["cu"],
        weights,
        cfg,
        reference_logprobs=b["ref"],
        trust_keep=torch.tensor(keep),
    )
    want = reference_loss(b, weights.tolist(), cfg, keep)
    assert loss.item() == pytest.approx(want.pop("loss"), rel=1e-9, abs=1e-12)
    assert stats["behav_weight_sum"] == pytest.approx(want.pop("behav_weight_sum"), rel=1e-9)
    assert {key: stats[key] for key in want} == want
    # the gradient against central differences of the float loop
    loss.backward()
    h = 1e-6
    for t in range(len(logp)):
        shifted = [dict(b, logp=b["logp"] + sign * h * (torch.arange(len(logp)) == t)) for sign in (1, -1)]
        up, down = (reference_loss(sb, weights.tolist(), cfg, keep)["loss"] for sb in shifted)
        assert logp.grad[t].item() == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-8)


def textbook_ppo_loss(b, weights, eps_clip: float) -> float:
    """PPO's clipped surrogate against the sampler, token by token: -Σ weight·min(u·A, clip(u)·A), u = π_θ/π_behav."""
    total = 0.0
    for t in range(len(b["mask"])):
        if b["mask"][t]:
            u = math.exp(b["logp"][t].item() - b["behav"][t].item())
            adv = b["adv"][t].item()
            total -= weights[t] * min(u * adv, min(max(u, 1 - eps_clip), 1 + eps_clip) * adv)
    return total


@FAST
@given(lengths_st, st.integers(0, 2**31), st.sampled_from(BEHAV_CORRECTIONS), st.sampled_from(AGGREGATIONS))
def test_ppo_own_loss_clips_against_the_sampler(lengths, seed, correction, aggregation):
    """``decoupled=False``: the proximal logprobs are ignored and no behaviour weight applies, whatever the
    correction: PPO's textbook loss, in value and gradient."""
    b = random_batch(lengths, seed)
    cfg = PPOLossConfig(eps_clip=0.2, behav_correction=correction, behav_imp_weight_cap=1.5, decoupled=False)
    weights = token_weights(b["mask"], b["cu"], aggregation, int(b["mask"].sum()), len(lengths), 8, dtype=torch.float64)
    logp = b["logp"].clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(logp, b["prox"], b["behav"], b["adv"], b["mask"], b["cu"], weights, cfg)
    assert loss.item() == pytest.approx(textbook_ppo_loss(b, weights.tolist(), 0.2), rel=1e-9, abs=1e-12)
    assert stats["kept_tokens"] == stats["loss_tokens"] and stats["behav_weight_dev_sum"] == 0
    loss.backward()
    h = 1e-6
    for t in range(len(logp)):
        up, down = (
            textbook_ppo_loss(
                dict(b, logp=b["logp"] + sign * h * (torch.arange(len(logp)) == t)), weights.tolist(), 0.2
            )
            for sign in (1, -1)
        )
        assert logp.grad[t].item() == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-8)


def test_m2po_needs_the_decoupled_loss():
    with pytest.raises(ValueError, match="decoupled"):
        PPOLossConfig(policy_loss="m2po", decoupled=False)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.floats(-4, 4, allow_nan=False), max_size=40), st.floats(1e-3, 2.0))
def test_second_moment_trust_region_is_the_papers_greedy_masking(log_ratios, threshold):
    # where the mean left after a masking equals the bound in exact arithmetic (squares [0, 0, 0, 1, 0.0025,
    # 0.0025] against 0.001), rounding decides whether to mask once more, and two orders of summation differ
    descending = sorted((r * r for r in log_ratios), reverse=True)
    assume(
        all(
            abs(sum(descending[k:]) / (len(descending) - k) - threshold) > 1e-9 * threshold
            for k in range(len(descending))
        )
    )
    cut = second_moment_cut(torch.tensor(log_ratios, dtype=torch.float64), threshold)
    kept = [r * r < cut for r in log_ratios]
    assert sum(r * r for r, k in zip(log_ratios, kept) if k) <= threshold * sum(kept) + 1e-12
    greedy = reference_trust_keep(log_ratios, threshold)
    squares = [r * r for r in log_ratios]
    if len(set(squares)) == len(squares):
        assert kept == greedy
    else:  # ties with the last masked square are masked together: a superset of the greedy's masking
        assert all(g or not k for k, g in zip(kept, greedy))
        last_masked = min([x for x, g in zip(squares, greedy) if not g], default=math.inf)
        assert all(k or not g or s == last_masked for k, g, s in zip(kept, greedy, squares))


def test_m2po_without_its_trust_region_is_one_clear_error():
    b = random_batch([4], 0)
    ones = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="trust_keep"):
        decoupled_ppo_loss(
            b["logp"], b["prox"], b["behav"], b["adv"], b["mask"], b["cu"], ones, PPOLossConfig(policy_loss="m2po")
        )


def test_sapo_gate_has_the_plain_gradient_on_policy_and_decays_off_policy():
    prox = torch.full((3,), -1.0, dtype=torch.float64)
    mask, cu, ones = torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), torch.ones(3, dtype=torch.float64)
    cfg = PPOLossConfig(policy_loss="sapo", behav_correction="none")
    grads = []
    for shift in (0.0, 1.0, 3.0):  # u = 1, e, e³
        logp = (prox + shift).requires_grad_()
        loss, _ = decoupled_ppo_loss(logp, prox, prox, ones, mask, cu, ones, cfg)
        loss.backward()
        grads.append(logp.grad[0].item() / math.exp(shift))  # d/du of the objective: 1 for the plain ratio
    assert grads[0] == pytest.approx(-1.0)  # like −u·A at u = 1: SAPO's 4/τ normalisation
    assert 0 < -grads[2] < -grads[1] < 1.0  # a smooth decay off policy, never cut to 0 as the clip does


def test_corrections_drop_and_cap_the_tokens_the_paper_says():
    # token 0: w = e^2 (beyond cap 5); token 1: w = e^0.5; p = 0.95 vs q = 0.05 is a large binary KL
    prox = torch.tensor([-1.0, -1.0, math.log(0.95), -1.0], dtype=torch.float64)
    behav = torch.tensor([-3.0, -1.5, math.log(0.05), -1.0], dtype=torch.float64)
    mask, cu = torch.tensor([True, True, True, False]), torch.tensor([0, 4])
    ones = torch.ones(4, dtype=torch.float64)

    def run(correction):
        return decoupled_ppo_loss(prox, prox, behav, ones, mask, cu, ones, PPOLossConfig(behav_correction=correction))

    assert run("cap")[0].item() == pytest.approx(-(5 + math.exp(0.5) + 5))  # w = e², 19 capped at 5
    assert run("mask")[0].item() == pytest.approx(-math.exp(0.5))  # tokens 0 and 2 (w = 19) dropped
    assert run("kpop")[0].item() == pytest.approx(-(math.exp(2) + math.exp(0.5)))  # only token 2 dropped
    assert run("none")[0].item() == pytest.approx(-3)
    p0, q0 = math.exp(-1), math.exp(-3)
    assert binary_kl(0.95, 0.05) > 2.0 > max(binary_kl(p0, q0), binary_kl(q0, p0))
    stats = run("mask")[1]
    assert (stats["loss_tokens"], stats["kept_tokens"], stats["capped_tokens"]) == (3, 1, 2)
    assert stats["behav_weight_max"] == pytest.approx(19)


def test_clip_higher_only_widens_the_upper_side():
    prox = torch.full((4,), -1.0, dtype=torch.float64)
    logp = prox + torch.tensor([0.25, 0.25, -0.5, -0.5], dtype=torch.float64)  # u = 1.28.., 1.28.., 0.61, 0.61
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask, cu, ones = torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]), torch.ones(4, dtype=torch.float64)
    u_hi, u_lo = math.exp(0.25), math.exp(-0.5)
    for eps_high, upper in ((None, 1.2), (0.3, u_hi)):
        cfg = PPOLossConfig(eps_clip=0.2, eps_clip_high=eps_high, behav_correction="none")
        loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, cu, ones, cfg)
        # A > 0 clips at the top, A < 0 at the bottom (pessimistic min)
        assert loss.item() == pytest.approx(-(upper - u_hi + u_lo - 0.8))
        assert stats["clipped_tokens"] == (2 if eps_high is None else 1)


@FAST
@given(lengths_st, st.integers(0, 2**31))
def test_value_loss_matches_reference(lengths, seed):
    b = random_batch(lengths, seed)
    old, returns, c = b["values"] + 0.3 * b["adv"], b["rewards"], 0.2
    weights = token_weights(b["mask"], b["cu"], "token-mean", max(int(b["mask"].sum()), 1), 1, 1, dtype=torch.float64)
    want = 0.0
    for t in range(len(b["mask"])):
        if b["mask"][t]:
            v, o, r = b["values"][t].item(), old[t].item(), returns[t].item()
            clipped = min(max(v, o - c), o + c)
            want += weights[t].item() * 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
    got = value_loss(b["values"], old, returns, b["mask"], weights, value_clip=c)
    assert got.item() == pytest.approx(want, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------ sanity properties


def test_plain_ppo_when_behaviour_equals_proximal():
    b = random_batch([6, 9, 4], 1)
    mask, cu = b["mask"], b["cu"]
    weights = token_weights(mask, cu, "token-mean", int(mask.sum()), 3, 1, dtype=torch.float64)
    cfg = PPOLossConfig(behav_correction="none")
    u = (b["logp"] - b["prox"]).exp()
    plain = -(weights * torch.minimum(u * b["adv"], u.clamp(0.8, 1.2) * b["adv"])).sum()
    loss, _ = decoupled_ppo_loss(b["logp"], b["prox"], b["behav"], b["adv"], mask, cu, weights, cfg)
    torch.testing.assert_close(loss, plain)
    # on-policy (logp == prox): the loss is −Σ weight·A and its gradient −weight·A
    logp = b["prox"].clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(logp, b["prox"], b["behav"], b["adv"], mask, cu, weights, cfg)
    loss.backward()
    torch.testing.assert_close(loss.detach(), -(weights * b["adv"]).sum())
    torch.testing.assert_close(logp.grad, -weights * b["adv"])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_zero_advantage_tokens_get_zero_gradient(level):
    b = random_batch([7, 5, 8, 3], 2)
    adv = (
        expand_to_tokens(torch.tensor([0.0, 1.5, 0.0, -0.7], dtype=torch.float64), b["cu"])
        if level == "sequence"
        else torch.where(torch.arange(23) % 3 == 0, 0.0, b["adv"])
    )
    logp = b["logp"].clone().requires_grad_()
    weights = token_weights(b["mask"], b["cu"], "token-mean", int(b["mask"].sum()), 4, 1, dtype=torch.float64)
    loss, _ = decoupled_ppo_loss(
        logp, b["prox"], b["behav"], adv, b["mask"], b["cu"], weights, PPOLossConfig(importance_level=level)
    )
    loss.backward()
    assert (logp.grad[adv == 0] == 0).all() and (logp.grad[b["mask"] & (adv != 0)] != 0).any()


@pytest.mark.parametrize("correction", BEHAV_CORRECTIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_and_dropped_tokens_never_change_the_loss(correction, level):
    b = random_batch([7, 5, 8, 3], 3)
    mask, cu = b["mask"], b["cu"]
    cfg = PPOLossConfig(
        behav_correction=correction, behav_imp_weight_cap=1.5, kpop_threshold=0.05, importance_level=level, kl_coef=0.1
    )
    weights = token_weights(mask, cu, "seq-mean-token-mean", int(mask.sum()), 4, 1, dtype=torch.float64)
    junk = torch.tensor([float("nan"), float("inf"), -1e4, 1e4], dtype=torch.float64).repeat(len(mask))[: len(mask)]
    garbage = torch.where(mask, 0.0, junk)  # whatever lies off the mask, even NaN, must not leak in

    def loss_and_grad(delta):
        logp = (b["logp"] + delta).requires_grad_()
        loss, _ = decoupled_ppo_loss(
            logp,
            b["prox"] + delta,
            b["behav"] + delta,
            b["adv"] + delta,
            mask,
            cu,
            weights,
            cfg,
            reference_logprobs=b["ref"] + delta,
        )
        loss.backward()
        return loss.detach(), logp.grad

    loss, grad = loss_and_grad(torch.zeros_like(garbage))
    garbage_loss, garbage_grad = loss_and_grad(garbage)
    torch.testing.assert_close(garbage_loss, loss)
    torch.testing.assert_close(garbage_grad, grad)
    assert (grad[~mask] == 0).all()
    if level == "token" and correction in ("mask", "kpop"):  # a dropped token's own logprob does not matter
        _, stats = decoupled_ppo_loss(b["logp"], b["prox"], b["behav"], b["adv"], mask, cu, weights, cfg)
        assert 0 < stats["kept_tokens"] < stats["loss_tokens"]
        dropped = mask & (grad == 0)
        assert dropped.sum() == stats["loss_tokens"] - stats["kept_tokens"]


# ------------------------------------------------------------------------------ micro-batch invariance


def select(b: dict, seq_ids: list[int]) -> tuple[dict, torch.Tensor]:
    """The sub-batch of the given sequences, packed, and the flat positions it came from."""
    spans = [torch.arange(int(b["cu"][i]), int(b["cu"][i + 1])) for i in seq_ids]
    index = torch.cat(spans)
    sub = {k: v[index] for k, v in b.items() if k != "cu"}
    sub["cu"] = torch.tensor([0] + [len(s) for s in spans]).cumsum(0)
    return sub, index


@FAST
@given(
    st.lists(st.integers(1, 9), min_size=2, max_size=8),
    st.integers(0, 2**31),
    st.sampled_from(AGGREGATIONS),
    st.sampled_from(["token", "sequence"]),
    st.integers(1, 4),
)
def test_microbatch_sum_equals_whole_batch_loss_and_gradient(lengths, seed, aggregation, level, n_micro):
    b = random_batch(lengths, seed)
    cfg = PPOLossConfig(importance_level=level, behav_imp_weight_cap=1.5, kl_coef=0.05)
    totals = dict(n_tokens=int(b["mask"].sum()), n_seqs=len(lengths), max_len=max(lengths))

    def loss_of(sub, logp):
        weights = token_weights(sub["mask"], sub["cu"], aggregation, dtype=torch.float64, **totals)
        return decoupled_ppo_loss(
            logp,
            sub["prox"],
            sub["behav"],
            sub["adv"],
            sub["mask"],
            sub["cu"],
            weights,
            cfg,
            reference_logprobs=sub["ref"],
        )[0]

    whole_logp = b["logp"].clone().requires_grad_()
    whole = loss_of(b, whole_logp)
    whole.backward()
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    parts = [order[i::n_micro] for i in range(n_micro) if order[i::n_micro]]
    leaf = b["logp"].clone().requires_grad_()
    total = 0.0
    for part in parts:
        sub, index = select(b, part)
        total = total + loss_of(sub, leaf[index])
    total.backward()
    torch.testing.assert_close(total.detach(), whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, whole_logp.grad, rtol=1e-12, atol=1e-12)


@pytest.fixture
def one_thread():
    """The tiny model's forwards are too small to gain from threads, which spin for seconds on busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed_and_unpacked_model_gradients_equal(tiny_model_dir, one_thread, level):
    model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 600, (n,), generator=g).tolist() for n in (9, 17, 5, 12)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in sequences]
    packed = pack(sequences, masks)
    mask, cu = packed.target_mask, packed.cu_seqlens
    with torch.no_grad():
        prox = packed_policy_outputs(model, packed)["logprobs"]
    behav = torch.where(mask, prox - 0.3 * torch.rand(len(mask), generator=g), 0.0)
    adv = expand_to_tokens(torch.randn(4, generator=g), cu)
    cfg = PPOLossConfig(importance_level=level, kl_coef=0.1)
    totals = dict(n_tokens=packed.n_targets, n_seqs=4, max_len=20)

    def loss_and_grads(parts):
        model.zero_grad()
        logps, total = [], 0.0
        for start, end, batch in parts:
            logp = packed_policy_outputs(model, batch)["logprobs"]
            span = slice(start, end)
            weights = token_weights(batch.target_mask, batch.cu_seqlens, "seq-mean-token-mean", **totals)
            loss, _ = decoupled_ppo_loss(
                logp,
                prox[span],
                behav[span],
                adv[span],
                batch.target_mask,
                batch.cu_seqlens,
                weights,
                cfg,
                reference_logprobs=prox[span] - 0.1,
            )
            total, logps = total + loss, logps + [logp.detach()]
        total.backward()
        return torch.cat(logps), total.detach(), [p.grad.clone() for p in model.parameters()]

    packed_lp, packed_loss, packed_grads = loss_and_grads([(0, len(mask), packed)])
    singles = [(int(cu[i]), int(cu[i + 1]), pack([s], [m])) for i, (s, m) in enumerate(zip(sequences, masks))]
    single_lp, single_loss, single_grads = loss_and_grads(singles)
    torch.testing.assert_close(packed_lp, single_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_loss, single_loss, atol=1e-6, rtol=1e-5)
    assert any(grad.abs().max() > 0 for grad in packed_grads)
    for a, b in zip(packed_grads, single_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- DAPO filters


def test_dynamic_sampling_drops_all_equal_groups():
    assert not is_informative_group([1.0, 1.0, 1.0])
    assert not is_informative_group([0.0])
    assert not is_informative_group([])
    assert is_informative_group([0.0, 1.0, 0.0])


@given(st.integers(0, 300), st.integers(1, 200), st.floats(0.1, 2.0))
def test_overlong_penalty_is_dapos_soft_punishment(length, cache, factor):
    max_new = 200
    cache = min(cache, max_new)
    got = overlong_penalty(length, max_new, cache, factor)
    if length <= max_new - cache:
        assert got == 0.0
    elif length > max_new:
        assert got == -factor
    else:
        assert got == pytest.approx(factor * ((max_new - cache) - length) / cache)
    assert overlong_penalty(200, 200, 0) == 0.0 and overlong_penalty(201, 200, 0) == -1.0
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(10, 100, 101)
