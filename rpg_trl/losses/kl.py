# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The KL term of the RPG loss: the table of divergences (their importance-weighted estimates ``S`` and gradient
weights ``K``, Tables 1, 2 and 4, Propositions 3.2, 3.6, E.1, E.3 and F.1-F.5), at both KL levels (per token, and over
whole completions in log space), and every reading of RPG-Style Clip's effect on the KL term outside the trust region
([`KL_CLIP_MODES`], ``kl_clip_mode``; docs: *Design of the RPG loss in rpg_trl*, "The KL term outside the trust
region"). Pure tensor functions: ``(ratios, spec, regions) -> weights``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .ratios import (
    LOG_RATIO_CLAMP,
    LOG_WEIGHT_CLAMP,
    ClipRegions,
    Prefixes,
    RatioTensors,
    clamp_log_ratio,
)


class LossSpecFields(Protocol):
    """The fields of a loss specification ([`~rpg_trl.losses.spec.RPGLossSpec`]) that the KL and surrogate functions
    read. They annotate their `spec` with this protocol instead of importing `spec`, which imports them to check its
    fields: the package's modules import one another in one direction only, annotations included."""

    @property
    def divergence(self) -> str: ...
    @property
    def beta(self) -> float: ...
    @property
    def clip(self) -> bool: ...
    @property
    def epsilon_low(self) -> float: ...
    @property
    def epsilon_high(self) -> float: ...
    @property
    def clip_c(self) -> float: ...
    @property
    def kl_importance_weight(self) -> bool: ...
    @property
    def kl_level(self) -> str: ...
    @property
    def kl_clip_mode(self) -> str: ...
    @property
    def kl_to_go(self) -> str: ...
    @property
    def kl_estimate(self) -> str: ...
    @property
    def kl_to_go_baseline(self) -> str: ...
    @property
    def kl_term(self) -> KLTerm: ...


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{t'≥t} x_t'`` along the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1)


@dataclass(frozen=True)
class KLTerm:
    """One row of the module table: the divergence estimate and its gradient weight, per token and over whole
    completions.

    ``value`` and ``weight`` take ``(w, r, log_w, log_r)`` (per-token tensors that broadcast). ``sequence_value`` takes
    ``(prefixes, log_w, log_r)`` and returns per-token terms whose sum over a completion is the estimate of the
    divergence between whole completions, with autograd giving [`sequence_weight`](KLTerm.sequence_weight). That weight
    is a signed sum of three parts (``sequence_parts``): ``"to_go"`` the KL-to-go ``Σ_{t'≥t} W≤t'·log ρ_t'``, ``"W"``
    the score term ``+W≤t`` and ``"-R"`` the term ``−R≤t``; the trainers evaluate it in log space
    ([`sequence_kl_weight`]).
    """

    divergence: str  #: the divergence ``D`` it estimates, e.g. ``"KL(π_θ‖π_ref)"``
    paper: str  #: where the paper derives its gradient
    value: Callable[..., torch.Tensor]  #: ``S``, with ``E_old[S] = D`` (per token)
    weight: Callable[..., torch.Tensor]  #: ``K = ∂S/∂log π_θ``; the KL part of ``W`` is ``−β·K``
    #: ``S_t``, with ``E_old[Σ_t S_t] = D`` between whole completions
    sequence_value: Callable[..., torch.Tensor] | None = None
    #: ``K_t = ∂(Σ_t' S_t')/∂log π_θ(y_t | y_<t)`` as a sum of the parts ``"to_go"``, ``"W"`` and ``"-R"``
    sequence_parts: tuple[str, ...] = ()
    #: False for GRPO's uncorrected k3 (Sec. 2.2): evaluated at the token ratios, without importance weight or clip.
    importance_weighted: bool = True
    #: True when ``sequence_weight`` holds the score term ``W≤t`` (the normalised rows' difference from the
    #: unnormalised ones, zero in expectation): it is dropped when the prefix ratios are clipped, since
    #: ``E_old[W̄≤t·∇log π_θ] ≠ 0`` once ``W̄≤t ≠ W≤t`` (docs: *Design of the RPG loss in rpg_trl*, "Two KL levels").
    sequence_score_term: bool = False
    #: Which importance weights ``K`` grows with, i.e. what ``kl_clip_mode="truncated"`` bounds: ``"none"`` (``K``
    #: does not grow with w: fkl's ``−r``, left exact), ``"own"`` (the token's ``w``, and at the sequence level its own
    #: prefix ``W≤t``: ufkl) or ``"to_go"`` (the token's ``w``, and at the sequence level every prefix ``W≤t'``,
    #: ``t' ≥ t``, of its KL-to-go: rkl, urkl).
    grows_with: str = "own"
    #: Which way the divergence runs between the next-token distributions at each position: ``"reverse"``
    #: KL(π_θ‖π_ref) (rkl, urkl, and GRPO's k3) or ``"forward"`` KL(π_ref‖π_θ) (fkl, ufkl): what
    #: ``kl_estimate="vocabulary"`` computes over the vocabulary ([`rpg_trl.losses.vocabulary`]).
    direction: str = "reverse"

    def sequence_weight(
        self, W: torch.Tensor, R: torch.Tensor, log_rho: torch.Tensor, kl_to_go: str = "log_ratio"
    ) -> torch.Tensor:
        """``K_t`` from its parts at the given (detached, (B, T)) ``W≤t``, ``R≤t`` and token ``log ρ_t``, in linear
        space: for prefix ratios known to be moderate (the clipped ones of ``kl_clip_mode="clipped"``) and for tests;
        [`sequence_kl_weight`] is the log-space form for ratios of any size. `kl_to_go` ([`KL_TO_GO`]): the later
        tokens' terms of the KL-to-go are ``W≤t'·log ρ_t'`` (``"log_ratio"``) or ``W≤t'·k3(ρ_t')`` (``"k3"``), the
        latter each formed in log space with its magnitude capped at ``e^LOG_WEIGHT_CLAMP`` ([`weighted_k3`]: ``k3``
        holds ``1/ρ``, which overflows where ``log ρ`` is tens of nats below 0)."""
        weight = torch.zeros_like(W)
        if "to_go" in self.sequence_parts:
            if kl_to_go == "k3":
                later = _reverse_cumsum(weighted_k3(W, log_rho))
                weight = weight + W * log_rho + torch.cat([later[..., 1:], torch.zeros_like(later[..., :1])], -1)
            else:
                weight = weight + _reverse_cumsum(W * log_rho)
        if "W" in self.sequence_parts:
            weight = weight + W
        if "-R" in self.sequence_parts:
            weight = weight - R
        return weight


