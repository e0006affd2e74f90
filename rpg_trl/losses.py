# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""RPG losses: pure tensor functions, no trainer dependency.

Notation (RPG_SPEC section 1, paper Sec. 2-3). Per completion token, with ``logps = log π_θ``,
``old_logps = log π_old`` (the policy that sampled the batch) and ``ref_logps = log π_ref`` (the KL anchor):

* ``w = π_θ / π_old``   importance weight,
* ``r = π_ref / π_old`` reference weight (``r = 1`` when ``π_ref = π_old``),
* ``ρ = w / r = π_θ / π_ref``.

Every loss in this module produces, per token, the gradient ``∂loss/∂log π_θ = −W / N`` (N: the aggregation
normaliser) with the regularised policy-gradient weight ``W`` of the chosen divergence (A = advantage):

============  ===========================  ================================  ==============================
divergence    D                            W                                 paper (π_ref = π_old)
============  ===========================  ================================  ==============================
``fkl``       KL(π_ref ‖ π_θ)              ``w·A + β·r``                     Prop. E.1 / F.1, Table 4
``ufkl``      UKL(π_ref ‖ π_θ)             ``w·A − β·(w − r)``               Prop. 3.2 / F.3, Table 1
``rkl``       KL(π_θ ‖ π_ref)              ``w·A − β·w·(log ρ + 1)``         Prop. E.3 / F.4, Table 4
``urkl``      UKL(π_θ ‖ π_ref)  (k3)       ``w·A − β·w·log ρ``               Prop. 3.6 / F.5, Table 1
============  ===========================  ================================  ==============================

Two estimators give this gradient (they coincide when unclipped, Proposition 4.1):

* ``"differentiable"`` (Tables 1 and 4): minimise ``−w·A + β·S`` and let autograd differentiate through ``w``;
  ``S`` is the importance-weighted estimate of the divergence (its value is the KL estimate that is logged).
* ``"reinforce"`` (Table 2, Appendix F): minimise ``−SG(W)·log π_θ`` (stop-gradient weight).

RPG-Style Clip (Sec. 3.3 and 4.1, Algorithms 1 and 2) is a dual clip on the reward term: for ``A > 0`` the reward
term has a gradient while ``w ≤ 1 + ε_high``; for ``A < 0`` while ``1 − ε_low ≤ w ≤ c``. The KL term keeps its
gradient everywhere (for the REINFORCE estimator its stop-gradient weight uses the clipped ``w̄``, Remark F.2), so
inside the trust region ``[1 − ε_low, 1 + ε_high]`` the gradient is exactly ``W`` for both estimators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


DIVERGENCES = ("fkl", "ufkl", "rkl", "urkl")
ESTIMATORS = ("reinforce", "differentiable")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
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
    try:
        _validate(
            divergence,
            estimator,
            beta,
            clip,
            epsilon_low,
            epsilon_high,
            clip_c,
            aggregation,
            importance_sampling_level,
            kl_importance_weight,
        )
    except ValueError as error:
        message = str(error)
        for name, field_name in (names or {}).items():
            message = message.replace(f"`{name}`", f"`{field_name}`")
            if "_" in name:  # a distinctive identifier also appears bare in formulas, e.g. "1 - epsilon_low"
                message = message.replace(name, field_name)
        raise ValueError(message) from None


