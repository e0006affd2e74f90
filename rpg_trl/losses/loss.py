# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The entry points of the RPG loss, [`rpg_loss`] and [`rpg_per_token_loss`] (the package docstring of
`rpg_trl.losses` states what they compute): they join the ratios, the KL term and the surrogate of the other modules
under one [`RPGLossSpec`]."""

from __future__ import annotations

import torch

from .baseline import baselined_weight
from .kl import sequence_kl, token_kl
from .ratios import clip_regions, importance_ratios
from .spec import RPGLossSpec
from .surrogate import (
    ESTIMATOR_FUNCTIONS,
    aggregate_loss,
    gradient_weight_parts,
    reward_gradient_weight,
    reward_per_token_loss,
    summarize_stats,
)
from .vocabulary import vocabulary_kl_term


def rpg_per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: RPGLossSpec | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    reward_mask: torch.Tensor | None = None,
    position_kl: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
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

    ``position_kl`` ((B, T), required with ``kl_estimate="vocabulary"`` and refused otherwise): each position's exact
    KL between the policy's and the anchor's next-token distributions in the divergence's direction, differentiable
    with respect to the policy ([`rpg_trl.losses.vocabulary.position_kl`]); the KL term, the logged ``kl`` and
    ``sequence_kl`` are then built from it ([`rpg_trl.losses.vocabulary.vocabulary_kl_term`]), and
    ``kl_gradient_weight`` is the KL term's per-token magnitude (``β·KL_t`` per token; ``β·(W<t·KL_t + G_t)`` over
    whole completions).

    ``groups`` ((B,) integer labels, optional): the prompt of each completion, for ``kl_to_go_baseline=
    "leave_one_out"``, whose baseline is the mean over the other completions of the same label (None: over all the
    others; [`rpg_trl.losses.baseline`]).
    """
    spec = _resolve_spec(spec, spec_fields)
    _check_position_kl(spec, position_kl, logps)
    baseline = None
    if spec.kl_to_go_baseline == "leave_one_out":

        def baseline(weight, ratios):
            return baselined_weight(weight, ratios.prefixes.exact_log_W, ratios.active, groups)

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
    if position_kl is not None:  # kl_estimate="vocabulary": the KL term from each position's exact KL
        reward_weight = reward_gradient_weight(ratios, adv, regions, spec, reward_mask)
        kl_term, kl_weight, whole_kl = vocabulary_kl_term(ratios, regions, spec, position_kl.to(dtype), baseline)
        per_token_loss = reward_per_token_loss(ratios, adv, regions, spec, reward_mask, reward_weight=reward_weight)
        per_token_loss = torch.add(per_token_loss, kl_term, alpha=spec.beta)
        logged_kl = torch.where(ratios.active, position_kl.detach().to(dtype), 0.0)
    else:
        reward_weight, kl_weight = gradient_weight_parts(ratios, adv, regions, spec, reward_mask)
        if baseline is not None:
            kl_weight = baseline(kl_weight, ratios)
        per_token_loss = ESTIMATOR_FUNCTIONS[spec.estimator](
            ratios, adv, regions, spec, reward_mask, kl_weight=kl_weight, reward_weight=reward_weight
        )
        logged_kl, whole_kl = token_kl(ratios, spec), sequence_kl(ratios, spec)
    stats = {
        "kl": logged_kl,
        "sequence_kl": whole_kl,
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


def _check_position_kl(spec: RPGLossSpec, position_kl: torch.Tensor | None, logps: torch.Tensor) -> None:
    if spec.kl_estimate == "vocabulary":
        if position_kl is None:
            raise ValueError(
                "kl_estimate='vocabulary' needs `position_kl`, each position's exact KL (B, T) "
                "(rpg_trl.losses.vocabulary.position_kl computes it from both models' hidden states and heads)."
            )
        if tuple(position_kl.shape) != tuple(logps.shape):
            raise ValueError(
                f"`position_kl` must have the shape of `logps` {tuple(logps.shape)}; got {tuple(position_kl.shape)}."
            )
    elif position_kl is not None:
        raise ValueError(
            f"`position_kl` (each position's exact KL) is the KL of kl_estimate='vocabulary'; the loss's kl_estimate "
            f"is {spec.kl_estimate!r}, which estimates the KL from the sampled tokens. Set kl_estimate='vocabulary' "
            "or leave `position_kl` out."
        )


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
    position_kl: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
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
            noise, [`KL_TO_GO`]) and ``kl_estimate`` (``"sample"``: each position's KL estimated from its sampled
            token, the KL table; ``"vocabulary"``: computed exactly over the vocabulary, given as `position_kl`,
            [`rpg_trl.losses.vocabulary`]) and ``kl_to_go_baseline`` (``"none"``; ``"leave_one_out"`` with
            ``kl_level="sequence"``, rkl or urkl and the exact weights: a per-position baseline subtracted from each
            token's KL-to-go, unbiased, [`rpg_trl.losses.baseline`]).
        ref_logps (`torch.Tensor` of shape `(B, T)`, *optional*): ``log π_ref`` of the KL anchor. ``None`` anchors
            the KL to the sampling policy (``π_ref = π_old``, the paper's runs), which needs no reference model.
        num_items (`float` or `torch.Tensor`, *optional*): token-mean normaliser to use instead of ``mask.sum()``.
        max_length (`int`, *optional*): the length ``L`` of ``"seq-mean-token-sum-norm"`` (``Σ/(B·L)``); defaults to
            ``T``, the padded length of ``logps``.
        position_kl (`torch.Tensor` of shape `(B, T)`, *optional*): with ``kl_estimate="vocabulary"`` (and only
            then), each position's exact KL to the anchor, differentiable with respect to the policy
            ([`rpg_trl.losses.vocabulary.position_kl`]).
        groups (`torch.Tensor` of shape `(B,)`, *optional*): each completion's prompt label, for the leave-one-out
            baseline of ``kl_to_go_baseline="leave_one_out"`` (None: every completion in one group).

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
    per_token_loss, stats = rpg_per_token_loss(
        logps, old_logps, advantages, mask, spec, ref_logps=ref_logps, position_kl=position_kl, groups=groups
    )
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
