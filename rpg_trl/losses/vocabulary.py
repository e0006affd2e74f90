# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The exact per-position KL (``kl_estimate="vocabulary"``): at every completion position, the divergence between
the policy's and the anchor's whole next-token distributions, computed over the vocabulary from both models' final
hidden states and LM heads in tiles (no ``(B, T, V)`` logits), and the KL term of the RPG loss built from it at both
KL levels.

At a position ``t`` with prefix ``y<t``, with ``p = π_θ(·|y<t)`` and ``q = π_anchor(·|y<t)`` (the reference model, or
the sampling policy π_old), the sampled estimate of the KL table (``kl_estimate="sample"``, module table of
[`rpg_trl.losses`]) reads the one sampled token: for the reverse rows ``E_{y_t∼π_old}[w·log ρ] = KL(p‖q)``, for the
forward rows ``E_{y_t∼π_old}[r·log(r/w)] = KL(q‖p)``. The vocabulary estimate replaces that estimate by its conditional
expectation given the prefix, ``KL_t = Σ_v p(v)·log(p(v)/q(v))`` (or ``Σ_v q(v)·log(q(v)/p(v))``), computed exactly:
the Rao-Blackwellised estimate (Amini et al., 2025, arXiv 2504.10637), unbiased, and never noisier than sampling. Its
gradient is the exact gradient of each position's KL with respect to the policy's logits there, so the estimator
distinction of Proposition 4.1 does not apply to the KL term: ``estimator`` then chooses the reward term's form only.
Over normalised next-token distributions the unnormalised divergences equal the normalised ones (``Σ_v (q − p) = 0``
at every position): ``urkl`` and ``rkl`` give the same loss, and ``ufkl`` and ``fkl`` (docs: *Design of the RPG loss
in rpg_trl*, "The exact per-position KL").

The KL term of the loss (``β`` times, per token):