#: How the KL-to-go ``Σ_{t'≥t} W≤t'·log ρ_t'`` of the reverse rows (rkl, urkl) is estimated at ``kl_level="sequence"``
#: (``kl_to_go``): ``"log_ratio"``, the sampled log-ratios of the later tokens as they are; ``"k3"``, each later
#: token's ``log ρ_t'`` replaced by ``k3(ρ_t') = log ρ_t' + 1/ρ_t' − 1``, which has the same expectation given the
#: tokens before it, so the gradient stays unbiased and the later tokens' noise falls from first to second order in
#: ``log ρ`` (docs: *Design of the RPG loss in rpg_trl*, "The KL-to-go at length").
KL_TO_GO = ("log_ratio", "k3")


#: The default of `kl_to_go`.
DEFAULT_KL_TO_GO = "log_ratio"


#: Below this ``|log ρ|`` [`log_k3`] uses the series of ``k3`` (``expm1(−x) + x`` cancels to its first order there).
_K3_SERIES_BELOW = 0.1
_K3_SERIES_TERMS = 12


def log_k3(log_rho: torch.Tensor) -> torch.Tensor:
    """``log k3(ρ)`` with ``k3(ρ) = 1/ρ − 1 + log ρ ≥ 0`` (Schulman's k3 at ``1/ρ``), from ``x = log ρ``, detached:
    ``−inf`` where ``x = 0``, and accurate to the dtype's rounding for every finite ``x`` (near 0 the series
    ``k3 = Σ_{n≥2} (−x)^n/n! = x²/2·Σ_{m≥0} 2·(−x)^m/(m + 2)!`` to ``m = 11``, whose remainder is below 1e-17 of it at
    ``|x| < 0.1``; ``−x + log1p((x − 1)·e^x)`` for large negative ``x``)."""
    x = log_rho.detach()
    small = x.abs() < _K3_SERIES_BELOW
    x_small = torch.where(small, x, 0.0)
    factor = torch.zeros_like(x_small)
    for m in range(_K3_SERIES_TERMS - 1, -1, -1):  # Horner: Σ_m 2·(−x)^m/(m + 2)!
        factor = factor * -x_small + 2.0 / math.factorial(m + 2)
    series = 2.0 * torch.log(x_small.abs()) - math.log(2.0) + torch.log(factor)
    very_negative = x < -30.0
    x_neg = torch.where(very_negative, x, -30.0)
    tail = -x_neg + torch.log1p((x_neg - 1.0) * torch.exp(x_neg))
    x_mid = torch.where(small | very_negative, 1.0, x)
    middle = torch.log(torch.expm1(-x_mid) + x_mid)
    return torch.where(small, series, torch.where(very_negative, tail, middle))


