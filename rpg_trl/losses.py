# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""RPG losses: pure tensor functions, no trainer dependency.

Notation (paper Sec. 2-3, generalised to a KL anchor that is not the sampling policy). Per completion token, with
``logps = log π_θ``, ``old_logps = log π_old`` (the policy that sampled the batch) and ``ref_logps = log π_ref`` (the KL
anchor):

* ``w = π_θ / π_old``   importance weight,
* ``r = π_ref / π_old`` reference weight (``r = 1`` when ``π_ref = π_old``),
* ``ρ = w / r = π_θ / π_ref``.

Every loss in this module produces, per token, the gradient ``∂loss/∂log π_θ = −W / N`` (N: the aggregation
normaliser) with the regularised policy-gradient weight ``W = w·A − β·K`` of the chosen divergence (A = advantage).
The registry [`KL_TERMS`] holds, per divergence, the importance-weighted estimate ``S`` of the divergence (its
expectation under π_old is ``D``) and its derivative ``K = ∂S/∂log π_θ``:

============  ===========================  ============================  ==================  ==========================
divergence    D                            S (value)                     K (weight)          paper (π_ref = π_old)
============  ===========================  ============================  ==================  ==========================
``fkl``       KL(π_ref ‖ π_θ)              ``r·(log r − log w)``         ``−r``              Prop. E.1 / F.1, Table 4
``ufkl``      UKL(π_ref ‖ π_θ)             ``r·(log r − log w) − r + w`` ``w − r``           Prop. 3.2 / F.3, Table 1
``rkl``       KL(π_θ ‖ π_ref)              ``w·log ρ``                   ``w·(log ρ + 1)``   Prop. E.3 / F.4, Table 4
``urkl``      UKL(π_θ ‖ π_ref)  (k3)       ``w·log ρ − w + r``           ``w·log ρ``         Prop. 3.6 / F.5, Table 1
============  ===========================  ============================  ==================  ==========================

Two estimators give this gradient (they coincide when unclipped, Proposition 4.1):

* ``"differentiable"`` (Tables 1 and 4): minimise ``−w·A + β·S`` and let autograd differentiate through ``w``
  ([`differentiable_per_token_loss`]).
* ``"reinforce"`` (Table 2, Appendix F): minimise ``−SG(W)·log π_θ`` with a stop-gradient weight
  ([`reinforce_per_token_loss`]).

RPG-Style Clip (Sec. 3.3 and 4.1, Algorithms 1 and 2) is a dual clip. The reward term has a gradient for ``A > 0``
while ``w ≤ 1 + ε_high``, and for ``A < 0`` while ``1 − ε_low ≤ w ≤ c``. The KL term keeps a gradient on every token,
but outside the trust region ``[1 − ε_low, 1 + ε_high]`` it is evaluated at the clipped weight
``w̄ = clip(w, 1 − ε_low, 1 + ε_high)`` (and ``log w̄``), as Remark F.2 puts ``w̄`` inside SG(·) for the REINFORCE
estimator and Algorithm 1 bounds it (the KL sits inside the clipped advantage there). With the clip on, the per-token
gradient weight of BOTH estimators is therefore

    ``W = [w·A if the reward term is active else 0] − β·K(w̄, r)``,

bounded by β times a constant, so the two estimators give the same gradient for every token, clipped or not. The
differentiable estimator's loss value keeps the importance-weighted estimate ``β·S(w)``; only its gradient outside the
trust region uses ``w̄`` (a straight-through form). ``clip=False`` keeps the exact ``W`` everywhere. The design is
written out in ``docs/design.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


DIVERGENCES = ("fkl", "ufkl", "rkl", "urkl")
ESTIMATORS = ("reinforce", "differentiable")
#: ``token-mean``: Σ/number of tokens; ``seq-mean-token-mean``: mean over sequences of each one's token mean;
#: ``seq-mean-token-sum``: mean over sequences of each one's token sum; ``seq-mean-token-sum-norm``: Σ/(B·max_length)
#: (Dr. GRPO, TRL's ``dr_grpo``).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` (``e^20 ≈ 4.9e8``), so any finite
#: input gives a finite loss and finite gradients.
LOG_RATIO_CLAMP = 20.0

