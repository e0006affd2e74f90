"""`kl_level="sequence"` on completions of thousands of tokens, where prefix log-ratios drift past ±20 and ±200 nats
(issue: the sign guarantee failed past the ±20 clamp of the prefixes). Every expected weight comes from an independent
float64 computation here: the KL-to-go of each token summed directly over its later tokens (an O(T²) matrix product,
each term divided by M_t before it is exponentiated), not from the reverse log-cumsum-exp of `rpg_trl.losses`."""

import functools
import math

import numpy as np
import pytest
import torch

from rpg_trl.losses import LOG_WEIGHT_CLAMP, rpg_loss


C = 10.0  # the default clip_c
#: (completion length, drift of log w per token): the prefixes drift past ±20 nats at 2048 tokens, past ±200 at 8192.
LENGTHS = {2048: 0.02, 8192: 0.035}
BLOCK = 1024


@functools.lru_cache(maxsize=None)
def drifting_completions(length: int, with_ref: bool):
    """Two completions of `length` tokens: log w drifts up by `drift` a token in the first and down in the second, with
    noise of 0.1 nats a token; with a separate reference, log r drifts down by half as much (π_ref falls behind π_old,
    so log R≤t is about minus the KL, tens to hundreds of nats). Float64 values that float32 represents exactly, so
    the float32 and float64 runs see the same inputs."""
    drift = LENGTHS[length]
    g = np.random.default_rng(length + with_ref)
    old = -g.uniform(0.5, 3.0, size=(2, length))
    log_w = np.array([[drift], [-drift]]) + g.normal(0.0, 0.1, size=(2, length))
    lp = old + log_w
    ref = old + (-drift / 2 + g.normal(0.0, 0.1, size=(2, length))) if with_ref else None
    as_float32 = lambda x: None if x is None else x.astype(np.float32).astype(np.float64)  # noqa: E731
    return as_float32(lp), as_float32(old), as_float32(ref)


def log_prefixes(length: int, with_ref: bool):
    """log W≤t, log R≤t and log ρ_t of `drifting_completions`, float64."""
    lp, old, ref = drifting_completions(length, with_ref)
    log_w = lp - old
    log_r = np.zeros_like(log_w) if ref is None else ref - old
    return np.cumsum(log_w, -1), np.cumsum(log_r, -1), log_w - log_r


@functools.lru_cache(maxsize=None)
def kl_to_go(length: int, with_ref: bool):
    """(log M_t, Σ_{t'≥t} (W≤t'/M_t)·log ρ_t', Σ_{t'≥t} (W≤t'/M_t)·|log ρ_t'|) with M_t = max_{t'≥t} W≤t': each later
    token's term divided by M_t before it is exponentiated, summed directly (blocks of an upper-triangular matrix)."""
    log_W, _, log_rho = log_prefixes(length, with_ref)
    log_M = np.maximum.accumulate(log_W[:, ::-1], -1)[:, ::-1]
    to_go, to_go_abs = np.zeros_like(log_W), np.zeros_like(log_W)
    later = np.arange(length)[None, :]
    for b in range(log_W.shape[0]):
        for t0 in range(0, length, BLOCK):
            rows = np.arange(t0, min(t0 + BLOCK, length))
            terms = np.exp(log_W[b][None, t0:] - log_M[b, rows][:, None]) * (later[:, t0:] >= rows[:, None])
            to_go[b, rows] = terms @ log_rho[b, t0:]
            to_go_abs[b, rows] = terms @ np.abs(log_rho[b, t0:])
    return log_M, to_go, to_go_abs


@functools.lru_cache(maxsize=None)
def reference(length: int, with_ref: bool, divergence: str, mode: str):
    """(K, scale): the exact (``mode="exact"``, magnitude capped at e^LOG_WEIGHT_CLAMP) or truncated sequence-level KL
    weight per token, and the sum of the magnitudes of its terms (the yardstick of rounding), float64."""
    log_W, log_R, _ = log_prefixes(length, with_ref)
    # K_t / M_t and the sum of its terms' magnitudes / M_t, M_t the prefix ratio that the truncation divides by.
    if divergence in ("rkl", "urkl"):
        log_M, to_go, to_go_abs = kl_to_go(length, with_ref)
        score = np.exp(log_W - log_M) if divergence == "rkl" else 0.0
        normalised, magnitude = to_go + score, to_go_abs + score
    elif divergence == "ufkl":
        log_M = log_W
        normalised, magnitude = 1.0 - np.exp(log_R - log_W), 1.0 + np.exp(log_R - log_W)
    else:  # fkl: K = −R≤t, no truncation
        log_M = np.zeros_like(log_W)
        normalised, magnitude = -np.exp(log_R), np.exp(log_R)
    log_factor = log_M if mode == "exact" or divergence == "fkl" else np.minimum(log_M, math.log(C))
    with np.errstate(divide="ignore"):
        log_K = np.minimum(log_factor + np.log(np.abs(normalised)), LOG_WEIGHT_CLAMP)
    scale = np.exp(np.minimum(log_factor + np.log(magnitude), LOG_WEIGHT_CLAMP))
    return np.sign(normalised) * np.exp(log_K), scale