def _validate(
    divergence,
    estimator,
    beta,
    clip,
    epsilon_low,
    epsilon_high,
    clip_c,
    aggregation,
    importance_sampling_level,
    kl_importance_weight,
) -> None:
    _check_choice("divergence", divergence, DIVERGENCES)
    _check_choice("estimator", estimator, ESTIMATORS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _check_finite_number("beta", beta, minimum=0.0)
    if not isinstance(clip, bool):
        raise ValueError(f"`clip` must be a bool; got {clip!r}.")
    _check_finite_number("epsilon_low", epsilon_low, minimum=0.0)
    if epsilon_low >= 1.0:
        raise ValueError(
            f"`epsilon_low` must be in [0, 1) so that the lower clip bound 1 - epsilon_low stays positive; "
            f"got {epsilon_low!r}."
        )
    _check_finite_number("epsilon_high", epsilon_high, minimum=0.0)
    _check_finite_number("clip_c", clip_c, minimum=1.0, strict=True)
    if clip_c < 1.0 + epsilon_high:
        raise ValueError(
            f"`clip_c` (the dual-clip bound for negative advantages) must be >= 1 + epsilon_high = "
            f"{1.0 + epsilon_high}; got {clip_c!r}."
        )
    if not isinstance(kl_importance_weight, bool):
        raise ValueError(f"`kl_importance_weight` must be a bool; got {kl_importance_weight!r}.")
    if not kl_importance_weight and divergence != "urkl":
        raise ValueError(
            "`kl_importance_weight=False` is the uncorrected GRPO k3 penalty, an estimator of the reverse KL: it is "
            f"only defined with divergence='urkl'; got divergence={divergence!r}."
        )


@dataclass
class _Weights:
    """Per-token quantities shared by both estimators (all (B, T) float32, masked positions hold neutral values)."""

    log_w: torch.Tensor  # log w, clamped, differentiable
    log_r: torch.Tensor  # log r, clamped, no grad
    w: torch.Tensor  # exp(log_w), differentiable
    r: torch.Tensor  # exp(log_r), no grad


def _kl_value(divergence: str, w, r, log_w, log_r) -> torch.Tensor:
    """Importance-weighted per-token estimate ``S`` of the divergence to π_ref under samples from π_old.

    Its expectation under π_old is the divergence (Tables 1 and 4 with π_ref ≠ π_old); its derivative w.r.t.
    ``log π_θ`` is the KL part of ``−W/β`` in the module table.
    """
    log_rho = log_w - log_r
    if divergence == "fkl":  # KL(ref‖θ) = E_old[r (log r − log w)]
        return r * (log_r - log_w)
    if divergence == "ufkl":  # UKL(ref‖θ) = E_old[r (log r − log w) − r + w]
        return r * (log_r - log_w) - r + w
    if divergence == "rkl":  # KL(θ‖ref) = E_old[w log ρ]
        return w * log_rho
    # urkl: UKL(θ‖ref) = E_old[w log ρ − w + r] = E_old[w · k3(π_ref/π_θ)]
    return w * log_rho - w + r


def _kl_weight(divergence: str, w, r, log_w, log_r) -> torch.Tensor:
    """The KL part of ``W`` divided by ``−β``: ``∂S/∂log π_θ`` (module table)."""
    if divergence == "fkl":
        return -r
    if divergence == "ufkl":
        return w - r
    log_rho = log_w - log_r
    if divergence == "rkl":
        return w * (log_rho + 1.0)
    return w * log_rho  # urkl


def _uncorrected_k3(log_w, log_r) -> torch.Tensor:
    """GRPO's k3 penalty ``π_ref/π_θ − log(π_ref/π_θ) − 1`` without the importance weight (biased off-policy)."""
    log_inv_rho = log_r - log_w
    return torch.exp(log_inv_rho) - log_inv_rho - 1.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate_loss(
    per_token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, num_items: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    * ``"token-mean"``: ``Σ loss·mask / N`` with ``N = mask.sum()``, or ``N = num_items`` when given (the trainer
      passes its global token count so that gradient accumulation and multi-process runs equal one large batch).
    * ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean (GRPO's original aggregation).
    * ``"seq-mean-token-sum"``: mean over sequences of each sequence's token sum (Dr. GRPO / LUSPO style).
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token RPG loss, before aggregation: returns ``(per_token_loss (B, T) float32, per-token stats)``.

    Arguments are those of [`rpg_loss`] (which validates them). Computation runs in float32 (float64 inputs stay
    float64), whatever the input dtype. The stats dict holds (B, T) float tensors, detached: ``kl`` (the per-token
    divergence estimate ``S``), ``is_low_clipped``, ``is_high_clipped``, ``is_dual_clipped`` and ``importance_weight``
    (``w``).
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    active = mask > 0
    mask = mask.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    adv = advantages.to(dtype)  # (B, 1) or (B, T); masked positions are zeroed at the end

    # Log-ratios: masked positions are set to 0 (w = r = 1) so padding can never inject NaN/inf; clamp before exp.
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    token_log_ratio = torch.where(active, logps.to(dtype) - old_logps.to(dtype).detach(), zero)
    log_ratio = token_log_ratio
    if ref_logps is None:
        log_r = zero  # π_ref = π_old: r = 1 everywhere (a scalar that broadcasts)
    else:
        log_r = torch.where(active, ref_logps.to(dtype).detach() - old_logps.to(dtype).detach(), zero)
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if importance_sampling_level == "sequence":
        # GSPO-style sequence weight: the geometric mean of the token ratios, shared by every token of a sequence.
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_ratio = torch.where(active, (token_log_ratio * mask).sum(-1, keepdim=True) / lengths, zero)
        if ref_logps is not None:
            log_r = torch.where(active, (log_r * mask).sum(-1, keepdim=True) / lengths, zero)
    log_w = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    w = torch.exp(log_w)
    r = torch.exp(log_r)

    # Which tokens the reward term may move (RPG-Style Clip, Sec. 3.3); computed on the detached weight.
    w_d = w.detach()
    lower, upper = 1.0 - epsilon_low, 1.0 + epsilon_high
    negative = active & (adv < 0)
    is_low_clipped = negative & (w_d < lower)
    is_high_clipped = active & (adv > 0) & (w_d > upper)
    is_dual_clipped = negative & (w_d > clip_c)
    if clip:
        reward_active = ~(is_low_clipped | is_high_clipped | is_dual_clipped)
    else:
        reward_active = torch.ones_like(active)

    if estimator == "differentiable":
        if clip:
            # PPO dual clip on the reward term (Algorithm 1), the KL surrogate stays outside the clip (RPG_SPEC §3).
            clipped = -torch.clamp(w, lower, upper) * adv
            reward_loss = torch.maximum(-w * adv, clipped)
            reward_loss = torch.where(adv < 0, torch.minimum(reward_loss, -clip_c * adv), reward_loss)
        else:
            reward_loss = -w * adv
        if kl_importance_weight:
            kl_loss = _kl_value(divergence, w, r, log_w, log_r)
        else:
            kl_loss = _uncorrected_k3(log_w, log_r)
        per_token_loss = reward_loss + beta * kl_loss
        kl_value = kl_loss.detach()
    else:
        # REINFORCE-style (Table 2, Eq. 4.1): −SG(W)·log π_θ. The gradient flows through the unclamped log-ratio.
        with torch.no_grad():
            if kl_importance_weight:
                # Remark F.2: with the clip on, the KL component uses the clipped weight w̄ inside SG(·).
                log_w_kl = log_w.clamp(math.log(lower), math.log(upper)) if clip else log_w
                kl_grad = _kl_weight(divergence, torch.exp(log_w_kl), r, log_w_kl, log_r)
            else:
                # d k3 / d log π_θ = 1 − π_ref/π_θ
                kl_grad = 1.0 - torch.exp(log_r - log_w)
            weight = torch.where(reward_active, w_d * adv, zero) - beta * kl_grad
            if kl_importance_weight:
                kl_value = _kl_value(divergence, w_d, r, log_w.detach(), log_r)
            else:
                kl_value = _uncorrected_k3(log_w.detach(), log_r)
        per_token_loss = -weight * token_log_ratio

    per_token_loss = torch.where(active, per_token_loss, zero)
    stats = {
        "kl": kl_value,
        "is_low_clipped": is_low_clipped.to(dtype),
        "is_high_clipped": is_high_clipped.to(dtype),
        "is_dual_clipped": is_dual_clipped.to(dtype),
        "importance_weight": w_d,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Regularized Policy Gradient loss (paper Sec. 3-4; RPG_SPEC sections 2-4).

    Minimising the returned loss ascends ``J(θ) = E_{π_θ}[R] − β·D(·‖·)`` with samples drawn from ``π_old``: per
    active token, ``∂loss/∂logps = −mask·W/N`` where ``W`` is the regularised weight of Propositions 3.2 (UFKL),
    3.6 (URKL), E.1 (FKL) and E.3 (RKL), generalised to a separate anchor ``π_ref`` (RPG_SPEC §2), and ``N`` the
    normaliser of ``aggregation``. Both estimators produce this gradient when unclipped (Proposition 4.1):
    ``"differentiable"`` through the importance weight (Tables 1 and 4), ``"reinforce"`` with stop-gradient weights
    (Table 2, Appendix F, Eq. 4.1). ``clip=True`` applies RPG-Style Clip (Sec. 3.3, Algorithms 1 and 2): the reward
    term gets no gradient for ``A > 0, w > 1 + ε_high`` nor for ``A < 0`` with ``w < 1 − ε_low`` or ``w > c``.

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
        aggregation (`str`, defaults to `"token-mean"`): ``"token-mean"`` (the paper's), ``"seq-mean-token-mean"``
            or ``"seq-mean-token-sum"`` (see [`aggregate_loss`]).
        importance_sampling_level (`str`, defaults to `"token"`): ``"token"`` weights each token by its own ratio;
            ``"sequence"`` uses the sequence's geometric-mean ratio for all its tokens (GSPO-style). Proposition 4.1
            holds for token-level weights only.
        kl_importance_weight (`bool`, defaults to `True`): ``False`` replaces the KL term by GRPO's *uncorrected*
            k3 penalty ``β·k3(π_ref/π_θ)`` without the importance weight ``w``: the biased baseline of the paper's
            KL-weighting ablation (Sec. 2.2), only valid with ``divergence="urkl"``. On-policy it has the same value
            as the corrected term; off-policy its gradient is not that of any regularised objective.
        num_items (`float` or `torch.Tensor`, *optional*): token-mean normaliser to use instead of ``mask.sum()``.

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
    loss = aggregate_loss(per_token_loss, fmask, aggregation, num_items)
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
