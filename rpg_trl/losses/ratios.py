# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The ratios of the RPG loss and the regions of RPG-Style Clip (paper Sec. 2-3 and 3.3): ``w = π_θ/π_old``,
``r = π_ref/π_old`` per token (and GSPO's sequence-level ratio for the reward term), the prefix ratios of whole
completions (``kl_level="sequence"``), and where the clip removes the reward term's gradient. Notation: the package's
docstring ([`rpg_trl.losses`])."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` (``e^20 ≈ 4.9e8``), so any finite
#: input gives a finite loss and finite gradients. At ``kl_level="sequence"`` the KL *weights* are computed from the
#: unclamped prefix log-ratios in log space ([`sequence_kl_weight`]); only the loss *value* there reads clamped prefixes.
LOG_RATIO_CLAMP = 20.0


#: The largest magnitude of a sequence-level KL weight, ``e^40 ≈ 2.4e17``: an exact weight beyond it (a prefix ratio
#: past ``e^40``, which no float32 product of the prefix could hold for long) is given this magnitude with its exact sign.
LOG_WEIGHT_CLAMP = 40.0


class _StraightThroughClamp(torch.autograd.Function):
    """The clamp to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` in the forward pass, the identity in the backward pass: one
    kernel (the form ``x + SG(clamp(x) − x)`` takes three, and rounds the clamped values)."""

    @staticmethod
    def forward(ctx, log_ratio):
        return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    @staticmethod
    def backward(ctx, grad):
        return grad


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` in value, with the gradient of the identity
    (straight-through): the clamp guards ``exp`` against overflow without taking the gradient off the tokens beyond it,
    so the differentiable estimator gives every token the gradient that the REINFORCE estimator gives it (the weight at
    the clamped ratio times ``∇log π_θ``)."""
    if not log_ratio.requires_grad:
        return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _StraightThroughClamp.apply(log_ratio)


@dataclass(frozen=True)
class Prefixes:
    """Whole-completion ratios for ``kl_level="sequence"``, (B, T) each: the products over the completion's tokens up to
    and including t (module notation ``W≤t``, ``R≤t``), as log-ratios: clamped against overflow for the loss value
    (``log_W``, ``log_W_before``, ``log_R``), unclamped and detached for the weights (``exact_log_W``,
    ``exact_log_R``, from the unclamped token log-ratios), which are computed in log space and never exponentiate a
    prefix on its own ([`sequence_kl_weight`])."""

    log_W: torch.Tensor  #: log W≤t = Σ_{s≤t} log w_s, clamped, differentiable
    log_W_before: torch.Tensor  #: log W≤t−1 = log W≤t − log w_t, clamped, detached
    log_R: torch.Tensor  #: log R≤t = Σ_{s≤t} log r_s, clamped, no grad
    exact_log_W: torch.Tensor  #: log W≤t, unclamped, detached
    exact_log_R: torch.Tensor  #: log R≤t, unclamped, no grad
    exact_log_rho: torch.Tensor  #: the token log ρ_t = log w_t − log r_t, unclamped, detached


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class RatioTensors:
    """The per-token ratios both estimators use, (B, T) float tensors (scalars broadcast). Inactive (masked) positions
    hold 0 log-ratios, so ``w = r = 1`` there exactly: padding never injects NaN/inf, no clip region and no logged
    divergence estimate counts it, and the REINFORCE loss ``−W·log w`` is 0 there without a mask."""

    token_log_ratio: torch.Tensor  #: log π_θ − log π_old per token (differentiable, unclamped)
    log_w: torch.Tensor  #: log w, clamped (sequence level: the sequence's mean token log-ratio), differentiable
    w: torch.Tensor  #: exp(log_w), differentiable
    log_r: torch.Tensor  #: log r, clamped, no grad (the scalar 0 when π_ref = π_old)
    r: torch.Tensor  #: exp(log_r), no grad
    token_log_w: torch.Tensor  #: token-level log w (detached), for the logged token KL
    token_log_r: torch.Tensor  #: token-level log r, for the logged token KL
    token_w: torch.Tensor  #: exp(token_log_w), detached (``w`` itself when the importance sampling is per token)
    token_r: torch.Tensor  #: exp(token_log_r) (``r`` itself when the importance sampling is per token)
    active: torch.Tensor  #: the active (unmasked) tokens, bool
    #: The differentiable token-level log w and w of the KL term (``log_w`` and ``w`` themselves when the importance
    #: sampling is per token): the KL keeps its own token weights under GSPO's sequence-level ratio, which is for the
    #: reward term.
    kl_log_w: torch.Tensor = None
    kl_w: torch.Tensor = None
    #: The token log r before its clamp (the scalar 0 when π_ref = π_old), no grad: the sequence-level weights read it.
    exact_log_r: torch.Tensor = None
    #: [`token_kl`] per row of the KL table, computed once
    token_kl_values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def prefixes(self) -> Prefixes:
        """The whole-completion prefix ratios ``W≤t`` and ``R≤t`` of these token ratios (masked tokens count as 1),
        computed once: clamped for the loss value, unclamped (from the unclamped token log-ratios) for the weights."""
        log_w = self.kl_log_w  # the clamped token log w, differentiable
        log_W = log_w.cumsum(-1)
        log_R = torch.broadcast_to(self.token_log_r, log_W.shape).cumsum(-1)
        exact_log_w = self.token_log_ratio.detach()
        exact_log_r = torch.broadcast_to(
            self.token_log_r if self.exact_log_r is None else self.exact_log_r, log_W.shape
        )
        return Prefixes(
            log_W=clamp_log_ratio(log_W),
            log_W_before=(log_W - log_w).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
            log_R=log_R.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
            exact_log_W=exact_log_w.cumsum(-1),
            exact_log_R=exact_log_r.cumsum(-1),
            exact_log_rho=exact_log_w - exact_log_r,
        )


def importance_ratios(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    active: torch.Tensor,
    importance_sampling_level: str = "token",
) -> RatioTensors:
    """Compute ``w`` and ``r`` (module notation) in the promoted float dtype, clamped before ``exp``.

    With ``importance_sampling_level="sequence"`` every token of a sequence gets the sequence's geometric-mean ratio
    (GSPO-style) in the reward term; the KL term keeps the token ratios (``kl_log_w``, ``token_w``, ``token_r``), so
    that each token's KL weight is the KL table's at its own ratios (or prefixes, ``kl_level="sequence"``), not at the
    sequence's ratio; under ``kl_clip_mode="stopped"`` the clip regions that remove it are the reward term's, which the
    sequence's ratio decides (docs: *Every `GRPOConfig` option under `RPGTrainer`*, "Taken with RPG's meaning").
    Proposition 4.1 holds for token-level weights only.
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    # Python zeros in `where` (wrapped scalars, no fill kernel on the device).
    token_log_ratio = torch.where(active, logps.to(dtype) - old_logps.to(dtype).detach(), 0.0)
    if ref_logps is None:
        # π_ref = π_old: r = 1 everywhere (a scalar that broadcasts)
        token_log_r = exact_log_r = torch.zeros((), dtype=dtype, device=logps.device)
    else:
        exact_log_r = torch.where(active, ref_logps.to(dtype).detach() - old_logps.to(dtype).detach(), 0.0)
        token_log_r = exact_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_r = torch.exp(token_log_r)
    if importance_sampling_level == "sequence":
        mask = active.to(dtype)
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_w = torch.where(active, (token_log_ratio * mask).sum(-1, keepdim=True) / lengths, 0.0)
        log_w = clamp_log_ratio(log_w)
        log_r, r = token_log_r, token_r
        if ref_logps is not None:
            log_r = torch.where(active, (token_log_r * mask).sum(-1, keepdim=True) / lengths, 0.0)
            r = torch.exp(log_r)
        w = torch.exp(log_w)
        kl_log_w = clamp_log_ratio(token_log_ratio)
        kl_w = torch.exp(kl_log_w)
        token_log_w, token_w = kl_log_w.detach(), kl_w.detach()
    else:  # the token-level ratios are the ratios of the loss: computed once
        log_w = clamp_log_ratio(token_log_ratio)
        log_r, r = token_log_r, token_r
        token_log_w = log_w.detach()
        w = torch.exp(log_w)
        token_w = w.detach()
        kl_log_w, kl_w = log_w, w
    return RatioTensors(
        token_log_ratio=token_log_ratio,
        log_w=log_w,
        w=w,
        log_r=log_r,
        r=r,
        token_log_w=token_log_w,
        token_log_r=token_log_r,
        token_w=token_w,
        token_r=token_r,
        active=active,
        kl_log_w=kl_log_w,
        kl_w=kl_w,
        exact_log_r=exact_log_r,
    )


@dataclass
class ClipRegions:
    """RPG-Style Clip (Sec. 3.3): where the reward term loses its gradient, (B, T) bool tensors (False on inactive
    tokens, whose weight is 1)."""

    low: torch.Tensor  #: A < 0 and w < 1 − ε_low
    high: torch.Tensor  #: A > 0 and w > 1 + ε_high
    dual: torch.Tensor  #: A < 0 and w > c
    any: torch.Tensor  #: the union of the three: the tokens whose reward term is clipped


def clip_regions(w: torch.Tensor, advantages: torch.Tensor, epsilon_low, epsilon_high, clip_c) -> ClipRegions:
    """The [`ClipRegions`] of the detached importance weight ``w`` for advantages ``A`` ((B, 1) or (B, T)).

    ``w`` must be 1 on inactive tokens (as [`importance_ratios`] makes it): no region then contains them, since
    ``1 − ε_low ≤ 1 ≤ 1 + ε_high < c``.
    """
    w = w.detach()
    negative, positive = advantages < 0, advantages > 0
    low = (w < 1.0 - epsilon_low) & negative
    high = (w > 1.0 + epsilon_high) & positive
    dual = (w > clip_c) & negative
    return ClipRegions(low=low, high=high, dual=dual, any=low | high | dual)