@functools.lru_cache(maxsize=None)
def k3_reference(length: int, with_ref: bool, divergence: str, mode: str):
    """(K, scale) of ``kl_to_go="k3"``: ``W≤t·log ρ_t + Σ_{t'>t} W≤t'·(e^{−log ρ_t'} − 1 + log ρ_t')`` (+ ``W≤t`` for
    rkl), each term divided by M_t before it is exponentiated and summed directly, float64; exact or truncated."""
    log_W, _, log_rho = log_prefixes(length, with_ref)
    log_M = np.maximum.accumulate(log_W[:, ::-1], -1)[:, ::-1]
    k3 = np.expm1(-log_rho) + log_rho  # float64: relative rounding ~1e-16/|log ρ|, below the test's tolerance
    later_sum = np.zeros_like(log_W)
    later = np.arange(length)[None, :]
    for b in range(log_W.shape[0]):
        for t0 in range(0, length, BLOCK):
            rows = np.arange(t0, min(t0 + BLOCK, length))
            terms = np.exp(log_W[b][None, t0:] - log_M[b, rows][:, None]) * (later[:, t0:] > rows[:, None])
            later_sum[b, rows] = terms @ k3[b, t0:]
    own = np.exp(log_W - log_M) * log_rho
    score = np.exp(log_W - log_M) if divergence == "rkl" else 0.0
    normalised, magnitude = own + later_sum + score, np.abs(own) + later_sum + score
    log_factor = log_M if mode == "exact" else np.minimum(log_M, math.log(C))
    with np.errstate(divide="ignore"):
        log_K = np.minimum(log_factor + np.log(np.abs(normalised)), LOG_WEIGHT_CLAMP)
    scale = np.exp(np.minimum(log_factor + np.log(magnitude), LOG_WEIGHT_CLAMP))
    return np.sign(normalised) * np.exp(log_K), scale


def kl_weight(lp, old, ref, divergence, mode, estimator, dtype, kl_to_go="log_ratio"):
    """The KL weight K̃_t the loss applies: with A = 0, summed over each completion and averaged over the 2 of them at
    β = 1, the gradient of the loss with respect to log π_θ is K̃_t / 2."""
    logps = torch.tensor(lp, dtype=dtype, requires_grad=True)
    loss, _ = rpg_loss(
        logps,
        torch.tensor(old, dtype=dtype),
        torch.zeros(lp.shape[0], dtype=dtype),
        torch.ones(lp.shape, dtype=dtype),
        divergence=divergence,
        estimator=estimator,
        beta=1.0,
        kl_level="sequence",
        kl_clip_mode=mode,
        kl_to_go=kl_to_go,
        aggregation="seq-mean-token-sum",
        ref_logps=None if ref is None else torch.tensor(ref, dtype=dtype),
    )
    (grad,) = torch.autograd.grad(loss, logps)
    return 2.0 * grad.double().numpy()


@pytest.mark.parametrize("divergence", ["fkl", "ufkl", "rkl", "urkl"])
@pytest.mark.parametrize("with_ref", [False, True], ids=["sampling-anchor", "separate-ref"])
@pytest.mark.parametrize("length", sorted(LENGTHS))
def test_sequence_weights_are_exact_at_thousands_of_tokens(length, with_ref, divergence):
    lp, old, ref = drifting_completions(length, with_ref)
    log_W = np.cumsum(lp - old, -1)
    bound = 20.0 if length == 2048 else 200.0
    assert log_W[0].max() > bound and log_W[1].min() < -bound  # the prefixes drift past the old clamp, both ways
    for mode in ("exact", "truncated"):
        K, scale = reference(length, with_ref, divergence, mode)
        for dtype, rtol in ((torch.float64, 1e-11), (torch.float32, 1e-4)):
            for estimator in ("reinforce", "differentiable"):
                got = kl_weight(lp, old, ref, divergence, mode, estimator, dtype)
                case = f"{mode}, {estimator}, {dtype}"
                assert np.isfinite(got).all(), case
                # Every token whose weight is neither lost in rounding nor below the dtype's range (e^−280 is 0 in
                # float32) has the exact weight's sign ...
                material = (np.abs(K) > 10 * rtol * scale) & (np.abs(K) > 1e3 * torch.finfo(dtype).tiny)
                assert material.mean() > 0.4, case
                wrong = material & (np.sign(got) != np.sign(K))
                assert not wrong.any(), f"{case}: {wrong.sum()} tokens with the wrong sign"
                # ... and the exact (or truncated) value, to the precision of the dtype.
                tiny = 1e3 * torch.finfo(dtype).tiny
                np.testing.assert_array_less(np.abs(got - K), rtol * scale + tiny, err_msg=case)