#: Paper names of each (divergence, estimator) pair, used in docs, model cards and benchmark tables.
PAPER_NAMES = {
    ("fkl", "differentiable"): "RPG-FKL",
    ("ufkl", "differentiable"): "RPG-UFKL",
    ("rkl", "differentiable"): "RPG-RKL",
    ("urkl", "differentiable"): "RPG-URKL",
    ("fkl", "reinforce"): "RPG-REINFORCE-FKL",
    ("ufkl", "reinforce"): "RPG-REINFORCE-UFKL",
    ("rkl", "reinforce"): "RPG-REINFORCE-RKL",
    ("urkl", "reinforce"): "RPG-REINFORCE-URKL",
}


@dataclass(frozen=True)
class KLTerm:
    """One row of the module table: the importance-weighted divergence estimate and its derivative.

    Both callables take ``(w, r, log_w, log_r)`` (tensors that broadcast) and return a tensor.
    """

    divergence: str  #: the divergence ``D`` it estimates, e.g. ``"KL(π_θ‖π_ref)"``
    paper: str  #: where the paper derives its gradient
    value: Callable[..., torch.Tensor]  #: ``S``, with ``E_old[S] = D``
    weight: Callable[..., torch.Tensor]  #: ``K = ∂S/∂log π_θ``; the KL part of ``W`` is ``−β·K``


KL_TERMS: dict[str, KLTerm] = {
    "fkl": KLTerm(
        "KL(π_ref‖π_θ)",
        "Prop. E.1 / F.1, Table 4",
        value=lambda w, r, log_w, log_r: r * (log_r - log_w),
        weight=lambda w, r, log_w, log_r: -r * torch.ones_like(w),
    ),
    "ufkl": KLTerm(
        "UKL(π_ref‖π_θ)",
        "Prop. 3.2 / F.3, Table 1",
        value=lambda w, r, log_w, log_r: r * (log_r - log_w) - r + w,
        weight=lambda w, r, log_w, log_r: w - r,
    ),
    "rkl": KLTerm(
        "KL(π_θ‖π_ref)",
        "Prop. E.3 / F.4, Table 4",
        value=lambda w, r, log_w, log_r: w * (log_w - log_r),
        weight=lambda w, r, log_w, log_r: w * (log_w - log_r + 1.0),
    ),
    "urkl": KLTerm(
        "UKL(π_θ‖π_ref) = E_θ[k3(π_ref/π_θ)]",
        "Prop. 3.6 / F.5, Table 1",
        value=lambda w, r, log_w, log_r: w * (log_w - log_r) - w + r,
        weight=lambda w, r, log_w, log_r: w * (log_w - log_r),
    ),
}


