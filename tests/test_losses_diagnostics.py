"""Tests of the diagnostics of the whole-completion importance weights and of the KL term's share of the gradient
(`rpg_trl.losses.DIAGNOSTIC_METRICS`, issue 63): each against a direct float64 computation, and their reduction over
micro-batches and processes."""

import math

import numpy as np
import pytest
import torch

from rpg_trl.losses import DIAGNOSTIC_METRICS, ESTIMATORS, KL_LEVELS, rpg_loss, rpg_per_token_loss
from rpg_trl.losses.surrogate import (
    combine_diagnostic_parts,
    diagnostic_metrics,
    diagnostic_metrics_of,
    diagnostic_parts,
)


def random_batch(B=7, T=9, scale=0.4, seed=0, empty_rows=(2,)):
    """float64 log-probs, π_old log-probs, advantages and a ragged mask, with rows of no active token."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + (2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1) * scale
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    for row in empty_rows:
        mask[row] = 0.0
    return logps, old, adv, mask


def log_sum_exp(values):
    """log Σ e^x in float64 numpy, shifted by the largest (independent of torch.logsumexp)."""
    values = np.asarray(values, dtype=np.float64)
    top = values.max()
    return top + math.log(np.exp(values - top).sum())


def direct_prefix_metrics(logps, old, mask):
    """max, min, std (ddof=0) of log W≤T and the ESS fraction of W over the completions with an active token, float64."""
    lp, o, m = logps.numpy(), old.numpy(), mask.numpy()
    log_W = np.array([math.fsum((lp[b] - o[b])[m[b] > 0]) for b in range(len(m)) if m[b].sum() > 0])
    n = len(log_W)
    ess = math.exp(2 * log_sum_exp(log_W) - log_sum_exp(2 * log_W) - math.log(n))
    return {
        "kl/log_prefix_weight/max": log_W.max(),
        "kl/log_prefix_weight/min": log_W.min(),
        "kl/log_prefix_weight/std": log_W.std(),
        "kl/prefix_ess": ess,
    }


@pytest.mark.parametrize("kl_level", KL_LEVELS)
def test_prefix_weight_metrics_equal_a_direct_float64_computation(kl_level):
    logps, old, adv, mask = random_batch()
    _, metrics = rpg_loss(logps, old, adv, mask, beta=0.1, kl_level=kl_level)
    expected = direct_prefix_metrics(logps, old, mask)
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert 1 / 6 <= float(metrics["kl/prefix_ess"]) <= 1  # 6 completions have an active token


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_prefix_weight_metrics_stay_finite_and_exact_at_log_ratios_of_60_over_1000_tokens(estimator):
    logps, old, adv, mask = random_batch(B=5, T=1200, scale=60.0, seed=3, empty_rows=(1,))
    _, metrics = rpg_loss(logps, old, adv, mask, beta=0.1, kl_level="sequence", estimator=estimator)
    expected = direct_prefix_metrics(logps, old, mask)
    assert abs(expected["kl/log_prefix_weight/max"]) > 100  # far beyond what exp() holds on its own
    for key, value in expected.items():
        assert math.isfinite(float(metrics[key])), key
        assert float(metrics[key]) == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # The float32 path: the same in log space, finite.
    _, metrics32 = rpg_loss(logps.float(), old.float(), adv.float(), mask.float(), beta=0.1, kl_level="sequence")
    for key in DIAGNOSTIC_METRICS:
        assert math.isfinite(float(metrics32[key])), key
    assert float(metrics32["kl/prefix_ess"]) == pytest.approx(expected["kl/prefix_ess"], rel=1e-3, abs=1e-6)


def direct_weight_share(logps, old, adv, mask, beta, clip, kl_importance_weight=True, eps=(0.2, 0.28), c=10.0):
    """Σ|β·K| / (Σ|w·A| + Σ|β·K|) at the token level for urkl (K = w·log w with π_ref = π_old), or GRPO's k3
    (K = 1 − 1/w), with RPG-Style Clip's reward regions, float64 numpy."""
    m = mask.numpy() > 0
    log_w = np.clip((logps - old).numpy(), -20, 20)
    w = np.exp(log_w)
    a = np.broadcast_to(adv.numpy()[:, None], w.shape)
    reward = w * a
    if clip:
        clipped = ((w < 1 - eps[0]) & (a < 0)) | ((w > 1 + eps[1]) & (a > 0)) | ((w > c) & (a < 0))
        reward = np.where(clipped, 0.0, reward)
    kl = beta * (w * log_w if kl_importance_weight else 1.0 - 1.0 / w)
    kl_sum, reward_sum = np.abs(kl[m]).sum(), np.abs(reward[m]).sum()
    return kl_sum / (kl_sum + reward_sum)


