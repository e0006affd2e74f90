# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""RPG losses: pure tensor functions, no trainer dependency.

Notation (paper Sec. 2-3, generalised to a KL anchor that is not the sampling policy). Per completion token, with
``logps = log π_θ``, ``old_logps = log π_old`` (the policy that sampled the batch) and ``ref_logps = log π_ref`` (the KL
anchor):

* ``w = π_θ / π_old``   importance weight,
* ``r = π_ref / π_old`` reference weight (``r = 1`` when ``π_ref = π_old``),
* ``ρ = w / r = π_θ / π_ref``.

Every loss in this package produces, per token, the gradient ``∂loss/∂log π_θ = −W / N`` (N: the aggregation
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
while ``w ≤ 1 + ε_high``, and for ``A < 0`` while ``1 − ε_low ≤ w ≤ c``. Per token, inside the trust region
``[1 − ε_low, 1 + ε_high]`` the KL weight is the exact ``K``; outside it, it is the weight ``K̃`` of the chosen entry
of [`KL_CLIP_MODES`] (``kl_clip_mode``; the paper's text, pseudo-code and code disagree here, docs: *Design of the RPG
loss in rpg_trl*, "The KL term outside the trust region"): ``"exact"`` ``K(w, r)`` (the authors' code, TRL, slime),
``"truncated"`` ``min(1, c/w)·K(w, r)`` (the exact sign, bounded in w; fkl's ``K = −r`` as is), ``"clipped"``
``K(w̄, r)`` at ``w̄ = clip(w, 1 − ε_low, 1 + ε_high)`` and ``log w̄`` (Algorithm 1 literally, Remark F.2; with a
reference that is not the sampling policy it can push π_θ away from π_ref, and warns), ``"stopped"`` 0 where the reward
term is clipped (Algorithm 2). With the clip on, the per-token gradient weight of BOTH estimators is

    ``W = [w·A if the reward term is active else 0] − β·K̃``,

so the two estimators give the same gradient for every token, clipped or not. The differentiable estimator's loss value
keeps the importance-weighted estimate ``β·S(w)``; its gradient is ``β·K̃`` (a straight-through form). ``clip=False``
keeps the exact ``W`` everywhere. Log-ratios are clamped at ±[`LOG_RATIO_CLAMP`] in value only
([`clamp_log_ratio`]), so the clamp never takes the gradient off a token. The design is written out in
docs: *Design of the RPG loss in rpg_trl*.

Everything that defines the loss is one frozen [`RPGLossSpec`] (the trainers build it once from their configuration),
and ``kl_level="sequence"`` replaces the per-token KL weights of the table by the exact weights of the divergence between
whole completions, with prefix ratios, computed in log space at any length (``KLTerm.sequence_value`` /
[`sequence_kl_weight`]; docs: *Design of the RPG loss in rpg_trl*, "Two KL levels").

The package, one concern a module: ``ratios`` (w, r, the prefixes, the clip regions), ``kl`` (the KL table, both KL
levels, every ``kl_clip_mode``), ``surrogate`` (the reward term, the two estimators, the aggregation and the metrics)
and ``spec`` ([`RPGLossSpec`]); this module holds the entry points [`rpg_loss`] and [`rpg_per_token_loss`], and every
name is importable from ``rpg_trl.losses``.
"""

from __future__ import annotations

import torch

from .kl import (
    CONTROLLED_KL,
    DEFAULT_KL_CLIP_MODE,
    DEFAULT_KL_TO_GO,
    DIVERGENCES,
    KL_CLIP_MODES,
    KL_LEVELS,
    KL_TERMS,
    KL_TO_GO,
    ControlledKL,
    KLClipMode,
    KLSignWarning,
    KLTerm,
    kl_can_flip_sign,
    kl_sign_message,
    kl_values,
    kl_weights,
    log_k3,
    sequence_kl,
    sequence_kl_weight,
    sequence_log_parts,
    sequence_log_truncation,
    token_kl,
    uncorrected_k3,
)
from .ratios import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOG_RATIO_CLAMP,
    LOG_WEIGHT_CLAMP,
    ClipRegions,
    Prefixes,
    RatioTensors,
    clamp_log_ratio,
    clip_regions,
    importance_ratios,
)
from .spec import (
    PAPER_NAMES,
    RPGLossSpec,
    paper_name,
    validate_rpg_hyperparameters,
)
from .surrogate import (
    AGGREGATIONS,
    DIAGNOSTIC_METRICS,
    DIAGNOSTIC_PARTS,
    ESTIMATOR_FUNCTIONS,
    ESTIMATORS,
    SEQUENCE_SUM_ROWS,
    TOKEN_MEAN_METRICS,
    aggregate_loss,
    combine_diagnostic_parts,
    diagnostic_metrics,
    diagnostic_metrics_of,
    diagnostic_parts,
    diagnostic_parts_from_sums,
    differentiable_per_token_loss,
    gradient_weight_parts,
    nan_extreme,
    reinforce_per_token_loss,
    sequence_sums,
    summarize_stats,
)


__all__ = [
    "AGGREGATIONS",
    "CONTROLLED_KL",
    "ClipRegions",
    "ControlledKL",
    "DEFAULT_KL_CLIP_MODE",
    "DEFAULT_KL_TO_GO",
    "DIAGNOSTIC_METRICS",
    "DIAGNOSTIC_PARTS",
    "DIVERGENCES",
    "ESTIMATORS",
    "ESTIMATOR_FUNCTIONS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KLClipMode",
    "KLSignWarning",
    "KLTerm",
    "KL_CLIP_MODES",
    "KL_LEVELS",
    "KL_TERMS",
    "KL_TO_GO",
    "LOG_RATIO_CLAMP",
    "LOG_WEIGHT_CLAMP",
    "PAPER_NAMES",
    "Prefixes",
    "RPGLossSpec",
    "RatioTensors",
    "SEQUENCE_SUM_ROWS",
    "TOKEN_MEAN_METRICS",
    "aggregate_loss",
    "clamp_log_ratio",
    "clip_regions",
    "combine_diagnostic_parts",
    "diagnostic_metrics",
    "diagnostic_metrics_of",
    "diagnostic_parts",
    "diagnostic_parts_from_sums",
    "differentiable_per_token_loss",
    "gradient_weight_parts",
    "importance_ratios",
    "kl_can_flip_sign",
    "kl_sign_message",
    "kl_values",
    "kl_weights",
    "log_k3",
    "nan_extreme",
    "paper_name",
    "reinforce_per_token_loss",
    "rpg_loss",
    "rpg_per_token_loss",
    "sequence_kl",
    "sequence_kl_weight",
    "sequence_log_parts",
    "sequence_log_truncation",
    "sequence_sums",
    "summarize_stats",
    "token_kl",
    "uncorrected_k3",
    "validate_rpg_hyperparameters",
]


def rpg_per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: RPGLossSpec | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    reward_mask: torch.Tensor | None = None,
    **spec_fields,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token RPG loss, before aggregation: returns ``(per_token_loss (B, T), per-token stats)``.

    The loss is specified by `spec` (an [`RPGLossSpec`]) or by its fields as keyword arguments (``divergence=...``,
    ``beta=...``; see [`rpg_loss`]), not both. Computation runs in float32 (float64 inputs stay float64), whatever the
    input dtype. The stats dict holds detached tensors, each 0 (or False) on inactive tokens but the weight: (B, T)
    ``kl`` (the per-token divergence estimate ``S`` at the token-level ratios, see [`token_kl`]), the bool clip regions
    ``is_low_clipped``, ``is_high_clipped``, ``is_dual_clipped`` and their union ``is_clipped``, ``importance_weight``
    (``w``, 1 on inactive tokens), ``reward_gradient_weight`` and ``kl_gradient_weight`` (the two parts ``w·A`` and
    ``β·K̃`` of the gradient weight ``W = [w·A if the reward term is active] − β·K̃``, [`gradient_weight_parts`]), and
    (B,) ``sequence_kl`` (the whole-completion estimate, [`sequence_kl`]) and ``log_prefix_weight`` (the
    whole-completion log importance weight ``log W≤T = Σ_t (log π_θ − log π_old)``, unclamped).

    ``reward_mask`` ((B, T), optional) multiplies the reward term only: it is for credit-assignment filters such as
    TRL's top-entropy and off-policy masks, which choose the tokens whose reward signal counts, while the KL
    regulariser keeps acting on every token (as TRL adds ``β·KL`` after its masks).
    """
    spec = _resolve_spec(spec, spec_fields)
    spec.warn_if_kl_can_push_away(separate_reference=ref_logps is not None, stacklevel=2)
    ratios = importance_ratios(logps, old_logps, ref_logps, mask > 0, spec.importance_sampling_level)
    dtype = ratios.w.dtype
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    adv = advantages.to(dtype)  # (B, 1) or (B, T)
    if adv.shape == ratios.active.shape:  # per-token advantages: whatever padding holds, inactive tokens get 0
        adv = torch.where(ratios.active, adv, torch.zeros((), dtype=dtype, device=adv.device))
    regions = clip_regions(ratios.w, adv, spec.epsilon_low, spec.epsilon_high, spec.clip_c)
    if reward_mask is not None:
        reward_mask = reward_mask.to(dtype)
    # The two parts of the per-token gradient weight, computed once: the estimator gets K̃, the stats both parts.
    reward_weight, kl_weight = gradient_weight_parts(ratios, adv, regions, spec, reward_mask)
    per_token_loss = ESTIMATOR_FUNCTIONS[spec.estimator](
        ratios, adv, regions, spec, reward_mask, kl_weight=kl_weight, reward_weight=reward_weight
    )
    stats = {
        "kl": token_kl(ratios, spec),
        "sequence_kl": sequence_kl(ratios, spec),
        "is_low_clipped": regions.low,
        "is_high_clipped": regions.high,
        "is_dual_clipped": regions.dual,
        "is_clipped": regions.any,
        "importance_weight": ratios.w.detach(),
        "log_prefix_weight": ratios.token_log_ratio.detach().sum(-1),
        "reward_gradient_weight": reward_weight,
        "kl_gradient_weight": kl_weight * spec.beta,
    }
    return per_token_loss, stats


def _resolve_spec(spec: RPGLossSpec | None, spec_fields: dict) -> RPGLossSpec:
    if spec is None:
        return RPGLossSpec.from_kwargs(**spec_fields)
    if not isinstance(spec, RPGLossSpec):
        raise TypeError(f"`spec` must be an RPGLossSpec; got {type(spec).__name__}.")
    if spec_fields:
        raise TypeError(
            f"Pass the loss either as `spec` or as keyword arguments, not both; got spec and {sorted(spec_fields)} "
            "(use `spec.replace(...)` to change a field)."
        )
    return spec


def rpg_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: RPGLossSpec | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    num_items: float | torch.Tensor | None = None,
    max_length: int | None = None,
    **spec_fields,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Regularized Policy Gradient loss (paper Sec. 3-4; module docstring).

    Minimising the returned loss ascends ``J(θ) = E_{π_θ}[R] − β·D(·‖·)`` with samples drawn from ``π_old``: per
    active token, ``∂loss/∂logps = −mask·W/N`` where ``W`` is the regularised weight of Propositions 3.2 (UFKL),
    3.6 (URKL), E.1 (FKL) and E.3 (RKL), generalised to a separate anchor ``π_ref`` (module table), and ``N`` the
    normaliser of ``aggregation``. Both estimators produce this gradient when unclipped (Proposition 4.1):
    ``"differentiable"`` through the importance weight (Tables 1 and 4), ``"reinforce"`` with stop-gradient weights
    (Table 2, Appendix F, Eq. 4.1). ``clip=True`` applies RPG-Style Clip (Sec. 3.3, Algorithms 1 and 2): the reward
    term gets no gradient for ``A > 0, w > 1 + ε_high`` nor for ``A < 0`` with ``w < 1 − ε_low`` or ``w > c``, and the
    KL term's weight outside the trust region is ``kl_clip_mode``'s ``K̃`` ([`KL_CLIP_MODES`]), so that both
    estimators give ``W = [w·A if active] − β·K̃`` on every token. ``kl_level="sequence"`` replaces the KL part by the
    exact gradient of the divergence between whole completions (docs: *Design of the RPG loss in rpg_trl*, "Two KL
    levels").

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): ``log π_θ`` of the completion tokens, differentiable.
        old_logps (`torch.Tensor` of shape `(B, T)`): ``log π_old`` of the sampling policy (treated as constant).
        advantages (`torch.Tensor` of shape `(B,)` or `(B, T)`): advantages ``A = R − baseline``.
        mask (`torch.Tensor` of shape `(B, T)`): 1 for completion tokens that count, 0 for padding.
        spec ([`RPGLossSpec`], *optional*): the loss; or give its fields as keyword arguments:
            ``divergence`` (default ``"urkl"``: ``"fkl"``, ``"ufkl"``, ``"rkl"`` or ``"urkl"``, module table),
            ``estimator`` (``"reinforce"`` or ``"differentiable"``), ``beta`` (``1e-4``, paper Appendix H, ``>= 0``),
            ``clip`` (``True``: RPG-Style Clip), ``epsilon_low`` (``0.2``, in ``[0, 1)``), ``epsilon_high``
            (``0.28``), ``clip_c`` (``10.0``, the dual-clip bound ``c > 1``), ``aggregation`` (``"token-mean"``, the
            paper's, or ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``; see
            [`aggregate_loss`]), ``importance_sampling_level`` (``"token"``, or ``"sequence"``: the sequence's
            geometric-mean ratio for all its tokens, GSPO-style, in the reward term: the KL keeps its own token or prefix
            ratios; Proposition 4.1 holds for token-level weights only),
            ``kl_importance_weight`` (``True``; ``False`` is GRPO's *uncorrected* k3 penalty without the importance
            weight, the biased baseline of the KL-weighting ablation, Sec. 2.2, only with ``divergence="urkl"``: its
            value estimates the reverse KL but its expected gradient is that of the forward KL(π_ref‖π_θ), and a
            trainer with it ends on the forward-KL optimum in the project's CPU benchmark of the optima; docs: *Design
            of the RPG loss in rpg_trl*, "The regularised gradient") and ``kl_level`` (``"token"``: each token's KL
            term weighted by its own ratio, the paper's code and every peer; ``"sequence"``: the exact gradient of the
            KL between whole completions, exact under ``aggregation="seq-mean-token-sum"``), ``kl_clip_mode``
            (``DEFAULT_KL_CLIP_MODE``; how the clip weights the KL term outside the trust region: ``"exact"``,
            ``"truncated"``, ``"clipped"`` or ``"stopped"``, [`KL_CLIP_MODES`]) and ``kl_to_go`` (``"log_ratio"``;
            ``"k3"`` with ``kl_level="sequence"`` and ``divergence`` ``"rkl"`` or ``"urkl"``: the later tokens'
            ``log ρ`` in each token's KL-to-go replaced by ``k3(ρ) = log ρ + 1/ρ − 1``, the same expectation with less
            noise, [`KL_TO_GO`]).
        ref_logps (`torch.Tensor` of shape `(B, T)`, *optional*): ``log π_ref`` of the KL anchor. ``None`` anchors
            the KL to the sampling policy (``π_ref = π_old``, the paper's runs), which needs no reference model.
        num_items (`float` or `torch.Tensor`, *optional*): token-mean normaliser to use instead of ``mask.sum()``.
        max_length (`int`, *optional*): the length ``L`` of ``"seq-mean-token-sum-norm"`` (``Σ/(B·L)``); defaults to
            ``T``, the padded length of ``logps``.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss and detached metrics: ``kl`` (mean per-token
        divergence estimate to the anchor), ``kl/sequence`` (mean over completions of the whole-completion estimate),
        ``kl/controlled`` (the one of the two that β weighs, ``spec.controlled_kl``: ``kl`` with ``kl_level="token"``,
        ``kl/sequence`` with ``kl_level="sequence"``),
        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/dual_mean``, ``clip_ratio/region_mean``
        (fractions of active tokens), ``importance_weight/mean``, ``importance_weight/max``, ``importance_weight/min``,
        ``num_tokens`` and ``num_sequences`` (completions with at least one active token), and the diagnostics of
        the whole-completion importance weights ``W≤T = π_θ(y)/π_old(y)`` and of the KL term's weight
        ([`DIAGNOSTIC_METRICS`], at both KL levels): ``kl/log_prefix_weight/max``, ``kl/log_prefix_weight/min`` and
        ``kl/log_prefix_weight/std`` (over the completions with an active token), ``kl/prefix_ess`` (their effective
        sample size ``(Σ W)²/(n·Σ W²)`` as a fraction, in log space) and ``kl/weight_share`` (``Σ|β·K̃| / (Σ|w·A| +
        Σ|β·K̃|)`` over the active tokens: the KL term's share of the gradient weight).

    Raises:
        ValueError: an invalid field of the specification (unknown ``divergence``/``estimator``/``aggregation``,
            negative ``beta`` or epsilons, ``clip_c <= 1``, ...), mismatched shapes. An all-zero mask is not an
            error: it gives a zero loss that still backpropagates (zero gradients).
        TypeError: an unknown keyword argument, or both `spec` and keyword fields.
    """
    spec = _resolve_spec(spec, spec_fields)
    _check_shapes(logps, old_logps, advantages, mask, ref_logps)
    per_token_loss, stats = rpg_per_token_loss(logps, old_logps, advantages, mask, spec, ref_logps=ref_logps)
    fmask = (mask > 0).to(per_token_loss.dtype)
    loss = aggregate_loss(per_token_loss, fmask, spec.aggregation, num_items, max_length)
    metrics = summarize_stats(stats, fmask)
    metrics["kl/controlled"] = metrics[spec.controlled_kl.metric]
    return loss, metrics


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
