# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The reward term, the two estimators and the aggregation of the RPG loss: the fully differentiable surrogate (Tables 1
and 4) and the REINFORCE-style one (Table 2, Appendix F, Eq. 4.1), which give the same gradient (Proposition 4.1),
RPG-Style Clip's reward term (Algorithms 1 and 2), the normalisers of TRL's loss types, and the metrics reduced on the
device."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._checks import (
    _check_choice,
)
from .kl import (
    LossSpecFields,
    kl_values,
    kl_weights,
    token_kl,
)
from .ratios import (
    ClipRegions,
    RatioTensors,
)


#: ``token-mean``: Σ/number of tokens; ``seq-mean-token-mean``: mean over sequences of each one's token mean;
#: ``seq-mean-token-sum``: mean over sequences of each one's token sum; ``seq-mean-token-sum-norm``: Σ/(B·max_length)
#: (Dr. GRPO, TRL's ``dr_grpo``).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class _ValueWithGradient(torch.autograd.Function):
    """``value`` (detached) in the forward pass; ``∂/∂x = weight`` in the backward pass (the straight-through form
    ``SG(value) + SG(weight)·(x − SG(x))`` in one op)."""

    @staticmethod
    def forward(ctx, value, weight, x):
        ctx.save_for_backward(weight)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return None, None, grad * weight


def _reward_term_differentiable(ratios: RatioTensors, advantages: torch.Tensor, regions: ClipRegions, spec):
    """``−w·A``, and with the clip PPO's dual clip ``min(max(−w·A, −w̄·A), −c·A)`` for ``A < 0`` (Algorithm 1), written
    as what it is: ``−A`` times the bound the clip reaches on the clipped tokens (``1 − ε_low``, ``1 + ε_high`` or
    ``c``, no gradient) and times ``w`` on the others."""
    w = ratios.w
    if spec.clip:
        with torch.no_grad():
            bound = (
                w.detach()
                .clamp(1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high)
                .masked_fill_(regions.dual, spec.clip_c)
            )
        w = torch.where(regions.any, bound, w)
    return w * -advantages