def weighted_k3(W: torch.Tensor, log_rho: torch.Tensor) -> torch.Tensor:
    """``W·k3(ρ)`` (``k3(ρ) = 1/ρ − 1 + log ρ``) for ``W ≥ 0`` and ``x = log ρ``, detached, formed in log space as
    ``exp(log W + log k3(ρ))`` ([`log_k3`]) with that exponent capped at ``LOG_WEIGHT_CLAMP``: exact up to rounding
    wherever ``W·k3(ρ) ≤ e^LOG_WEIGHT_CLAMP ≈ 2.4e17``, and ``e^LOG_WEIGHT_CLAMP`` beyond (the cap of every
    sequence-level KL weight). ``k3`` grows like ``1/ρ = e^{−x}``, so ``W·(1/ρ − 1 + log ρ)`` in linear space is
    ``inf`` in float32 once ``x < −88`` (and ``inf − inf`` or ``inf·0`` downstream), however small the product."""
    return torch.exp((torch.log(W) + log_k3(log_rho)).clamp(max=LOG_WEIGHT_CLAMP))


def _W_before_times_w(p: Prefixes, log_w: torch.Tensor) -> torch.Tensor:
    """``SG(W≤t−1)·w_t``: its derivative w.r.t. ``log π_θ(y_s | y_<s)`` is ``W≤s`` at ``s = t`` and 0 elsewhere; its
    expectation under π_old is 1 (the mass of a normalised policy)."""
    return torch.exp(clamp_log_ratio(p.log_W_before + log_w))


