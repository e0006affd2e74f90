# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""A baseline for the KL-to-go (``kl_to_go_baseline``, ``kl_level="sequence"``, rkl and urkl, either
``kl_estimate``).

Over whole completions a token's KL weight is ``K_t = W≤t·C_t``: its prefix ratio ``W≤t = Π_{s≤t} w_s`` times
``C_t``, the KL of the tokens from it on relative to that prefix (sampled: ``Σ_{t'≥t} W_(t,t']·log ρ_t'``, plus 1 for
rkl's score term; over the vocabulary: ``Σ_{t'>t} W_(t,t')·KL_t'``, with ``W_(t,t')`` the ratios strictly between).
Subtracting ``W≤t·B_t`` from it, with ``B_t`` any quantity that does not depend on the token ``y_t`` (given its prefix),
leaves the expected gradient unchanged: ``E_{y_t∼π_old}[W<t·w_t·B_t·∇log π_θ(y_t)] = W<t·B_t·Σ_v ∇π_θ(v|y<t) = 0``
(a control variate). ``"leave_one_out"`` takes for ``B_t`` the mean of ``C_t`` over the other completions of the same
prompt that reach position t (sampled independently of ``y_t``): the per-position baseline of the KL-to-go. It lowers
the noise of the KL's gradient, not its mean; per token the weight can take the opposite sign of ``K_t`` (the baseline
is exact in expectation only), so it is an option, with ``kl_clip_mode="exact"`` or the clip off (a truncated or
clipped weight is not ``W≤t·C_t``). Docs: *Design of the RPG loss in rpg_trl*, "The exact per-position KL".
"""

from __future__ import annotations

import torch

from .ratios import LOG_WEIGHT_CLAMP


#: ``kl_to_go_baseline``: ``"none"`` (the KL-to-go as it is) or ``"leave_one_out"`` (module docstring).
KL_TO_GO_BASELINES = ("none", "leave_one_out")
#: The default of `kl_to_go_baseline`.
DEFAULT_KL_TO_GO_BASELINE = "none"


def leave_one_out_mean(values: torch.Tensor, active: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """For each completion ``i`` and position ``t`` of (B, T) `values`, the mean of ``values[j, t]`` over the other
    completions ``j`` of its group (`groups`: (B,) integer labels; None: one group) that are `active` at ``t``; 0 where
    there is none. Detached."""
    with torch.no_grad():
        mask = active.to(values.dtype)
        values = torch.where(active, values, 0.0)
        if groups is None:
            totals, counts = values.sum(0, keepdim=True), mask.sum(0, keepdim=True)
        else:
            _, labels = torch.unique(groups, return_inverse=True)
            shape = (int(labels.max()) + 1 if labels.numel() else 0, values.shape[1])
            totals = values.new_zeros(shape).index_add_(0, labels, values)[labels]
            counts = mask.new_zeros(shape).index_add_(0, labels, mask)[labels]
        others = counts - mask
        return torch.where(others > 0, (totals - values) / others.clamp(min=1.0), 0.0)


def baselined_weight(weight: torch.Tensor, log_prefix: torch.Tensor, active: torch.Tensor, groups) -> torch.Tensor:
    """``W≤t·(C_t − B_t)`` from the KL weight ``K_t = W≤t·C_t`` (`weight`, (B, T), detached) and ``log W≤t``
    (`log_prefix`, unclamped): ``C_t`` is formed as ``K_t·e^{−log W≤t}`` (each factor finite wherever ``K_t`` is), the
    baseline is [`leave_one_out_mean`] of it, and the product's magnitude is capped at ``e^LOG_WEIGHT_CLAMP``, as every
    sequence-level weight."""
    with torch.no_grad():
        relative = weight * torch.exp(-log_prefix.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
        centred = relative - leave_one_out_mean(relative, active, groups)
        log_magnitude = (torch.log(centred.abs()) + log_prefix).clamp(max=LOG_WEIGHT_CLAMP)
        return torch.where(active, torch.sign(centred) * torch.exp(log_magnitude), 0.0)
