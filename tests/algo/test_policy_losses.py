"""``actor.policy_loss`` as an extension point: a user's own ``PolicyLoss`` from a file drives the decoupled
PPO loss (against a float64 loop), a spec that names none is one line naming the key, and the built-ins
load without torch (the config's validation reads ``trust_region`` on a login node).

The built-in losses against their float64 references: ``test_algorithms.py``.
"""

import math
import subprocess
import sys

import pytest
import torch

from areal_hpc.algo.ppo import PPOLossConfig, decoupled_ppo_loss
from areal_hpc.errors import UserError

USER_LOSS = '''
from areal_hpc.algo.policy_losses import PolicyLoss


def log_ratio(ratio, advantages, cfg):
    """log u · A, and (to see it counted) the tokens of negative advantage as clipped."""
    return ratio.log() * advantages, advantages < 0


LOG_RATIO = PolicyLoss(log_ratio)
STALE_LOG_RATIO = PolicyLoss(log_ratio, trust_region=True)
'''


@pytest.fixture
def user_loss(tmp_path) -> str:
    (tmp_path / "my_loss.py").write_text(USER_LOSS)
    return f"{tmp_path}/my_loss.py"


def test_users_own_policy_loss_from_a_file_is_the_objective(user_loss):
    g = torch.Generator().manual_seed(0)
    cu, n = torch.tensor([0, 5, 9]), 9
    mask = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 0]).bool()
    behav = -3 * torch.rand(n, generator=g, dtype=torch.float64) - 0.01
    prox = (behav + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    logp = (prox + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    ref = (prox + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    adv, weights = torch.randn(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    cfg = PPOLossConfig(
        policy_loss=f"{user_loss}:LOG_RATIO", behav_correction="cap", behav_imp_weight_cap=1.5, kl_coef=0.1
    )
    logp = logp.requires_grad_()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, cu, weights, cfg, reference_logprobs=ref)

    want, want_grad = 0.0, [0.0] * n
    for t in range(n):
        if mask[t]:
            lp, px, bh, a, rf, wt = (x[t].item() for x in (logp, prox, behav, adv, ref, weights))
            w = min(math.exp(px - bh), 1.5)
            k3 = math.exp(rf - lp) - (rf - lp) - 1
            want += wt * (-w * (lp - px) * a + 0.1 * k3)
            want_grad[t] = wt * (-w * a + 0.1 * (1 - math.exp(rf - lp)))
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["clipped_tokens"] == int((mask & (adv < 0)).sum())
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_users_own_trust_region_loss_needs_the_decoupled_loss_and_trust_keep(user_loss):
    with pytest.raises(ValueError, match="STALE_LOG_RATIO.* needs the decoupled loss"):
        PPOLossConfig(policy_loss=f"{user_loss}:STALE_LOG_RATIO", decoupled=False)
    ones, cu = torch.ones(3, dtype=torch.float64), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="STALE_LOG_RATIO.* needs trust_keep"):
        decoupled_ppo_loss(
            -ones, -ones, -ones, ones, ones.bool(), cu, ones, PPOLossConfig(policy_loss=f"{user_loss}:STALE_LOG_RATIO")
        )


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("grpo", "is not a built-in"),
        ("{dir}/missing.py:LOSS", "no file"),
        ("{dir}/my_loss.py:NOPE", "has no 'NOPE'"),
        ("areal_hpc.algo.policy_losses", "is not a built-in"),
    ],
)
def test_a_policy_loss_that_names_none_is_one_line_naming_the_key(user_loss, tmp_path, spec, says):
    with pytest.raises(UserError, match=f"config key 'actor.policy_loss': .*{says}") as err:
        PPOLossConfig(policy_loss=spec.format(dir=tmp_path))
    assert "\n" not in str(err.value)


def test_the_built_in_policy_losses_load_without_torch():
    code = (
        "import sys\nfrom areal_hpc import builtins\n"
        "names = builtins.POINTS['policy_loss'].builtins\n"
        "flags = [builtins.load('policy_loss', name).trust_region for name in names]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint(sum(flags))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"  # M2PO's alone