def uncorrected_k3(log_w: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """GRPO's k3 penalty ``π_ref/π_θ − log(π_ref/π_θ) − 1`` without the importance weight (Sec. 2.2). Its derivative
    w.r.t. ``log π_θ`` is ``1 − π_ref/π_θ``, whose expectation under π_θ is the gradient of the forward
    KL(π_ref‖π_θ), not of the reverse KL that its value estimates."""
    log_inv_rho = log_r - log_w
    return torch.exp(log_inv_rho) - log_inv_rho - 1.0


KL_TERMS: dict[str, KLTerm] = {
    "fkl": KLTerm(
        "KL(π_ref‖π_θ)",
        "Prop. E.1 / F.1, Table 4",
        value=lambda w, r, log_w, log_r: r * (log_r - log_w),
        weight=lambda w, r, log_w, log_r: -r * torch.ones_like(w),
        sequence_value=lambda p, log_w, log_r: torch.exp(p.log_R) * (log_r - log_w),
        sequence_parts=("-R",),
        grows_with="none",
        direction="forward",
    ),
    "ufkl": KLTerm(
        "UKL(π_ref‖π_θ)",
        "Prop. 3.2 / F.3, Table 1",
        value=lambda w, r, log_w, log_r: r * (log_r - log_w) - r + w,
        weight=lambda w, r, log_w, log_r: w - r,
        sequence_value=lambda p, log_w, log_r: (
            torch.exp(p.log_R) * (log_r - log_w - 1.0) + _W_before_times_w(p, log_w)
        ),
        sequence_parts=("W", "-R"),
        sequence_score_term=True,
        direction="forward",
    ),
    "rkl": KLTerm(
        "KL(π_θ‖π_ref)",
        "Prop. E.3 / F.4, Table 4",
        value=lambda w, r, log_w, log_r: w * (log_w - log_r),
        weight=lambda w, r, log_w, log_r: w * (log_w - log_r + 1.0),
        sequence_value=lambda p, log_w, log_r: torch.exp(p.log_W) * (log_w - log_r),
        sequence_parts=("to_go", "W"),
        sequence_score_term=True,
        grows_with="to_go",
    ),
    "urkl": KLTerm(
        "UKL(π_θ‖π_ref) = E_θ[k3(π_ref/π_θ)]",
        "Prop. 3.6 / F.5, Table 1",
        value=lambda w, r, log_w, log_r: w * (log_w - log_r) - w + r,
        weight=lambda w, r, log_w, log_r: w * (log_w - log_r),
        sequence_value=lambda p, log_w, log_r: (
            torch.exp(p.log_W) * (log_w - log_r) - _W_before_times_w(p, log_w) + torch.exp(p.log_R)
        ),
        sequence_parts=("to_go",),
        grows_with="to_go",
    ),
    "k3": KLTerm(
        "UKL(π_θ‖π_ref) estimated by GRPO's k3 without importance weight (biased off-policy)",
        "Sec. 2.2",
        value=lambda w, r, log_w, log_r: uncorrected_k3(log_w, log_r),
        weight=lambda w, r, log_w, log_r: 1.0 - torch.exp(log_r - log_w),
        importance_weighted=False,
    ),
}


#: The divergences a user chooses (`divergence=`); the uncorrected k3 row is chosen by `kl_importance_weight=False`.
DIVERGENCES = tuple(name for name, term in KL_TERMS.items() if term.importance_weighted)


#: Where the KL's importance weights are taken: per token (the paper's code and every peer) or over the whole
#: completion up to each token (the exact gradient of the divergence between whole completions; docs: *Design of the
#: RPG loss in rpg_trl*, "Two KL levels").
KL_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class ControlledKL:
    """The KL estimate that β weighs at one KL level, named as the loss's metrics name it ([`rpg_loss`]): the metric
    `metric` is a mean over `count` units (active tokens, or completions with at least one active token), so that a sum
    over micro-batches and processes is ``Σ metric·count / Σ count``. The adaptive KL coefficient holds this estimate
    near its target."""

    metric: str  #: ``"kl"`` (token mean of the per-token estimate) or ``"kl/sequence"`` (completion mean)
    count: str  #: ``"num_tokens"`` or ``"num_sequences"``: the metric's denominator


#: The KL that β weighs, per KL level: per token, the token mean of ``S``; over whole completions, the completion mean
#: of the whole-completion estimate.
CONTROLLED_KL = {
    "token": ControlledKL("kl", "num_tokens"),
    "sequence": ControlledKL("kl/sequence", "num_sequences"),
}


#: The default of `kl_clip_mode` (a key of [`KL_CLIP_MODES`]), chosen on the KL table of the project's CPU benchmark (a
#: toy task with a reference model: `"exact"` and `"truncated"` collapsed on no run, and `"truncated"` had the higher
#: mean true reward, within the arms' intervals; docs: *Design of the RPG loss in rpg_trl*, "The KL term outside the
#: trust region").
DEFAULT_KL_CLIP_MODE = "truncated"


class KLSignWarning(UserWarning):
    """A KL weighting that can push π_θ away from the reference is in use (``kl_clip_mode="clipped"`` with a reference
    that is not the sampling policy)."""


def _clip_log(log_x: torch.Tensor, spec: LossSpecFields) -> torch.Tensor:
    """``log clip(x, 1 − ε_low, 1 + ε_high)``, detached (Remark F.2)."""
    return log_x.detach().clamp(math.log(1.0 - spec.epsilon_low), math.log(1.0 + spec.epsilon_high))


def kl_values(ratios: RatioTensors, spec: LossSpecFields) -> torch.Tensor:
    """The divergence estimate per token, ``S`` (B, T), differentiable: the importance-weighted per-token estimate
    (``kl_level="token"``, at the token ratios whatever the importance-sampling level), or the terms whose sum over a
    completion estimates the divergence between whole completions (``kl_level="sequence"``). GRPO's uncorrected k3 is evaluated at the token ratios."""
    term = spec.kl_term
    if not term.importance_weighted:
        return term.value(None, None, ratios.kl_log_w, ratios.token_log_r)
    if spec.kl_level == "sequence":
        return term.sequence_value(ratios.prefixes, ratios.kl_log_w, ratios.token_log_r)
    return term.value(ratios.kl_w, ratios.token_r, ratios.kl_log_w, ratios.token_log_r)


def _exact_token_weight(
    term: KLTerm, ratios: RatioTensors, spec: LossSpecFields, regions: ClipRegions
) -> torch.Tensor:
    """``K(w, r)`` at the unclipped (clamped) token ratios (never the sequence's GSPO-style ratio: the KL keeps its own
    importance weights whatever ``importance_sampling_level`` is)."""
    return term.weight(ratios.token_w, ratios.token_r, ratios.token_log_w, ratios.token_log_r)


def _truncation(w: torch.Tensor, spec: LossSpecFields) -> torch.Tensor:
    """``min(1, c/w)``: the factor that turns an importance weight ``w`` into ``min(w, c)``."""
    return (spec.clip_c / w).clamp(max=1.0)


def _truncated_token_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``min(1, c/w)·K(w, r)``: every row's ``K`` is ``w·h(ρ)`` (``h = −1/ρ``, ``1 − 1/ρ``, ``log ρ + 1``, ``log ρ``
    for fkl, ufkl, rkl, urkl), and the importance weight ``w`` is truncated at c while ``h(ρ)`` stays exact. fkl's
    ``K = −r`` does not grow with w (``KLTerm.grows_with == "none"``): truncating it would bias it with no variance to
    save, so it stays exact."""
    weight = _exact_token_weight(term, ratios, spec, regions)
    if term.grows_with == "none":
        return weight
    return weight * _truncation(ratios.token_w, spec)


def _clipped_token_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K(w̄, r)`` with ``w̄ = clip(w, 1 − ε_low, 1 + ε_high)`` and ``log w̄`` (Remark F.2, Algorithm 1)."""
    w_bar = ratios.token_w.clamp(1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high)
    return term.weight(w_bar, ratios.token_r, _clip_log(ratios.token_log_w, spec), ratios.token_log_r)