@pytest.mark.parametrize("divergence", ["rkl", "urkl"])
@pytest.mark.parametrize("with_ref", [False, True], ids=["sampling-anchor", "separate-ref"])
@pytest.mark.parametrize("length", sorted(LENGTHS))
def test_k3_kl_to_go_weights_are_exact_at_thousands_of_tokens(length, with_ref, divergence):
    lp, old, ref = drifting_completions(length, with_ref)
    for mode in ("exact", "truncated"):
        K, scale = k3_reference(length, with_ref, divergence, mode)
        for dtype, rtol in ((torch.float64, 1e-11), (torch.float32, 1e-4)):
            for estimator in ("reinforce", "differentiable"):
                got = kl_weight(lp, old, ref, divergence, mode, estimator, dtype, kl_to_go="k3")
                case = f"{mode}, {estimator}, {dtype}"
                assert np.isfinite(got).all(), case
                tiny = 1e3 * torch.finfo(dtype).tiny
                material = (np.abs(K) > 10 * rtol * scale) & (np.abs(K) > tiny)
                assert material.mean() > 0.4, case
                assert not (material & (np.sign(got) != np.sign(K))).any(), case
                np.testing.assert_array_less(np.abs(got - K), rtol * scale + tiny, err_msg=case)
        # Not the sampled KL-to-go: the later tokens' terms are their k3, not their log-ratios.
        sampled, _ = reference(length, with_ref, divergence, mode)
        assert (np.abs(K - sampled) > 1e-3 * np.abs(sampled)).mean() > 0.1


@pytest.mark.parametrize("estimator", ["reinforce", "differentiable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_issues_nine_token_example_keeps_its_sign(dtype, estimator):
    # The sampling anchor, urkl, log w = (3, 3, 3, 3, 3, 3, 3, −1, 0.9): the 8th token's prefix is e^20, the 9th's
    # e^20.9, so its KL-to-go is −e^20 + 0.9·e^20.9 = +5.89e8 (exact) and, with M = e^20.9, 10·(0.9 − e^−0.9) = +4.93
    # (truncated). With the prefixes clamped at ±20 the code gave −4.85e7 and −1.0.
    log_w = np.array([[3.0] * 7 + [-1.0, 0.9]])
    old = np.full_like(log_w, -5.0)
    exact_8 = -math.exp(20.0) + 0.9 * math.exp(20.9)
    truncated_8 = C * (0.9 - math.exp(-0.9))
    assert exact_8 == pytest.approx(5.89e8, rel=1e-3) and truncated_8 == pytest.approx(4.93, abs=0.01)
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    for mode, expected in (("exact", exact_8), ("truncated", truncated_8)):
        got = kl_weight(old + log_w, old, None, "urkl", mode, estimator, dtype) / 2.0  # one completion
        assert got[0, 7] == pytest.approx(expected, rel=rtol), mode


@pytest.mark.parametrize("kl_to_go", ["log_ratio", "k3"])
@pytest.mark.parametrize("divergence", ["rkl", "urkl"])
def test_the_truncated_kl_to_go_is_bounded_by_c_times_its_log_ratios(divergence, kl_to_go):
    # |s_t·K_t| ≤ c·Σ_{t'≥t} |log ρ_t'| (+ c for rkl's score term), however far the prefixes drift; with the k3 form
    # c·(|log ρ_t| + Σ_{t'>t} k3(ρ_t')).
    lp, old, ref = drifting_completions(8192, True)
    got = kl_weight(lp, old, ref, divergence, "truncated", "reinforce", torch.float64, kl_to_go=kl_to_go)
    x = (lp - old) - (ref - old)
    terms = np.abs(x) if kl_to_go == "log_ratio" else np.expm1(-x) + x
    later = np.cumsum(terms[:, ::-1], -1)[:, ::-1]
    to_go = later if kl_to_go == "log_ratio" else np.abs(x) + later - terms
    bound = C * to_go + (C if divergence == "rkl" else 0.0)
    assert (np.abs(got) <= bound * (1 + 1e-9)).all()
    assert np.abs(got).max() > 1.0  # the bound is not met by weights that vanish


def test_exact_weights_past_the_float_range_keep_their_sign_at_the_cap():
    # Prefixes at e^245: the exact weight is far beyond e^40; it is given e^40 with its sign (urkl, sampling anchor).
    lp, old, _ = drifting_completions(8192, False)
    got = kl_weight(lp, old, None, "urkl", "exact", "reinforce", torch.float32)
    K, _ = reference(8192, False, "urkl", "exact")
    at_cap = np.abs(K) >= math.exp(LOG_WEIGHT_CLAMP) * (1 - 1e-12)
    assert at_cap.sum() > 1000
    np.testing.assert_allclose(got[at_cap], K[at_cap], rtol=1e-5)