def gradient_weight_parts(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: LossSpecFields,
    reward_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two parts of the per-token gradient weight ``W = [w·A if the reward term is active] − β·K̃`` that both
    estimators give (module docstring of [`rpg_trl.losses`]), detached, (B, T): ``(reward part, K̃)`` with the reward
    part ``w·A`` (times `reward_mask`; 0 where RPG-Style Clip removes it) and ``K̃`` of [`kl_weights`] (unscaled by β).
    [`rpg_per_token_loss`] computes them once, hands ``K̃`` to the estimator and keeps ``w·A`` and ``β·K̃`` in its stats
    (the logged ``kl/weight_share``)."""
    with torch.no_grad():
        return reward_gradient_weight(ratios, advantages, regions, spec, reward_mask), kl_weights(
            ratios, spec, regions
        )


def reward_gradient_weight(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: LossSpecFields,
    reward_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reward part ``w·A`` of the gradient weight (times `reward_mask`; 0 where RPG-Style Clip removes it and on
    inactive tokens), detached, (B, T)."""
    with torch.no_grad():
        reward = ratios.w.detach() * advantages
        if spec.clip:
            reward = reward.masked_fill(regions.any, 0.0)
        if reward_mask is not None:
            reward = reward * reward_mask
        return torch.where(ratios.active, reward, 0.0)


def differentiable_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: LossSpecFields,
    reward_mask: torch.Tensor | None = None,
    *,
    kl_weight: torch.Tensor | None = None,
    reward_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fully differentiable surrogate (Tables 1 and 4): ``−w·A + β·S`` per token, through ``w``, (B, T), 0 on inactive
    tokens.

    With the clip on, the reward term is PPO's dual clip (Algorithm 1: ``max(−w·A, −w̄·A)``, and for ``A < 0`` at most
    ``−c·A``), whose value and gradient are TRL's; the KL term is ``SG(S) + SG(K̃)·(log w − SG(log w))``: the value
    stays the importance-weighted estimate and the gradient is ``β·K̃`` with ``K̃`` of [`kl_weights`] (the
    ``kl_clip_mode``'s weight), which is ``K(w)`` inside the trust region. With ``kl_level="sequence"`` the weights are those of the
    whole-completion divergence, whose clipped prefixes change the weights of the tokens before them too; there the
    gradient is always taken in that straight-through form, from the weights computed in log space
    ([`sequence_kl_weight`]), which equal autograd through ``Σ_t S_t`` wherever no prefix reaches the clamp.
    `kl_weight`: ``K̃`` when already computed ([`gradient_weight_parts`]); `reward_weight` is not used (the reward
    term's gradient flows through ``w``).
    """
    reward_loss = _reward_term_differentiable(ratios, advantages, regions, spec)
    if reward_mask is not None:
        reward_loss = reward_loss * reward_mask
    # Straight-through with the clip on, and always over whole completions, whose weights are taken in log space at
    # any length (autograd through `S` would read the clamped prefixes).
    if spec.kl_term.importance_weighted and (spec.clip or spec.kl_level == "sequence"):
        if spec.kl_level == "token":
            value = token_kl(ratios, spec)  # the logged estimate: the same token ratios
        else:
            with torch.no_grad():
                value = kl_values(ratios, spec)
        if kl_weight is None:
            kl_weight = kl_weights(ratios, spec, regions)
        kl = _ValueWithGradient.apply(value, kl_weight, ratios.kl_log_w)
    else:
        kl = kl_values(ratios, spec)
    zero = torch.zeros((), dtype=reward_loss.dtype, device=reward_loss.device)
    return torch.where(ratios.active, torch.add(reward_loss, kl, alpha=spec.beta), zero)


def reinforce_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: LossSpecFields,
    reward_mask: torch.Tensor | None = None,
    *,
    kl_weight: torch.Tensor | None = None,
    reward_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE-style surrogate (Table 2, Appendix F, Eq. 4.1): ``−SG(W)·log w`` per token, (B, T), 0 on inactive
    tokens (where ``log w = 0``); its gradient with respect to ``log π_θ`` is ``−W``.

    ``W = [w·A if the reward term is active] − β·K̃`` with ``K̃`` from [`kl_weights`] (``kl_clip_mode``'s weight
    outside the trust region when the clip is on). The gradient flows through the unclamped token log-ratio.
    `kl_weight` and `reward_weight`: ``K̃`` and the reward part when already computed ([`gradient_weight_parts`],
    with the same `reward_mask`).
    """
    if reward_weight is None:
        reward_weight, computed_kl_weight = gradient_weight_parts(ratios, advantages, regions, spec, reward_mask)
        kl_weight = computed_kl_weight if kl_weight is None else kl_weight
    elif kl_weight is None:
        kl_weight = kl_weights(ratios, spec, regions)
    with torch.no_grad():
        negative_weight = torch.add(reward_weight.neg(), kl_weight, alpha=spec.beta)  # −W = −w·A + β·K
    return negative_weight * ratios.token_log_ratio


def reward_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: LossSpecFields,
    reward_mask: torch.Tensor | None = None,
    *,
    reward_weight: torch.Tensor,
) -> torch.Tensor:
    """The reward term alone of `spec.estimator`'s per-token loss, (B, T), 0 on inactive tokens: the differentiable
    estimator's clipped ``−w·A`` (times `reward_mask`), or the REINFORCE estimator's ``−SG(w·A)·log w`` with the
    reward part of [`gradient_weight_parts`] (`reward_weight`). With ``kl_estimate="vocabulary"`` the KL term is added
    to it from each position's exact KL ([`rpg_trl.losses.vocabulary.vocabulary_kl_term`])."""
    if spec.estimator == "reinforce":
        return -reward_weight * ratios.token_log_ratio
    reward_loss = _reward_term_differentiable(ratios, advantages, regions, spec)
    if reward_mask is not None:
        reward_loss = reward_loss * reward_mask
    return torch.where(ratios.active, reward_loss, torch.zeros((), dtype=reward_loss.dtype, device=reward_loss.device))


#: The gradient estimators (Proposition 4.1: the same gradient), one signature:
#: ``(ratios, advantages, regions, spec, reward_mask, *, kl_weight=None, reward_weight=None) -> per-token loss`` (B, T),
#: 0 on inactive tokens; `reward_mask` multiplies the reward term only, `kl_weight` and `reward_weight` are ``K̃`` and
#: the reward part of the gradient weight when already computed ([`gradient_weight_parts`]).
ESTIMATOR_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "reinforce": reinforce_per_token_loss,
    "differentiable": differentiable_per_token_loss,
}