def _stopped_token_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K(w, r)`` where the reward term keeps its gradient, 0 where RPG-Style Clip removes it (Algorithm 2)."""
    return _exact_token_weight(term, ratios, spec, regions).masked_fill(regions.any, 0.0)


def _reverse_logcumsumexp(x: torch.Tensor) -> torch.Tensor:
    """``log Σ_{t'≥t} exp(x_t')`` along the last dimension (−inf where every term is −inf)."""
    return x.flip(-1).logcumsumexp(-1).flip(-1)


def _suffix_max(x: torch.Tensor) -> torch.Tensor:
    """``max_{t'≥t} x_t'`` along the last dimension."""
    return x.flip(-1).cummax(-1).values.flip(-1)


def _difference_of_exps(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``e^{log_a} − e^{log_b}`` with the exact sign and a magnitude of at most ``e^LOG_WEIGHT_CLAMP``, computed as
    ``±e^{max}·(1 − e^{min − max})`` (no overflow, no cancellation beyond that of ``expm1``); 0 where both are −inf."""
    high, low = torch.maximum(log_a, log_b), torch.minimum(log_a, log_b)
    gap = torch.where(high > -math.inf, low - high, -math.inf)  # ≤ 0
    log_magnitude = (high + torch.log(-torch.expm1(gap))).clamp(max=LOG_WEIGHT_CLAMP)
    return torch.where(log_a >= log_b, 1.0, -1.0).to(log_magnitude.dtype) * torch.exp(log_magnitude)


def sequence_log_parts(
    term: KLTerm, prefixes: Prefixes, kl_to_go: str = DEFAULT_KL_TO_GO
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log P_t, log N_t)`` with ``K_t = P_t − N_t`` and ``P, N ≥ 0``: the positive and the negative parts of the
    exact sequence-level weight of `term` (the KL-to-go split by the sign of ``log ρ_t'`` and summed with a reverse
    ``logcumsumexp``, the score term ``W≤t`` on the positive side, ``R≤t`` on the negative side), from the unclamped
    prefix log-ratios, (B, T) each, detached. With ``kl_to_go="k3"`` ([`KL_TO_GO`]) the later tokens' terms are
    ``W≤t'·k3(ρ_t') ≥ 0``, all on the positive side; the token's own term ``W≤t·log ρ_t`` keeps its sign."""
    log_W, log_R, log_rho = prefixes.exact_log_W, prefixes.exact_log_R, prefixes.exact_log_rho
    nothing = torch.full_like(log_W, -math.inf)
    log_P = log_N = nothing
    if "to_go" in term.sequence_parts:
        log_terms = log_W + torch.log(log_rho.abs())  # −inf where log ρ_t' = 0 (and on inactive tokens)
        if kl_to_go == "k3":
            later = _reverse_logcumsumexp(log_W + log_k3(log_rho))  # Σ_{t'≥t}; shifted to Σ_{t'>t}
            later = torch.cat([later[..., 1:], nothing[..., :1]], -1)
            log_P = torch.logaddexp(torch.where(log_rho > 0, log_terms, nothing), later)
            log_N = torch.where(log_rho < 0, log_terms, nothing)
        else:
            log_P = _reverse_logcumsumexp(torch.where(log_rho > 0, log_terms, nothing))
            log_N = _reverse_logcumsumexp(torch.where(log_rho < 0, log_terms, nothing))
    if "W" in term.sequence_parts:
        log_P = torch.logaddexp(log_P, log_W)
    if "-R" in term.sequence_parts:
        log_N = torch.logaddexp(log_N, log_R)
    return log_P, log_N


def sequence_log_truncation(term: KLTerm, prefixes: Prefixes, spec: LossSpecFields) -> torch.Tensor:
    """``−log s_t`` (≥ 0) of the factor ``s_t = min(1, c / M_t)`` of ``kl_clip_mode="truncated"`` at the sequence
    level, one per token, with ``M_t`` the largest prefix ratio that ``K_t`` weighs: ``W≤t`` for ufkl,
    ``max_{t'≥t} W≤t'`` (the KL-to-go) for rkl and urkl; 0 (``s_t = 1``) for fkl, whose ``K_t = −R≤t`` does not grow
    with the prefix ratios. Past a completion's end the prefix stays at its last value, so padding never raises
    ``M_t``. Computed from the unclamped ``log W≤t``."""
    log_W = prefixes.exact_log_W
    if term.grows_with == "none":
        return torch.zeros_like(log_W)
    log_M = _suffix_max(log_W) if term.grows_with == "to_go" else log_W
    return (log_M - math.log(spec.clip_c)).clamp(min=0.0)