* ``kl_level="token"``: ``KL_t``, each position's KL as it stands, the per-token reading of the paper's code and of
  every peer (the prefix's distribution shift is not corrected).
* ``kl_level="sequence"``: the exact gradient of the divergence between whole completions, sampled from π_old. Reverse
  (``rkl``/``urkl``): ``D = Σ_t E_old[W<t·KL_t]`` with the prefix ratio ``W<t = Π_{s<t} w_s``, whose gradient is the
  direct term ``Σ_t W<t·∇KL_t`` plus the score term ``Σ_s G_s·∇log π_θ(y_s)`` with the KL-to-go
  ``G_s = Σ_{t>s} W<t·KL_t``. Forward (``fkl``/``ufkl``): ``D = Σ_t E_old[R<t·KL_t]`` with the reference's prefix
  ratio ``R<t = Π_{s<t} π_ref/π_old``, which does not depend on θ: only the direct term. The weights are formed in log
  space and capped at ``e^LOG_WEIGHT_CLAMP``, as the sampled sequence-level weights are.

RPG-Style Clip (``kl_clip_mode``): ``"exact"`` as above; ``"truncated"`` bounds the importance weights that the KL's
weights hold, so at the token level (no importance weight: ``KL_t`` is an expectation over the token) it is
``"exact"``, and at the sequence level the direct term's ``W<t`` becomes ``min(W<t, c)`` and each KL-to-go ``G_s`` is
scaled by ``min(1, c / max_{t>s} W<t)`` (the sign kept; fkl's ``R<t`` left exact, as with sampling); ``"stopped"``
takes the KL's gradient off the positions whose reward term is clipped (the value kept). ``"clipped"`` evaluates the
sampled token's KL weight at the clipped ratio, which the vocabulary estimate does not have: refused by
[`RPGLossSpec`](rpg_trl.losses.RPGLossSpec).
"""

from __future__ import annotations

import math

import torch

from .kl import LossSpecFields, _reverse_logcumsumexp, _suffix_max
from .ratios import LOG_WEIGHT_CLAMP, ClipRegions, RatioTensors
from .vocabulary_kernel import LogProbKLFunction


#: How the KL of each position is estimated (``kl_estimate``): ``"sample"`` from the sampled token's log-ratio (the KL
#: table of [`rpg_trl.losses`]), ``"vocabulary"`` exactly over the whole vocabulary (this module).
KL_ESTIMATES = ("sample", "vocabulary")
#: The default of `kl_estimate`.
DEFAULT_KL_ESTIMATE = "sample"
#: The `kl_clip_mode` values that have a meaning with ``kl_estimate="vocabulary"`` (module docstring).
VOCABULARY_KL_CLIP_MODES = ("exact", "truncated", "stopped")


def vocabulary_kl(
    policy_hidden: torch.Tensor,
    policy_head: tuple[torch.Tensor, torch.Tensor | None],
    anchor_hidden: torch.Tensor,
    anchor_head: tuple[torch.Tensor, torch.Tensor | None],
    direction: str,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """The KL between the next-token distributions of `N` positions, (N,) float32: ``KL(p‖q)`` (``direction=
    "reverse"``) or ``KL(q‖p)`` (``"forward"``), with ``p = softmax(transform(h_θ·W_θᵀ + b_θ)/temperature)`` the
    policy's and ``q`` the anchor's (its hidden states and head, treated as constants). ``transform`` is the model's
    ``logit_scale`` and ``final_logit_softcapping``, as TRL's fused LM head applies them. Computed in tiles of positions
    × vocabulary ([`rpg_trl.losses.vocabulary_kernel.LogProbKLFunction`], the kernel RPGTrainer runs inside the loss's
    scoring pass), the folds in float32; differentiable with respect to the policy's hidden states (``(N, H)``) and head
    (``(V, H)`` weight, optional ``(V,)`` bias), exactly: ``∇KL(p‖q) = p ⊙ (log p/q − KL)`` and ``∇KL(q‖p) = p − q``
    per logit."""
    if direction not in ("reverse", "forward"):
        raise ValueError(f"`direction` must be 'reverse' or 'forward'; got {direction!r}.")
    if policy_hidden.shape[0] != anchor_hidden.shape[0]:
        raise ValueError(
            f"The policy's and the anchor's hidden states must hold the same positions; got {policy_hidden.shape[0]} "
            f"and {anchor_hidden.shape[0]} rows."
        )
    (weight, bias), (anchor_weight, anchor_bias) = policy_head, anchor_head
    if weight.shape[0] != anchor_weight.shape[0]:
        raise ValueError(
            f"The policy's and the anchor's heads must share the vocabulary; got {weight.shape[0]} and "
            f"{anchor_weight.shape[0]} rows."
        )
    targets = torch.zeros(policy_hidden.shape[0], dtype=torch.long, device=policy_hidden.device)
    _, _, divergence = LogProbKLFunction.apply(
        policy_hidden,
        weight,
        bias,
        targets,
        anchor_hidden.detach(),
        anchor_weight.detach(),
        None if anchor_bias is None else anchor_bias.detach(),
        direction == "reverse",
        (logit_scale, final_logit_softcapping, 1.0 / temperature),
    )
    # A KL is >= 0; the online logsumexp can round a vanishing one a few ulps below 0.
    return divergence.clamp(min=0.0)


def position_kl(
    policy_hidden: torch.Tensor,
    policy_head: tuple[torch.Tensor, torch.Tensor | None],
    anchor_hidden: torch.Tensor,
    anchor_head: tuple[torch.Tensor, torch.Tensor | None],
    mask: torch.Tensor,
    direction: str,
    **transform,
) -> torch.Tensor:
    """Each completion position's exact KL, (B, T) float32, 0 where `mask` is 0: [`vocabulary_kl`] on the active
    positions only of the (B, T, H) hidden states of both models at the completion's positions (the states that
    predict each completion token). `transform`: `temperature`, `logit_scale`, `final_logit_softcapping`."""
    if policy_hidden.shape[:2] != mask.shape or anchor_hidden.shape[:2] != mask.shape:
        raise ValueError(
            f"The hidden states must be (B, T, H) with (B, T) = the mask's {tuple(mask.shape)}; got "
            f"{tuple(policy_hidden.shape)} (policy) and {tuple(anchor_hidden.shape)} (anchor)."
        )
    active = mask > 0
    rows = vocabulary_kl(
        policy_hidden[active], policy_head, anchor_hidden[active], anchor_head, direction, **transform
    )
    # `masked_scatter` keeps the result connected to the policy even when no position is active.
    return rows.new_zeros(mask.shape).masked_scatter(active, rows)


def _exclusive_prefix(exact_log_prefix: torch.Tensor, exact_log_token: torch.Tensor) -> torch.Tensor:
    """``log Π_{s<t} x_s`` from the inclusive ``log Π_{s≤t} x_s`` and the token's own ``log x_t``."""
    return exact_log_prefix - torch.broadcast_to(exact_log_token, exact_log_prefix.shape)


def _capped_exp(log_x: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_x.clamp(max=LOG_WEIGHT_CLAMP))


def vocabulary_kl_term(
    ratios: RatioTensors, regions: ClipRegions, spec: LossSpecFields, kl: torch.Tensor, baseline=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KL term of the per-token loss from the exact per-position KLs `kl` ((B, T), differentiable, 0 on inactive
    positions), unscaled by β, and its detached stats: ``(loss term (B, T), KL weight magnitude (B, T), sequence KL
    (B,))``.

    The loss term's value is each position's estimate (``KL_t``, or ``W<t·KL_t`` / ``R<t·KL_t`` at the sequence level)
    and its gradient the module docstring's; the weight magnitude is ``W<t·KL_t + G_t`` (``KL_t`` at the token level),
    the logged ``kl/weight_share``'s numerator; the sequence KL is each completion's ``Σ_t W<t·KL_t`` (reverse) or
    ``Σ_t R<t·KL_t`` (forward), at either level (the logged ``kl/sequence``). `baseline`: ``(weight, ratios) ->
    weight``, applied to the KL-to-go ``G_t`` (``kl_to_go_baseline``, [`rpg_trl.losses.baseline`])."""
    term = spec.kl_term
    reverse = term.direction == "reverse"
    active = ratios.active
    kl = torch.where(active, kl, 0.0)
    stopped = spec.clip and spec.kl_clip_mode == "stopped"
    with torch.no_grad():
        prefixes = ratios.prefixes
        if reverse:
            log_before = _exclusive_prefix(prefixes.exact_log_W, ratios.token_log_ratio.detach())
        else:
            exact_log_r = ratios.exact_log_r if ratios.exact_log_r is not None else ratios.token_log_r
            log_before = _exclusive_prefix(prefixes.exact_log_R, exact_log_r)
        log_kl = torch.log(kl.detach())  # −inf on inactive positions and where the KL is 0
        sequence_kl = _capped_exp(torch.logsumexp(log_before + log_kl, dim=-1))
    if spec.kl_level == "token":
        loss = kl
        if stopped:
            loss = torch.where(regions.any, kl.detach(), kl)
        return loss, kl.detach(), sequence_kl
    with torch.no_grad():
        log_direct = log_before
        log_to_go = None
        if reverse:
            # G_s = Σ_{t>s} W<t·KL_t: the suffix sum from t ≥ s, shifted by one.
            later = _reverse_logcumsumexp(log_before + log_kl)
            nothing = torch.full_like(later[..., :1], -math.inf)
            log_to_go = torch.cat([later[..., 1:], nothing], -1)
        if spec.clip and spec.kl_clip_mode == "truncated" and reverse:
            log_c = math.log(spec.clip_c)
            log_direct = log_before.clamp(max=log_c)  # min(W<t, c)
            largest_later = torch.cat([_suffix_max(log_before)[..., 1:], nothing], -1)
            log_to_go = log_to_go - (largest_later - log_c).clamp(min=0.0)
        direct = torch.where(active, _capped_exp(log_direct), 0.0)
        to_go = torch.zeros_like(direct) if log_to_go is None else torch.where(active, _capped_exp(log_to_go), 0.0)
        if baseline is not None:
            to_go = baseline(to_go, ratios)
        if stopped:
            direct = direct.masked_fill(regions.any, 0.0)
            to_go = to_go.masked_fill(regions.any, 0.0)
        value_weight = torch.where(active, _capped_exp(log_before), 0.0)
    log_ratio = ratios.token_log_ratio
    # Value: W<t·KL_t (the estimate); gradient: the direct term's weight times ∇KL_t, and G_t on log π_θ(y_t).
    loss = value_weight * kl.detach() + direct * (kl - kl.detach()) + to_go * (log_ratio - log_ratio.detach())
    return loss, (value_weight * kl.detach() + to_go.abs()), sequence_kl