ESTIMATORS = tuple(ESTIMATOR_FUNCTIONS)


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


#: The per-token means of [`summarize_stats`] (fractions of the active tokens), in the order the trainers log them.
TOKEN_MEAN_METRICS = (
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/dual_mean",
    "clip_ratio/region_mean",
    "importance_weight/mean",
)


#: The rows of [`sequence_sums`] before its `extra` ones: the per-token stats of [`rpg_per_token_loss`] behind
#: [`TOKEN_MEAN_METRICS`], in that order; after the `extra` rows come the two parts of the gradient weight in absolute
#: value (``reward_gradient_weight``, ``kl_gradient_weight``) and the active tokens' count.
SEQUENCE_SUM_ROWS = ("kl", "is_low_clipped", "is_high_clipped", "is_dual_clipped", "is_clipped", "importance_weight")


def sequence_sums(
    stats: dict[str, torch.Tensor], mask: torch.Tensor, extra: tuple[torch.Tensor, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion, the sums over its active tokens (weighted by `mask`) of the stats of [`SEQUENCE_SUM_ROWS`], of
    each (B, T) tensor of `extra`, of ``|reward_gradient_weight|`` and ``|kl_gradient_weight|``, and of the mask (the
    count): a (len(SEQUENCE_SUM_ROWS) + len(extra) + 3, B) tensor; and the importance weight's largest and smallest
    over the active tokens, (2,), 0 and inf when no token is active (the count tells). Detached, on the device, one
    small tensor for one reduction across processes: a micro-batch's metrics in a few kernels, not one or more per
    metric (on a GPU they are launch-bound). Every tensor is (B, T), `mask` the 0/1 mask the stats were computed with.

    The rows are not all copied into one (rows, B, T) stack: the stats that are 0 on inactive tokens (the KL estimate
    ``S``, which every row of the KL table makes 0 at ``w = r = 1``, the clip regions and the reward part of the
    weight) are summed as they are, the regions as counts of one stack of bools, and ``is_clipped`` is the sum of the
    three regions' counts, which are disjoint (``A < 0`` with ``w < 1 − ε_low`` or ``w > c > 1``, or ``A > 0``); only
    the importance weight (1 there), `extra` and the KL weight are masked, each on its own. The float copy of every row and
    its masked copy were most of the loss's time on a CPU at B×T = 64×4096 (the project's loss-only benchmark)."""
    with torch.no_grad():
        w = stats["importance_weight"]
        dtype = w.dtype
        mask = mask.to(dtype)
        # The regions as counts (a stack of bools: one byte a token), their union as the sum of the three counts.
        regions = torch.stack([stats[key] for key in ("is_low_clipped", "is_high_clipped", "is_dual_clipped")])
        counts = regions.sum(-1).to(dtype)
        weighted = w * mask
        # `kl`; `is_low_clipped`, `is_high_clipped`, `is_dual_clipped`; `is_clipped`; `importance_weight`; `extra`;
        # the two parts of the weight in absolute value; the count.
        rows = [stats["kl"].sum(-1)[None], counts, counts.sum(0, keepdim=True), weighted.sum(-1)[None]]
        rows += [(x.detach() * mask).sum(-1)[None] for x in extra]
        rows += [stats["reward_gradient_weight"].abs().sum(-1)[None]]
        rows += [(stats["kl_gradient_weight"].abs() * mask).sum(-1)[None], mask.sum(-1)[None]]
        rows = torch.cat(rows)
        # Extremes without boolean indexing (which copies and synchronises); the largest: w > 0 on active tokens and
        # w·mask = 0 elsewhere.
        largest = weighted.amax()
        smallest = torch.where(mask > 0, w, math.inf).amin()
        return rows, torch.stack([largest, smallest])


def summarize_stats(
    stats: dict[str, torch.Tensor], mask: torch.Tensor, diagnostics: bool = True
) -> dict[str, torch.Tensor]:
    """Reduce the per-token stats of [`rpg_per_token_loss`] to the detached scalar metrics of [`rpg_loss`]; `mask` is
    the mask they were computed with (the per-token stats are 0 outside it, so only the weight needs it).
    `diagnostics=False` leaves out [`DIAGNOSTIC_METRICS`]."""
    with torch.no_grad():
        sums, extremes = sequence_sums(stats, mask)
        totals = sums.sum(-1)
        num_tokens = totals[-1]
        extremes = torch.where(num_tokens > 0, extremes, math.nan)
        metrics = dict(
            zip(TOKEN_MEAN_METRICS, (totals[: len(TOKEN_MEAN_METRICS)] / num_tokens.clamp(min=1.0)).unbind())
        )
        metrics["importance_weight/max"], metrics["importance_weight/min"] = extremes.unbind()
        metrics["num_tokens"] = num_tokens
        # Mean over the completions that have tokens of the whole-completion divergence estimate.
        has_sequence = sums[-1] > 0
        num_sequences = has_sequence.sum().to(num_tokens.dtype)
        metrics["kl/sequence"] = (stats["sequence_kl"] * has_sequence).sum() / num_sequences.clamp(min=1.0)
        metrics["num_sequences"] = num_sequences
        if diagnostics:
            parts = diagnostic_parts_from_sums(stats["log_prefix_weight"], has_sequence, totals[-3:])
            metrics.update(diagnostic_metrics(parts))
        return metrics


#: The diagnostics of the whole-completion importance weights and of the KL term's share of the gradient, logged
#: with [`rpg_loss`]'s other metrics at both KL levels (issue 63): with ``W = W≤T = π_θ(y)/π_old(y)`` (the product of
#: a completion's token ratios, ``log W = Σ_t (log π_θ − log π_old)`` over its active tokens, unclamped) over the ``n``
#: completions that have an active token,
#:
#: * ``kl/log_prefix_weight/max``, ``kl/log_prefix_weight/min``: the largest and the smallest ``log W``;
#: * ``kl/log_prefix_weight/std``: the standard deviation of ``log W`` over the completions (population, ``ddof=0``);
#: * ``kl/prefix_ess``: the effective sample size of the ``W`` as a fraction, ``(Σ W)² / (n·Σ W²)`` in ``[1/n, 1]``
#:   (1 when every ``W`` is equal, e.g. on-policy), computed in log space, finite at any length;
#: * ``kl/weight_share``: the KL term's share of the gradient weight, ``Σ_t |β·K̃_t| / (Σ_t |w·A|_t + Σ_t |β·K̃_t|)``
#:   over the active tokens, with the per-token weight ``W_t = [w·A if the reward term is active] − β·K̃_t``
#:   ([`gradient_weight_parts`]; the reward part is 0 where RPG-Style Clip or a reward mask removes it); the same
#:   for both estimators, and with GRPO's uncorrected k3 its weight ``1 − π_ref/π_θ``.
#:
#: NaN when no completion (no token, for the share) is active; the share is 0 when no token has any gradient weight.
DIAGNOSTIC_METRICS = (
    "kl/log_prefix_weight/max",
    "kl/log_prefix_weight/min",
    "kl/log_prefix_weight/std",
    "kl/prefix_ess",
    "kl/weight_share",
)


#: The parts the diagnostics are computed from ([`diagnostic_parts`]), in order, and how each combines over
#: micro-batches and processes ([`combine_diagnostic_parts`]): so that the diagnostics of a batch split in parts
#: equal those of the whole batch. ``count``/``mean``/``m2``: the completions' count, the mean of their ``log W`` and
#: the sum of its squared deviations from that mean (combined exactly, Chan et al.'s parallel variance); ``max``,
#: ``min``: extremes; ``logsumexp``: ``log Σ W`` and ``log Σ W²``; ``sum``: sums.
DIAGNOSTIC_PARTS = (
    ("log_prefix_weight/count", "count"),
    ("log_prefix_weight/mean", "mean"),
    ("log_prefix_weight/m2", "m2"),
    ("log_prefix_weight/max", "max"),
    ("log_prefix_weight/min", "min"),
    ("prefix_weight/log_sum", "logsumexp"),
    ("prefix_weight/log_sum_sq", "logsumexp"),
    ("kl_weight/abs_sum", "sum"),
    ("reward_weight/abs_sum", "sum"),
    ("num_tokens", "sum"),
)


def diagnostic_parts(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The parts of [`DIAGNOSTIC_METRICS`] of one batch, a (len(DIAGNOSTIC_PARTS),) tensor in the order of
    [`DIAGNOSTIC_PARTS`], from the stats of [`rpg_per_token_loss`] (``log_prefix_weight``, ``reward_gradient_weight``
    and ``kl_gradient_weight``) and the mask they were computed with. Detached, computed on the device (no
    synchronisation)."""
    with torch.no_grad():
        dtype = stats["log_prefix_weight"].dtype
        mask = mask.to(dtype)
        totals = torch.stack(
            [(stats["reward_gradient_weight"].abs() * mask).sum(), (stats["kl_gradient_weight"].abs() * mask).sum()]
        )
        return diagnostic_parts_from_sums(
            stats["log_prefix_weight"], mask.sum(-1) > 0, torch.cat([totals, mask.sum()[None]])
        )


def diagnostic_parts_from_sums(
    log_W: torch.Tensor, has_sequence: torch.Tensor, weight_sums: torch.Tensor
) -> torch.Tensor:
    """[`diagnostic_parts`] from the completions' ``log W`` (B,), which of them have an active token (B,), and the
    sums ``(Σ|w·A|, Σ|β·K̃|, number of active tokens)`` (3,)."""
    dtype = log_W.dtype
    count = has_sequence.sum().to(dtype)
    mean = torch.where(has_sequence, log_W, 0.0).sum() / count.clamp(min=1.0)
    m2 = torch.where(has_sequence, (log_W - mean).square(), 0.0).sum()
    kept = torch.where(has_sequence, log_W, -math.inf)
    smallest = torch.where(has_sequence, log_W, math.inf).amin()
    log_sums = torch.stack([kept, 2.0 * kept]).logsumexp(-1)  # log Σ W and log Σ W²
    reward_abs, kl_abs, num_tokens = weight_sums.to(dtype).unbind()
    return torch.stack([count, mean, m2, kept.amax(), smallest, *log_sums.unbind(), kl_abs, reward_abs, num_tokens])


def combine_diagnostic_parts(parts: torch.Tensor) -> torch.Tensor:
    """The parts of the union of batches from theirs, (N, len(DIAGNOSTIC_PARTS)) -> (len(DIAGNOSTIC_PARTS),) (rows of
    [`diagnostic_parts`], e.g. of the micro-batches of an optimizer step or gathered from the processes): exact, so
    that [`diagnostic_metrics`] of the result equals that of the concatenated batch up to rounding."""
    with torch.no_grad():
        count, mean, m2 = parts[:, 0], parts[:, 1], parts[:, 2]
        total = count.sum()
        global_mean = (count * mean).sum() / total.clamp(min=1.0)
        global_m2 = m2.sum() + (count * (mean - global_mean).square()).sum()
        return torch.stack(
            [
                total,
                global_mean,
                global_m2,
                parts[:, 3].amax(),
                parts[:, 4].amin(),
                parts[:, 5].logsumexp(0),
                parts[:, 6].logsumexp(0),
                *parts[:, 7:].sum(0).unbind(),
            ]
        )


def diagnostic_metrics(parts: torch.Tensor) -> dict[str, torch.Tensor]:
    """[`DIAGNOSTIC_METRICS`] from the parts of a batch ([`diagnostic_parts`], or [`combine_diagnostic_parts`] over
    several), 0-d tensors."""
    with torch.no_grad():
        count, _, m2, largest, smallest, log_sum, log_sum_sq, kl_abs, reward_abs, num_tokens = parts.unbind()
        safe_count = count.clamp(min=1.0)
        std = (m2 / safe_count).clamp(min=0.0).sqrt()
        ess = torch.exp(2.0 * log_sum - log_sum_sq - torch.log(safe_count))  # NaN without a completion: replaced
        total = kl_abs + reward_abs
        weighted = total > 0
        share = torch.where(weighted, kl_abs / torch.where(weighted, total, 1.0), 0.0)
        per_sequence = torch.where(count > 0, torch.stack([largest, smallest, std, ess]), math.nan)
        values = (*per_sequence.unbind(), torch.where(num_tokens > 0, share, math.nan))
        return dict(zip(DIAGNOSTIC_METRICS, values, strict=True))


def diagnostic_metrics_of(
    log_weights: list[float], reward_abs: float, kl_abs: float, num_tokens: float
) -> dict[str, float]:
    """[`DIAGNOSTIC_METRICS`] on the host, in float64, from the ``log W`` of every completion that has an active
    token and the sums ``Σ|w·A|``, ``Σ|β·K̃|`` and the active tokens' count (what [`diagnostic_metrics`] gives from
    [`diagnostic_parts`] on the device; the trainers gather the completions' ``log W`` over the processes and the
    micro-batches of an optimizer step, so that the diagnostics are those of the whole step)."""
    nan = math.nan
    count = len(log_weights)
    total = kl_abs + reward_abs
    share = (kl_abs / total if total > 0 else 0.0) if num_tokens > 0 else nan
    if count == 0 or not all(math.isfinite(x) for x in log_weights):  # none, or a NaN/inf log-prob upstream
        return dict(zip(DIAGNOSTIC_METRICS, (nan, nan, nan, nan, share), strict=True))
    mean = math.fsum(log_weights) / count
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in log_weights) / count)
    largest = max(log_weights)
    # log Σ W and log Σ W² from the largest, then the ESS (Σ W)² / (n·Σ W²) in log space: finite at any length.
    log_sum = largest + math.log(math.fsum(math.exp(x - largest) for x in log_weights))
    log_sum_sq = 2 * largest + math.log(math.fsum(math.exp(2 * (x - largest)) for x in log_weights))
    ess = math.exp(2 * log_sum - log_sum_sq - math.log(count))
    return dict(zip(DIAGNOSTIC_METRICS, (largest, min(log_weights), std, ess, share), strict=True))


def nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (or smallest) non-NaN entry of `values`, NaN when all are NaN: TRL's `nanmax`/`nanmin` computed on
    the device (theirs index by a boolean mask and test a device value, and each waits for the device)."""
    is_nan = values.isnan()
    kept = torch.where(is_nan, -math.inf if largest else math.inf, values)  # Python scalars: no tensor to fill
    extreme = kept.amax() if largest else kept.amin()
    return torch.where(is_nan.all(), math.nan, extreme)