def sequence_kl_weight(
    term: KLTerm, prefixes: Prefixes, log_scale: torch.Tensor | None = None, kl_to_go: str = DEFAULT_KL_TO_GO
) -> torch.Tensor:
    """The sequence-level KL weight ``K_t`` of `term` times ``e^{−log_scale}`` (B, T), detached, in log space: the
    positive and negative parts ([`sequence_log_parts`]) are divided by the scale before they are exponentiated, so the
    weight has the exact sign at any completion length, and its magnitude is exact up to rounding wherever it stays
    below ``e^LOG_WEIGHT_CLAMP`` (beyond, that magnitude with the exact sign). With ``log_scale = −log s_t``
    ([`sequence_log_truncation`]) it is the truncated weight ``s_t·K_t``, whose parts are then bounded: ``c·Σ_{t'≥t}
    |log ρ_t'|`` for the KL-to-go and ``c`` for the score term. `kl_to_go`: how the KL-to-go is estimated
    ([`KL_TO_GO`])."""
    log_P, log_N = sequence_log_parts(term, prefixes, kl_to_go)
    if log_scale is not None:
        log_P, log_N = log_P - log_scale, log_N - log_scale
    return _difference_of_exps(log_P, log_N)


def _exact_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K_t`` of the whole-completion divergence at the exact prefix ratios (the sequence table of docs: *Design of
    the RPG loss in rpg_trl*, "Two KL levels"), in log space ([`sequence_kl_weight`])."""
    return sequence_kl_weight(term, ratios.prefixes, kl_to_go=spec.kl_to_go)


def _truncated_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``s_t·K_t``: the exact KL-to-go of each token scaled as a whole by one factor ``s_t = min(1, c / M_t)`` in
    ``(0, 1]`` ([`sequence_log_truncation`]), so each token's KL weight keeps the exact sign, is bounded by ``c`` times
    the sum of its ``|log ρ|`` to go (urkl; with ``kl_to_go="k3"``, ``c·(|log ρ_t| + Σ_{t'>t} k3(ρ_t'))``), and equals the exact weight wherever none of the prefix ratios it weighs
    exceeds ``c``. Computed in log space, so this holds at any completion length (the factor divides each part before
    it is exponentiated). (Truncating each prefix on its own, ``Σ_{t'≥t} min(W≤t', c)·log ρ_t'``, can flip the sign
    of the sum; docs: *Design of the RPG loss in rpg_trl*, "The KL term outside the trust region".)"""
    prefixes = ratios.prefixes
    return sequence_kl_weight(term, prefixes, sequence_log_truncation(term, prefixes, spec), spec.kl_to_go)