@pytest.mark.parametrize("kl_importance_weight", [True, False], ids=["urkl", "grpo-k3"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_weight_share_equals_a_direct_float64_computation(estimator, clip, kl_importance_weight):
    logps, old, adv, mask = random_batch(scale=0.6)
    spec = dict(beta=0.3, clip=clip, estimator=estimator, kl_importance_weight=kl_importance_weight)
    if clip:
        spec["kl_clip_mode"] = "exact"
    _, metrics = rpg_loss(logps, old, adv, mask, **spec)
    expected = direct_weight_share(logps, old, adv, mask, 0.3, clip, kl_importance_weight)
    assert 0.05 < expected < 0.95
    assert float(metrics["kl/weight_share"]) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("kl_level", KL_LEVELS)
@pytest.mark.parametrize("clip", [False, True])
def test_weight_share_is_the_same_for_both_estimators_and_the_share_of_the_gradients(kl_level, clip):
    """The share from the stats equals Σ|g_KL| / (Σ|g_reward| + Σ|g_KL|) of the per-token gradients of the loss with the
    KL term alone (advantages 0) and the reward term alone (β = 0), for both estimators."""
    logps, old, adv, mask = random_batch(scale=0.5, seed=1)
    spec = dict(beta=0.2, clip=clip, kl_level=kl_level, kl_clip_mode="truncated")

    def grad(estimator, advantages, beta):
        x = logps.clone().requires_grad_(True)
        loss, _ = rpg_per_token_loss(x, old, advantages, mask, **{**spec, "beta": beta, "estimator": estimator})
        (loss * mask).sum().backward()
        return x.grad

    shares = []
    for estimator in ESTIMATORS:
        _, metrics = rpg_loss(logps, old, adv, mask, **spec, estimator=estimator)
        shares.append(float(metrics["kl/weight_share"]))
        kl = grad(estimator, torch.zeros_like(adv), 0.2).abs().sum()
        reward = grad(estimator, adv, 0.0).abs().sum()
        assert shares[-1] == pytest.approx(float(kl / (kl + reward)), rel=1e-9)
    assert shares[0] == pytest.approx(shares[1], rel=1e-12)


@pytest.mark.parametrize("kl_level", KL_LEVELS)
def test_beta_zero_has_no_kl_share_and_on_policy_every_weight_is_one(kl_level):
    logps, old, adv, mask = random_batch()
    _, off = rpg_loss(logps, old, adv, mask, beta=0.0, kl_level=kl_level)
    assert float(off["kl/weight_share"]) == 0.0
    _, on = rpg_loss(logps, logps, adv, mask, beta=0.0, kl_level=kl_level)
    assert float(on["kl/prefix_ess"]) == pytest.approx(1.0, abs=1e-12)
    assert float(on["kl/log_prefix_weight/max"]) == float(on["kl/log_prefix_weight/min"]) == 0.0
    assert float(on["kl/log_prefix_weight/std"]) == 0.0 and float(on["kl/weight_share"]) == 0.0


def test_no_active_token_gives_nan_and_a_zero_weight_gives_a_zero_share():
    logps, old, adv, mask = random_batch()
    _, metrics = rpg_loss(logps, old, adv, torch.zeros_like(mask), beta=0.1)
    assert all(math.isnan(float(metrics[key])) for key in DIAGNOSTIC_METRICS)
    _, metrics = rpg_loss(logps, old, torch.zeros_like(adv), mask, beta=0.0)
    assert float(metrics["kl/weight_share"]) == 0.0


@pytest.mark.parametrize("kl_level", KL_LEVELS)
def test_micro_batches_and_processes_combine_to_the_whole_batch(kl_level):
    """The parts of two micro-batches on each of two processes (one of them with no active token), combined as the
    trainer combines them (over the micro-batches, then over the gathered processes), give the whole batch's values."""
    logps, old, adv, mask = random_batch(B=12, scale=1.5, seed=2, empty_rows=(0, 1, 2, 7))
    spec = dict(beta=0.2, kl_level=kl_level)

    def parts(rows):
        _, stats = rpg_per_token_loss(logps[rows], old[rows], adv[rows], mask[rows], **spec)
        return diagnostic_parts(stats, mask[rows])

    chunks = [slice(0, 3), slice(3, 5), slice(5, 9), slice(9, 12)]  # slice(0, 3): no active token
    per_process = [combine_diagnostic_parts(torch.stack([parts(a), parts(b)])) for a, b in (chunks[:2], chunks[2:])]
    combined = diagnostic_metrics(combine_diagnostic_parts(torch.stack(per_process)))
    _, whole = rpg_loss(logps, old, adv, mask, **spec)
    for key in DIAGNOSTIC_METRICS:
        assert float(combined[key]) == pytest.approx(float(whole[key]), rel=1e-10), key
    # Not a mean of the parts' values.
    _, first = rpg_loss(logps[:6], old[:6], adv[:6], mask[:6], **spec)
    _, second = rpg_loss(logps[6:], old[6:], adv[6:], mask[6:], **spec)
    mean_of_stds = (float(first["kl/log_prefix_weight/std"]) + float(second["kl/log_prefix_weight/std"])) / 2
    assert mean_of_stds != pytest.approx(float(whole["kl/log_prefix_weight/std"]), rel=1e-6)


@pytest.mark.parametrize("kl_level", KL_LEVELS)
def test_the_host_diagnostics_equal_a_direct_float64_computation(kl_level):
    """`diagnostic_metrics_of` (what RPGTrainer computes on the host from the gathered completions' log W and the
    reduced sums) against the direct float64 values; NaN without a completion, the share alone without a token."""
    logps, old, adv, mask = random_batch(B=9, scale=1.2, seed=5, empty_rows=(3,))
    _, stats = rpg_per_token_loss(logps, old, adv, mask, beta=0.3, kl_level=kl_level)
    active = mask.sum(-1) > 0
    log_W = [math.fsum((logps[b] - old[b])[mask[b] > 0].tolist()) for b in range(len(mask)) if active[b]]
    kl_abs = math.fsum((stats["kl_gradient_weight"].abs() * mask).flatten().tolist())
    reward_abs = math.fsum((stats["reward_gradient_weight"].abs() * mask).flatten().tolist())
    host = diagnostic_metrics_of(log_W, reward_abs, kl_abs, float(mask.sum()))
    for key, value in direct_prefix_metrics(logps, old, mask).items():
        assert host[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key
    assert host["kl/weight_share"] == pytest.approx(kl_abs / (kl_abs + reward_abs), rel=1e-12)
    empty = diagnostic_metrics_of([], 0.0, 0.0, 0.0)
    assert all(math.isnan(empty[key]) for key in DIAGNOSTIC_METRICS)
    tokens_only = diagnostic_metrics_of([], 0.0, 0.0, 4.0)  # tokens but no gradient weight: a zero share
    assert tokens_only["kl/weight_share"] == 0.0 and math.isnan(tokens_only["kl/prefix_ess"])