def uncorrected_k3(log_w: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """GRPO's k3 penalty ``π_ref/π_θ − log(π_ref/π_θ) − 1`` without the importance weight (Sec. 2.2). Its derivative
    w.r.t. ``log π_θ`` is ``1 − π_ref/π_θ``, whose expectation under π_θ is the gradient of the forward
    KL(π_ref‖π_θ), not of the reverse KL that its value estimates."""
    log_inv_rho = log_r - log_w
    return torch.exp(log_inv_rho) - log_inv_rho - 1.0


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")


def _check_finite_number(name: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number; got {value!r}.")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"`{name}` must be {relation} {minimum}; got {value!r}.")
    return float(value)


def validate_rpg_hyperparameters(
    *,
    divergence: str,
    estimator: str,
    beta: float,
    clip: bool,
    epsilon_low: float,
    epsilon_high: float,
    clip_c: float,
    aggregation: str,
    importance_sampling_level: str = "token",
    kl_importance_weight: bool = True,
    names: dict[str, str] | None = None,
) -> None:
    """Raise a `ValueError` naming the argument and the allowed values for any invalid RPG hyperparameter.

    Shared by [`rpg_loss`] (checked at each call) and [`RPGConfig`] (checked at construction), which passes `names`
    to report its own field names (e.g. `{"clip": "rpg_clip", "epsilon_low": "epsilon"}`).
    """
    names = names or {}

    def n(name: str) -> str:
        return names.get(name, name)

    _check_choice(n("divergence"), divergence, DIVERGENCES)
    _check_choice(n("estimator"), estimator, ESTIMATORS)
    _check_choice(n("aggregation"), aggregation, AGGREGATIONS)
    _check_choice(n("importance_sampling_level"), importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _check_finite_number(n("beta"), beta, minimum=0.0)
    if not isinstance(clip, bool):
        raise ValueError(f"`{n('clip')}` must be a bool; got {clip!r}.")
    _check_finite_number(n("epsilon_low"), epsilon_low, minimum=0.0)
    if epsilon_low >= 1.0:
        raise ValueError(
            f"`{n('epsilon_low')}` must be in [0, 1) so that the lower clip bound 1 - {n('epsilon_low')} stays "
            f"positive; got {epsilon_low!r}."
        )
    _check_finite_number(n("epsilon_high"), epsilon_high, minimum=0.0)
    _check_finite_number(n("clip_c"), clip_c, minimum=1.0, strict=True)
    if clip_c < 1.0 + epsilon_high:
        raise ValueError(
            f"`{n('clip_c')}` (the dual-clip bound for negative advantages) must be >= 1 + {n('epsilon_high')} = "
            f"{1.0 + epsilon_high}; got {clip_c!r}."
        )
    if not isinstance(kl_importance_weight, bool):
        raise ValueError(f"`{n('kl_importance_weight')}` must be a bool; got {kl_importance_weight!r}.")
    if not kl_importance_weight and divergence != "urkl":
        raise ValueError(
            f"`{n('kl_importance_weight')}=False` is the uncorrected GRPO k3 penalty, an estimator of the reverse KL: "
            f"it is only defined with {n('divergence')}='urkl'; got {n('divergence')}={divergence!r}."
        )


@dataclass
class RatioTensors:
    """The per-token ratios both estimators use, (B, T) float tensors (scalars broadcast); masked positions hold 0
    log-ratios (weight 1) so that padding never injects NaN/inf."""

    token_log_ratio: torch.Tensor  #: log π_θ − log π_old per token (differentiable, unclamped)
    log_w: torch.Tensor  #: log w, clamped (sequence level: the sequence's mean token log-ratio), differentiable
    w: torch.Tensor  #: exp(log_w), differentiable
    log_r: torch.Tensor  #: log r, clamped, no grad (the scalar 0 when π_ref = π_old)
    r: torch.Tensor  #: exp(log_r), no grad
    token_log_w: torch.Tensor  #: token-level log w (detached), for the logged token KL
    token_log_r: torch.Tensor  #: token-level log r, for the logged token KL


def importance_ratios(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    active: torch.Tensor,
    importance_sampling_level: str = "token",
) -> RatioTensors:
    """Compute ``w`` and ``r`` (module notation) in the promoted float dtype, clamped before ``exp``.

    With ``importance_sampling_level="sequence"`` every token of a sequence gets the sequence's geometric-mean ratio
    (GSPO-style); Proposition 4.1 holds for token-level weights only.
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    mask = active.to(dtype)
    token_log_ratio = torch.where(active, logps.to(dtype) - old_logps.to(dtype).detach(), zero)
    if ref_logps is None:
        token_log_r = zero  # π_ref = π_old: r = 1 everywhere (a scalar that broadcasts)
    else:
        token_log_r = torch.where(active, ref_logps.to(dtype).detach() - old_logps.to(dtype).detach(), zero)
        token_log_r = token_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio, log_r = token_log_ratio, token_log_r
    if importance_sampling_level == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_ratio = torch.where(active, (token_log_ratio * mask).sum(-1, keepdim=True) / lengths, zero)
        if ref_logps is not None:
            log_r = torch.where(active, (token_log_r * mask).sum(-1, keepdim=True) / lengths, zero)
    log_w = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return RatioTensors(
        token_log_ratio=token_log_ratio,
        log_w=log_w,
        w=torch.exp(log_w),
        log_r=log_r,
        r=torch.exp(log_r),
        token_log_w=token_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
        token_log_r=token_log_r,
    )


@dataclass
class ClipRegions:
    """RPG-Style Clip (Sec. 3.3): where the reward term loses its gradient, (B, T) bool tensors."""

    low: torch.Tensor  #: A < 0 and w < 1 − ε_low
    high: torch.Tensor  #: A > 0 and w > 1 + ε_high
    dual: torch.Tensor  #: A < 0 and w > c

    @property
    def any(self) -> torch.Tensor:
        return self.low | self.high | self.dual


def clip_regions(w: torch.Tensor, advantages: torch.Tensor, active: torch.Tensor, epsilon_low, epsilon_high, clip_c):
    """The [`ClipRegions`] of the detached importance weight ``w`` for advantages ``A`` ((B, 1) or (B, T))."""
    w = w.detach()
    negative = active & (advantages < 0)
    return ClipRegions(
        low=negative & (w < 1.0 - epsilon_low),
        high=active & (advantages > 0) & (w > 1.0 + epsilon_high),
        dual=negative & (w > clip_c),
    )


def _clipped_log_w(log_w: torch.Tensor, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """``log w̄ = log clip(w, 1 − ε_low, 1 + ε_high)``, detached (Remark F.2)."""
    return log_w.detach().clamp(math.log(1.0 - epsilon_low), math.log(1.0 + epsilon_high))


def differentiable_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions | None,
    *,
    divergence: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    clip_c: float,
    kl_importance_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fully differentiable surrogate (Tables 1 and 4): ``−w·A + β·S(w, r)`` per token, through ``w``; returns the
    reward term and the KL term separately, (B, T) each.

    With the clip (``regions`` given) the reward term is PPO's dual clip (Algorithm 1: ``max(−w·A, −w̄·A)``, and for
    ``A < 0`` at most ``−c·A``), whose value and gradient are TRL's; outside the trust region the KL term is
    ``S(w) + K(w̄)·(log w − SG(log w))`` with a stopped ``S(w)``: the value stays the importance-weighted estimate and
    the gradient is ``β·K(w̄, r)`` (module docstring). GRPO's uncorrected k3 (``kl_importance_weight=False``) is
    applied as GRPO applies it: token level, never clipped.
    """
    w, log_w, r, log_r = ratios.w, ratios.log_w, ratios.r, ratios.log_r
    if regions is not None:
        clipped = -torch.clamp(w, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages
        reward_loss = torch.maximum(-w * advantages, clipped)
        reward_loss = torch.where(advantages < 0, torch.minimum(reward_loss, -clip_c * advantages), reward_loss)
    else:
        reward_loss = -w * advantages
    if not kl_importance_weight:
        token_log_w = ratios.token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return reward_loss, beta * uncorrected_k3(token_log_w, ratios.token_log_r)
    term = KL_TERMS[divergence]
    kl = term.value(w, r, log_w, log_r)
    if regions is not None:
        log_w_bar = _clipped_log_w(log_w, epsilon_low, epsilon_high)
        inside = log_w.detach() == log_w_bar
        k_bar = term.weight(torch.exp(log_w_bar), r, log_w_bar, log_r)
        straight_through = kl.detach() + k_bar * (log_w - log_w.detach())
        kl = torch.where(inside, kl, straight_through)
    return reward_loss, beta * kl


def reinforce_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions | None,
    *,
    divergence: str,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    kl_importance_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE-style surrogate (Table 2, Appendix F, Eq. 4.1): ``−SG(W)·log π_θ`` per token; returns the reward
    term ``−SG(w·A)·log π_θ`` and the KL term ``SG(β·K)·log π_θ`` separately, (B, T) each.

    ``W = [w·A if the reward term is active] − β·K(w̄, r)``: with the clip (``regions`` given) the KL weight uses the
    clipped ``w̄`` (Remark F.2). The gradient flows through the unclamped token log-ratio. GRPO's uncorrected k3
    (``kl_importance_weight=False``) contributes its own gradient ``1 − π_ref/π_θ`` per token, never clipped.
    """
    with torch.no_grad():
        w, log_w, r, log_r = ratios.w.detach(), ratios.log_w.detach(), ratios.r, ratios.log_r
        if not kl_importance_weight:
            kl_weight = 1.0 - torch.exp(ratios.token_log_r - ratios.token_log_w)
        else:
            log_w_kl = _clipped_log_w(log_w, epsilon_low, epsilon_high) if regions is not None else log_w
            kl_weight = KL_TERMS[divergence].weight(torch.exp(log_w_kl), r, log_w_kl, log_r)
        reward_weight = w * advantages
        if regions is not None:
            reward_weight = torch.where(regions.any, torch.zeros_like(reward_weight), reward_weight)
    return -reward_weight * ratios.token_log_ratio, beta * kl_weight * ratios.token_log_ratio


def token_kl(ratios: RatioTensors, divergence: str, kl_importance_weight: bool = True) -> torch.Tensor:
    """The per-token divergence estimate that is logged (``kl``) and drives the reference sync: ``S`` at the
    token-level ratios (also with sequence-level importance sampling), or GRPO's k3 when uncorrected. Detached."""
    with torch.no_grad():
        log_w, log_r = ratios.token_log_w, ratios.token_log_r
        if not kl_importance_weight:
            return uncorrected_k3(log_w, log_r)
        return KL_TERMS[divergence].value(torch.exp(log_w), torch.exp(log_r), log_w, log_r)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    num_items: float | torch.Tensor | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    * ``"token-mean"``: ``Σ loss·mask / N`` with ``N = mask.sum()``, or ``N = num_items`` when given (the trainer
      passes its global token count so that gradient accumulation and multi-process runs equal one large batch).
    * ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean (GRPO's original aggregation).
    * ``"seq-mean-token-sum"``: mean over sequences of each sequence's token sum (LUSPO).
    * ``"seq-mean-token-sum-norm"``: ``Σ loss·mask / (B·max_length)`` (Dr. GRPO); ``max_length`` defaults to ``T``.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    masked = per_token_loss * mask
    if aggregation == "token-mean":
        normalizer = mask.sum() if num_items is None else num_items
        if torch.is_tensor(normalizer):
            normalizer = normalizer.to(masked.dtype).clamp(min=1.0)
        else:
            normalizer = max(float(normalizer), 1.0)
        return masked.sum() / normalizer
    if aggregation == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if aggregation == "seq-mean-token-sum-norm":
        length = mask.size(-1) if max_length is None else max_length
        return masked.sum() / (mask.size(0) * length)
    return masked.sum(-1).mean()


def rpg_per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    divergence: str = "urkl",
    estimator: str = "reinforce",
    beta: float = 1e-4,
    clip: bool = True,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    clip_c: float = 10.0,
    importance_sampling_level: str = "token",
    kl_importance_weight: bool = True,
    reward_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token RPG loss, before aggregation: returns ``(per_token_loss (B, T) float32, per-token stats)``.

    Arguments are those of [`rpg_loss`] (which validates them). Computation runs in float32 (float64 inputs stay
    float64), whatever the input dtype. The stats dict holds (B, T) float tensors, detached: ``kl`` (the per-token
    divergence estimate ``S`` at the token-level ratios, see [`token_kl`]), ``is_low_clipped``, ``is_high_clipped``,
    ``is_dual_clipped`` and ``importance_weight`` (``w``).

    ``reward_mask`` ((B, T), optional) multiplies the reward term only: it is for credit-assignment filters such as
    TRL's top-entropy and off-policy masks, which choose the tokens whose reward signal counts, while the KL
    regulariser keeps acting on every token (as TRL adds ``β·KL`` after its masks).
    """
    active = mask > 0
    ratios = importance_ratios(logps, old_logps, ref_logps, active, importance_sampling_level)
    dtype = ratios.w.dtype
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    adv = advantages.to(dtype)  # (B, 1) or (B, T); masked positions are zeroed at the end
    regions = clip_regions(ratios.w, adv, active, epsilon_low, epsilon_high, clip_c)
    common = dict(
        divergence=divergence,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        kl_importance_weight=kl_importance_weight,
    )
    if estimator == "differentiable":
        reward_loss, kl_loss = differentiable_per_token_loss(
            ratios, adv, regions if clip else None, clip_c=clip_c, **common
        )
    else:
        reward_loss, kl_loss = reinforce_per_token_loss(ratios, adv, regions if clip else None, **common)
    if reward_mask is not None:
        reward_loss = reward_loss * reward_mask.to(dtype)
    per_token_loss = reward_loss + kl_loss
    per_token_loss = torch.where(active, per_token_loss, torch.zeros((), dtype=dtype, device=per_token_loss.device))
    stats = {
        "kl": token_kl(ratios, divergence, kl_importance_weight),
        "is_low_clipped": regions.low.to(dtype),
        "is_high_clipped": regions.high.to(dtype),
        "is_dual_clipped": regions.dual.to(dtype),
        "importance_weight": ratios.w.detach(),
    }
    return per_token_loss, stats


def rpg_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    divergence: str = "urkl",
    estimator: str = "reinforce",
    beta: float = 1e-4,
    clip: bool = True,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    clip_c: float = 10.0,
    aggregation: str = "token-mean",
    importance_sampling_level: str = "token",
    kl_importance_weight: bool = True,
    num_items: float | torch.Tensor | None = None,
    max_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Regularized Policy Gradient loss (paper Sec. 3-4; module docstring).

    Minimising the returned loss ascends ``J(θ) = E_{π_θ}[R] − β·D(·‖·)`` with samples drawn from ``π_old``: per
    active token, ``∂loss/∂logps = −mask·W/N`` where ``W`` is the regularised weight of Propositions 3.2 (UFKL),
    3.6 (URKL), E.1 (FKL) and E.3 (RKL), generalised to a separate anchor ``π_ref`` (module table), and ``N`` the
    normaliser of ``aggregation``. Both estimators produce this gradient when unclipped (Proposition 4.1):
    ``"differentiable"`` through the importance weight (Tables 1 and 4), ``"reinforce"`` with stop-gradient weights
    (Table 2, Appendix F, Eq. 4.1). ``clip=True`` applies RPG-Style Clip (Sec. 3.3, Algorithms 1 and 2): the reward
    term gets no gradient for ``A > 0, w > 1 + ε_high`` nor for ``A < 0`` with ``w < 1 − ε_low`` or ``w > c``, and the
    KL term's gradient is evaluated at the clipped weight ``w̄ = clip(w, 1 − ε_low, 1 + ε_high)`` (Remark F.2), so that
    both estimators give ``W = [w·A if active] − β·K(w̄, r)`` on every token.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): ``log π_θ`` of the completion tokens, differentiable.
        old_logps (`torch.Tensor` of shape `(B, T)`): ``log π_old`` of the sampling policy (treated as constant).
        advantages (`torch.Tensor` of shape `(B,)` or `(B, T)`): advantages ``A = R − baseline``.
        mask (`torch.Tensor` of shape `(B, T)`): 1 for completion tokens that count, 0 for padding.
        ref_logps (`torch.Tensor` of shape `(B, T)`, *optional*): ``log π_ref`` of the KL anchor. ``None`` anchors
            the KL to the sampling policy (``π_ref = π_old``, the paper's runs), which needs no reference model.
        divergence (`str`, defaults to `"urkl"`): ``"fkl"``, ``"ufkl"``, ``"rkl"`` or ``"urkl"`` (module table).
        estimator (`str`, defaults to `"reinforce"`): ``"reinforce"`` or ``"differentiable"``.
        beta (`float`, defaults to `1e-4`): KL coefficient β (paper Appendix H), ``>= 0``.
        clip (`bool`, defaults to `True`): apply RPG-Style Clip (dual clip).
        epsilon_low (`float`, defaults to `0.2`): ε_1, lower clip ``1 − ε_low``, in ``[0, 1)``.
        epsilon_high (`float`, defaults to `0.28`): ε_2, upper clip ``1 + ε_high``, ``>= 0``.
        clip_c (`float`, defaults to `10.0`): dual-clip bound ``c > 1`` for negative advantages.
        aggregation (`str`, defaults to `"token-mean"`): ``"token-mean"`` (the paper's), ``"seq-mean-token-mean"``,
            ``"seq-mean-token-sum"`` or ``"seq-mean-token-sum-norm"`` (see [`aggregate_loss`]).
        importance_sampling_level (`str`, defaults to `"token"`): ``"token"`` weights each token by its own ratio;
            ``"sequence"`` uses the sequence's geometric-mean ratio for all its tokens (GSPO-style). Proposition 4.1
            holds for token-level weights only.
        kl_importance_weight (`bool`, defaults to `True`): ``False`` replaces the KL term by GRPO's *uncorrected*
            k3 penalty ``β·k3(π_ref/π_θ)`` without the importance weight ``w``: the biased baseline of the paper's
            KL-weighting ablation (Sec. 2.2), only valid with ``divergence="urkl"``. Its value estimates the reverse
            KL, but its expected gradient is that of the forward KL(π_ref‖π_θ), on-policy too: per sample
            ``∇k3 = (1 − π_ref/π_θ)·∇log π_θ``, whose mean under π_θ is ``−Σ π_ref·∇log π_θ`` (docs/bench_optimum.md).
        num_items (`float` or `torch.Tensor`, *optional*): token-mean normaliser to use instead of ``mask.sum()``.
        max_length (`int`, *optional*): the length ``L`` of ``"seq-mean-token-sum-norm"`` (``Σ/(B·L)``); defaults to
            ``T``, the padded length of ``logps``.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar float32 loss and detached metrics: ``kl`` (mean
        divergence estimate to the anchor), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/dual_mean``, ``clip_ratio/region_mean`` (fractions of active tokens),
        ``importance_weight/mean``, ``importance_weight/max``, ``importance_weight/min`` and ``num_tokens``.

    Raises:
        ValueError: unknown ``divergence``/``estimator``/``aggregation``, negative ``beta`` or epsilons,
            ``clip_c <= 1``, mismatched shapes. An all-zero mask is not an error: it gives a zero loss that still
            backpropagates (zero gradients).
    """
    validate_rpg_hyperparameters(
        divergence=divergence,
        estimator=estimator,
        beta=beta,
        clip=clip,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        clip_c=clip_c,
        aggregation=aggregation,
        importance_sampling_level=importance_sampling_level,
        kl_importance_weight=kl_importance_weight,
    )
    _check_shapes(logps, old_logps, advantages, mask, ref_logps)

    per_token_loss, stats = rpg_per_token_loss(
        logps,
        old_logps,
        advantages,
        mask,
        ref_logps=ref_logps,
        divergence=divergence,
        estimator=estimator,
        beta=beta,
        clip=clip,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        clip_c=clip_c,
        importance_sampling_level=importance_sampling_level,
        kl_importance_weight=kl_importance_weight,
    )
    fmask = (mask > 0).to(per_token_loss.dtype)
    loss = aggregate_loss(per_token_loss, fmask, aggregation, num_items, max_length)
    return loss, summarize_stats(stats, fmask)


def summarize_stats(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reduce the per-token stats of [`rpg_per_token_loss`] to the detached scalar metrics of [`rpg_loss`]."""
    with torch.no_grad():
        mask = mask.to(stats["importance_weight"].dtype)
        active = mask > 0
        num_tokens = mask.sum()
        region = torch.maximum(
            torch.maximum(stats["is_low_clipped"], stats["is_high_clipped"]), stats["is_dual_clipped"]
        )
        keys = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean", "clip_ratio/region_mean")
        per_token = (stats["kl"], stats["is_low_clipped"], stats["is_high_clipped"], stats["is_dual_clipped"], region)
        w = stats["importance_weight"]
        sums = torch.stack([(x * mask).sum() for x in (*per_token, w)]) / num_tokens.clamp(min=1.0)
        metrics = dict(zip((*keys, "importance_weight/mean"), sums.unbind()))
        # Masked max/min without boolean indexing (which copies and synchronises); NaN when no token is active.
        nan = torch.full((), float("nan"), dtype=w.dtype, device=w.device)
        w_max = torch.where(active, w, torch.full((), -math.inf, dtype=w.dtype, device=w.device)).amax()
        w_min = torch.where(active, w, torch.full((), math.inf, dtype=w.dtype, device=w.device)).amin()
        has_tokens = num_tokens > 0
        metrics["importance_weight/max"] = torch.where(has_tokens, w_max, nan)
        metrics["importance_weight/min"] = torch.where(has_tokens, w_min, nan)
        metrics["num_tokens"] = num_tokens
        return metrics


def _check_shapes(logps, old_logps, advantages, mask, ref_logps) -> None:
    for name, tensor in (("logps", logps), ("old_logps", old_logps), ("advantages", advantages), ("mask", mask)):
        if not torch.is_tensor(tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor; got {type(tensor).__name__}.")
    if logps.dim() != 2:
        raise ValueError(f"`logps` must have shape (B, T); got {tuple(logps.shape)}.")
    expected = tuple(logps.shape)
    for name, tensor in (("old_logps", old_logps), ("mask", mask), ("ref_logps", ref_logps)):
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"`{name}` must have the shape of `logps` {expected}; got {tuple(tensor.shape)}.")
    if tuple(advantages.shape) not in ((expected[0],), expected, (expected[0], 1)):
        raise ValueError(
            f"`advantages` must have shape (B,) = ({expected[0]},), (B, 1) or (B, T) = {expected}; "
            f"got {tuple(advantages.shape)}."
        )