def _clipped_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K_t`` with the prefixes ``W≤t`` and the ``w_t`` inside ``log ρ_t = log w_t − log r_t`` clipped to the trust
    region, without the score term ``W≤t`` of ufkl and rkl (zero in expectation only when exact). ``R≤t`` is exact,
    its magnitude capped at ``e^LOG_WEIGHT_CLAMP``; so is each later term ``W̄≤t'·k3(ρ̄_t')`` of ``kl_to_go="k3"``
    ([`weighted_k3`]), which holds ``1/ρ̄_t' = r_t'/w̄_t'`` with ``r_t'`` unclipped."""
    prefixes = ratios.prefixes
    log_W, log_w = _clip_log(prefixes.exact_log_W, spec), _clip_log(ratios.token_log_w, spec)
    W = torch.exp(log_W)
    R = torch.exp(prefixes.exact_log_R.clamp(max=LOG_WEIGHT_CLAMP))
    log_r = prefixes.exact_log_W.new_zeros(()) if ratios.exact_log_r is None else ratios.exact_log_r
    weight = term.sequence_weight(W, R, log_w - log_r, spec.kl_to_go)
    if term.sequence_score_term:  # a clipped score term is not zero-mean: drop it
        weight = weight - W
    return weight


def _stopped_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """The exact ``K_t`` where the reward term keeps its gradient, 0 where RPG-Style Clip removes it."""
    return _exact_sequence_weight(term, ratios, spec, regions).masked_fill(regions.any, 0.0)


def _never_flips(kl_level: str, divergence: str, separate_reference: bool) -> bool:
    return False


def _clipped_flips(kl_level: str, divergence: str, separate_reference: bool) -> bool:
    # fkl's weight (−r per token, −R≤t per prefix) holds no w, so clipping leaves it exact. Per token with r = 1, urkl's
    # w̄·log w̄ and ufkl's w̄ − 1 have the sign of log w; rkl's w̄·(log w̄ + 1) > 0 where the exact w·(log w + 1) < 0
    # (w < 1/e). Over whole completions the clipped prefixes and the dropped score term flip signs even with r = 1.
    if divergence == "fkl":
        return False
    return kl_level == "sequence" or separate_reference or divergence == "rkl"


@dataclass(frozen=True)
class KLClipMode:
    """One reading of what RPG-Style Clip does to the KL term outside the trust region (``kl_clip_mode``).

    The paper's text, pseudo-code and code disagree here (docs: *Design of the RPG loss in rpg_trl*, "The KL term
    outside the trust region"). At the token level, inside the trust region every mode gives the exact weight ``K``. At
    the sequence level a token's ``K_t`` weighs prefix ratios ``W≤t'`` that can lie outside the trust region (and
    beyond ``c``) while its own ``w_t`` is inside: ``"exact"`` is exact everywhere, ``"truncated"`` wherever no prefix
    ratio that ``K_t`` weighs exceeds ``c``, ``"stopped"`` wherever the reward term is not clipped, ``"clipped"`` only
    where every prefix ratio it weighs and ``w_t`` lie in the trust region. ``token_weight`` and ``sequence_weight``
    take ``(term, ratios, spec, regions)`` and return the detached KL weight per token, (B, T), at ``kl_level="token"``
    and ``"sequence"``.
    """

    reading: str  #: what the mode does, in one line
    source: str  #: the reading it implements: paper section and line, or the code it follows
    token_weight: Callable[..., torch.Tensor]
    sequence_weight: Callable[..., torch.Tensor]
    #: ``(kl_level, divergence, separate_reference) -> bool``: whether, on some token, the mode's KL weight can have the
    #: opposite sign of the exact one (the KL gradient then pushes π_θ away from its anchor where the exact one pulls
    #: toward it); ``separate_reference``: the anchor is a reference model, not the sampling policy. False: on every
    #: token the weight has the exact weight's sign or is 0 (checked on random batches by the tests).
    can_flip_sign: Callable[[str, str, bool], bool] = _never_flips


#: How the KL weight is taken outside the trust region when the clip is on (``rpg_clip=True``); with the clip off every
#: mode is the exact weight. The reward term is RPG-Style Clip's in every mode.
KL_CLIP_MODES: dict[str, KLClipMode] = {
    "exact": KLClipMode(
        "the KL weight at the unclipped w on every token; only the reward term is clipped",
        "the authors' verl code (a separate KL loss at the unclipped ratio), TRL's use_bias_correction_kl, slime's "
        "--use-unbiased-kl, DeepSeek-V3.2 Eq. 7",
        token_weight=_exact_token_weight,
        sequence_weight=_exact_sequence_weight,
    ),
    "truncated": KLClipMode(
        "the importance weight inside the KL weight truncated at clip_c: min(1, c/w)·K per token, one factor "
        "min(1, c/max prefix ratio) on each token's KL-to-go over whole completions; fkl's K = −r is left exact; the "
        "sign of the exact weight kept",
        "rpg_trl (truncated importance sampling with the dual clip's bound c)",
        token_weight=_truncated_token_weight,
        sequence_weight=_truncated_sequence_weight,
    ),
    "clipped": KLClipMode(
        "the KL weight at w̄ = clip(w, 1 − ε_low, 1 + ε_high) and log w̄ on every token; with a "
        "reference that is not the sampling policy, with rkl, or over whole completions it can push π_θ away from its "
        "anchor",
        "Algorithm 1 lines 11-17 and 32 (the KL inside the clipped advantage, the gradient through w and Â), Remark F.2",
        token_weight=_clipped_token_weight,
        sequence_weight=_clipped_sequence_weight,
        can_flip_sign=_clipped_flips,
    ),
    "stopped": KLClipMode(
        "no KL gradient on the tokens whose reward term is clipped, the exact weight elsewhere",
        "Sec. G.2 and Algorithm 2 lines 20-34 (the gradient flows through w_t but is stopped at Â_t)",
        token_weight=_stopped_token_weight,
        sequence_weight=_stopped_sequence_weight,
    ),
}


def kl_weights(ratios: RatioTensors, spec: LossSpecFields, regions: ClipRegions) -> torch.Tensor:
    """The KL part ``K`` of the gradient weight ``W = w·A − β·K`` per token, (B, T), detached.

    Token level: ``K(w, r)`` of the module table. Sequence level: the exact weight of the whole-completion divergence,
    ``K_t`` of the sequence table in docs: *Design of the RPG loss in rpg_trl*, "Two KL levels" (``−R≤t``,
    ``W≤t − R≤t``, ``Σ_{t'≥t} W≤t'·log ρ_t' + W≤t``, ``Σ_{t'≥t} W≤t'·log ρ_t'``). With the clip on, outside the trust
    region, the weight is the one of ``spec.kl_clip_mode`` ([`KL_CLIP_MODES`]); `regions` are the reward term's clip
    regions (the ``"stopped"`` mode removes the KL gradient there). GRPO's uncorrected k3: ``1 − π_ref/π_θ``,
    unclipped.
    """
    term = spec.kl_term
    with torch.no_grad():
        if not term.importance_weighted:
            return term.weight(None, None, ratios.token_log_w, ratios.token_log_r)
        mode = KL_CLIP_MODES[spec.kl_clip_mode if spec.clip else "exact"]
        if spec.kl_level == "sequence":
            return mode.sequence_weight(term, ratios, spec, regions)
        return mode.token_weight(term, ratios, spec, regions)


def token_kl(
    ratios: RatioTensors, divergence: str | LossSpecFields, kl_importance_weight: bool = True
) -> torch.Tensor:
    """The per-token divergence estimate that is logged (``kl``) and drives the reference sync: ``S`` at the
    token-level ratios (whatever the importance-sampling and KL levels), or GRPO's k3 when uncorrected. Detached, and
    0 on inactive tokens (every row of the table is 0 at ``w = r = 1``). `divergence` is a divergence name or an
    [`RPGLossSpec`]."""
    if not isinstance(divergence, str):  # a loss specification
        divergence, kl_importance_weight = divergence.divergence, divergence.kl_importance_weight
    name = divergence if kl_importance_weight else "k3"
    if name not in ratios.token_kl_values:
        with torch.no_grad():
            term = KL_TERMS[name]
            ratios.token_kl_values[name] = term.value(
                ratios.token_w, ratios.token_r, ratios.token_log_w, ratios.token_log_r
            )
    return ratios.token_kl_values[name]


def sequence_kl(ratios: RatioTensors, spec: LossSpecFields) -> torch.Tensor:
    """The estimate of the divergence between whole completions, one value per completion (B,), detached: the row's
    per-token estimate ``S`` applied to the completion as a whole, at ``W = π_θ(y)/π_old(y)`` and
    ``R = π_ref(y)/π_old(y)`` (the logged ``kl/sequence``, with either `kl_level`). Unbiased under π_old, and never
    negative for the unnormalised divergences (``W·k3(R/W)`` for ``urkl``); on-policy with ``divergence="rkl"`` it is
    the completion's ``Σ_t log ρ_t``. (The token log-ratios are 0 on inactive tokens: the sums need no mask.)"""
    with torch.no_grad():
        log_W = ratios.token_log_w.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_R = torch.broadcast_to(ratios.token_log_r, ratios.token_log_w.shape).sum(-1)
        log_R = log_R.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return spec.kl_term.value(torch.exp(log_W), torch.exp(log_R), log_W, log_R)


def kl_can_flip_sign(spec: LossSpecFields, separate_reference: bool = True) -> bool:
    """Whether `spec`'s KL gradient can point away from its anchor on some token (the weight of the mode with the
    opposite sign of the exact one; [`KLClipMode.can_flip_sign`]): a clipped, importance-weighted KL with β > 0 in a
    [`KL_CLIP_MODES`] entry that can flip the sign at `spec`'s KL level and divergence. `separate_reference`: the anchor
    is a reference model (``ref_logps`` given, ``kl_anchor="reference"``), not the sampling policy."""
    return (
        spec.clip
        and spec.beta > 0
        and spec.kl_term.importance_weighted
        and KL_CLIP_MODES[spec.kl_clip_mode].can_flip_sign(spec.kl_level, spec.divergence, separate_reference)
    )


def kl_sign_message(spec: LossSpecFields, separate_reference: bool) -> str:
    """The text of the [`KLSignWarning`] for `spec` (for which [`kl_can_flip_sign`] is True)."""
    anchor = "a reference model" if separate_reference else "the sampling policy"
    return (
        f"kl_clip_mode={spec.kl_clip_mode!r} takes the KL weight at the clipped importance weight; with "
        f"divergence={spec.divergence!r}, kl_level={spec.kl_level!r} and the KL anchored to {anchor}, that weight can "
        "have the opposite sign of the exact one on tokens outside the trust region, where the KL term then pushes the "
        "policy away from its anchor (paper Sec. 3.3, Algorithm 1 and Remark F.2 read literally; "
        "help(rpg_trl.losses.KLClipMode) says where each mode keeps the sign). Use a mode that keeps the sign: "
        "kl_clip_mode='truncated' (the default) or 'exact'."
    )
