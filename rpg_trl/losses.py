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
while ``w ≤ 1 + ε_high``, and for ``A < 0`` while ``1 − ε_low ≤ w ≤ c``. Per token, inside the trust region
``[1 − ε_low, 1 + ε_high]`` the KL weight is the exact ``K``; outside it, it is the weight ``K̃`` of the chosen entry of
[`KL_CLIP_MODES`] (``kl_clip_mode``; the paper's text, pseudo-code and code disagree here, docs/design.md):
``"exact"`` ``K(w, r)`` (the authors' code, TRL, slime), ``"truncated"`` ``min(1, c/w)·K(w, r)`` (the exact sign,
bounded in w; fkl's ``K = −r`` as is), ``"clipped"`` ``K(w̄, r)`` at ``w̄ = clip(w, 1 − ε_low, 1 + ε_high)`` and ``log w̄`` (Algorithm 1
literally, Remark F.2; with a reference that is not the sampling policy it can push π_θ away from π_ref, and warns),
``"stopped"`` 0 where the reward term is clipped (Algorithm 2). With the clip on, the per-token gradient weight of BOTH
estimators is

    ``W = [w·A if the reward term is active else 0] − β·K̃``,

so the two estimators give the same gradient for every token, clipped or not. The differentiable estimator's loss value
keeps the importance-weighted estimate ``β·S(w)``; its gradient is ``β·K̃`` (a straight-through form). ``clip=False``
keeps the exact ``W`` everywhere. Log-ratios are clamped at ±[`LOG_RATIO_CLAMP`] in value only
([`clamp_log_ratio`]), so the clamp never takes the gradient off a token. The design is written out in
``docs/design.md``.

Everything that defines the loss is one frozen [`RPGLossSpec`] (the trainers build it once from their configuration),
and ``kl_level="sequence"`` replaces the per-token KL weights of the table by the exact weights of the divergence between
whole completions, with prefix ratios (``KLTerm.sequence_value`` / ``sequence_weight``; ``docs/design.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch


#: Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` (``e^20 ≈ 4.9e8``), so any finite
#: input gives a finite loss and finite gradients. At ``kl_level="sequence"`` the KL *weights* are computed from the
#: unclamped prefix log-ratios in log space ([`sequence_kl_weight`]); only the loss *value* there reads clamped prefixes.
LOG_RATIO_CLAMP = 20.0
#: The largest magnitude of a sequence-level KL weight, ``e^40 ≈ 2.4e17``: an exact weight beyond it (a prefix ratio
#: past ``e^40``, which no float32 product of the prefix could hold for long) is given this magnitude with its exact sign.
LOG_WEIGHT_CLAMP = 40.0


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` in value, with the gradient of the identity
    (straight-through): the clamp guards ``exp`` against overflow without taking the gradient off the tokens beyond it,
    so the differentiable estimator gives every token the gradient that the REINFORCE estimator gives it (the weight at
    the clamped ratio times ``∇log π_θ``)."""
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if not log_ratio.requires_grad:
        return clamped
    return log_ratio + (clamped - log_ratio).detach()


# ============================================================================================== the KL table
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
    #: ``E_old[W̄≤t·∇log π_θ] ≠ 0`` once ``W̄≤t ≠ W≤t`` (docs/design.md).
    sequence_score_term: bool = False
    #: Which importance weights ``K`` grows with, i.e. what ``kl_clip_mode="truncated"`` bounds: ``"none"`` (``K``
    #: does not grow with w: fkl's ``−r``, left exact), ``"own"`` (the token's ``w``, and at the sequence level its own
    #: prefix ``W≤t``: ufkl) or ``"to_go"`` (the token's ``w``, and at the sequence level every prefix ``W≤t'``,
    #: ``t' ≥ t``, of its KL-to-go: rkl, urkl).
    grows_with: str = "own"

    def sequence_weight(self, W: torch.Tensor, R: torch.Tensor, log_rho: torch.Tensor) -> torch.Tensor:
        """``K_t`` from its parts at the given (detached, (B, T)) ``W≤t``, ``R≤t`` and token ``log ρ_t``, in linear
        space: for prefix ratios known to be moderate (the clipped ones of ``kl_clip_mode="clipped"``) and for tests;
        [`sequence_kl_weight`] is the log-space form for ratios of any size."""
        weight = torch.zeros_like(W)
        if "to_go" in self.sequence_parts:
            weight = weight + _reverse_cumsum(W * log_rho)
        if "W" in self.sequence_parts:
            weight = weight + W
        if "-R" in self.sequence_parts:
            weight = weight - R
        return weight


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
#: ``token-mean``: Σ/number of tokens; ``seq-mean-token-mean``: mean over sequences of each one's token mean;
#: ``seq-mean-token-sum``: mean over sequences of each one's token sum; ``seq-mean-token-sum-norm``: Σ/(B·max_length)
#: (Dr. GRPO, TRL's ``dr_grpo``).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: Where the KL's importance weights are taken: per token (the paper's code and every peer) or over the whole
#: completion up to each token (the exact gradient of the divergence between whole completions; docs/design.md).
KL_LEVELS = ("token", "sequence")
#: The default of `kl_clip_mode` (a key of [`KL_CLIP_MODES`]), chosen on the KL table of docs/bench_algos.md.
DEFAULT_KL_CLIP_MODE = "truncated"


class KLSignWarning(UserWarning):
    """A KL weighting that can push π_θ away from the reference is in use (``kl_clip_mode="clipped"`` with a reference
    that is not the sampling policy)."""


# ============================================================================================== the specification
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


@dataclass(frozen=True)
class RPGLossSpec:
    """Everything that defines the RPG loss (paper Sec. 3-5), checked once at construction.

    Built once from the configuration ([`RPGConfig.rpg_loss_spec`](rpg_trl.config), the asynchronous config too) and
    passed to [`rpg_per_token_loss`] / [`rpg_loss`], which also build one from keyword arguments. Its field names are
    the paper's; [`RPGConfig`] spells `clip` as `rpg_clip` and `epsilon_low` as TRL's `epsilon`.
    """

    divergence: str = "urkl"  #: ``"fkl"``, ``"ufkl"``, ``"rkl"`` or ``"urkl"`` (module table)
    estimator: str = "reinforce"  #: a key of [`ESTIMATOR_FUNCTIONS`]: ``"reinforce"`` or ``"differentiable"``
    beta: float = 1e-4  #: KL coefficient β >= 0 (Appendix H)
    clip: bool = True  #: RPG-Style Clip (Sec. 3.3, Algorithms 1-2)
    epsilon_low: float = 0.2  #: ε_1, lower clip ``1 − ε_low``, in [0, 1)
    epsilon_high: float = 0.28  #: ε_2, upper clip ``1 + ε_high``
    clip_c: float = 10.0  #: dual-clip bound c > 1 for negative advantages
    aggregation: str = "token-mean"  #: how [`rpg_loss`] reduces the per-token loss ([`aggregate_loss`])
    importance_sampling_level: str = "token"  #: the reward term's ratio: per token, or GSPO's geometric mean
    #: False: GRPO's uncorrected k3 (the ``k3`` row of the KL table, Sec. 2.2), only with divergence ``"urkl"``
    kl_importance_weight: bool = True
    kl_level: str = "token"  #: the KL's importance weights per token or over whole completions ([`KL_LEVELS`])
    #: how the clip treats the KL weight outside the trust region: a key of [`KL_CLIP_MODES`]
    kl_clip_mode: str = DEFAULT_KL_CLIP_MODE

    def __post_init__(self):
        self.check()

    @property
    def kl_term(self) -> KLTerm:
        """The row of [`KL_TERMS`] this specification uses."""
        return KL_TERMS[self.divergence if self.kl_importance_weight else "k3"]

    @property
    def paper_name(self) -> str:
        """The paper's name of the algorithm, e.g. ``"RPG-REINFORCE-URKL"`` (Tables 1-4)."""
        return paper_name(self.divergence, self.estimator)

    def replace(self, **changes) -> RPGLossSpec:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, names: dict[str, str] | None = None, **fields) -> RPGLossSpec:
        """Build a specification from keyword arguments, reporting an invalid one with the caller's names for the
        fields (`names` maps a field to the caller's name, e.g. ``{"clip": "rpg_clip"}``)."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(
                f"Unknown RPG loss argument(s) {unknown}; the loss is specified by "
                f"{[f.name for f in dataclasses.fields(cls)]}."
            )
        # Checked before the frozen object exists, so that an error names the caller's field.
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        cls.check(SimpleNamespace(**{**defaults, **fields}), names)
        return cls(**fields)

    def check(self, names: dict[str, str] | None = None) -> None:
        """Raise a `ValueError` naming the field (in the caller's `names`), the allowed values and the fix."""
        names = names or {}

        def n(name: str) -> str:
            return names.get(name, name)

        _check_choice(n("divergence"), self.divergence, DIVERGENCES)
        _check_choice(n("estimator"), self.estimator, ESTIMATORS)
        _check_choice(n("aggregation"), self.aggregation, AGGREGATIONS)
        _check_choice(n("importance_sampling_level"), self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        _check_choice(n("kl_level"), self.kl_level, KL_LEVELS)
        _check_choice(n("kl_clip_mode"), self.kl_clip_mode, tuple(KL_CLIP_MODES))
        _check_finite_number(n("beta"), self.beta, minimum=0.0)
        if not isinstance(self.clip, bool):
            raise ValueError(f"`{n('clip')}` must be a bool; got {self.clip!r}.")
        _check_finite_number(n("epsilon_low"), self.epsilon_low, minimum=0.0)
        if self.epsilon_low >= 1.0:
            raise ValueError(
                f"`{n('epsilon_low')}` must be in [0, 1) so that the lower clip bound 1 - {n('epsilon_low')} stays "
                f"positive; got {self.epsilon_low!r}."
            )
        _check_finite_number(n("epsilon_high"), self.epsilon_high, minimum=0.0)
        _check_finite_number(n("clip_c"), self.clip_c, minimum=1.0, strict=True)
        if self.clip_c < 1.0 + self.epsilon_high:
            raise ValueError(
                f"`{n('clip_c')}` (the dual-clip bound for negative advantages) must be >= 1 + {n('epsilon_high')} = "
                f"{1.0 + self.epsilon_high}; got {self.clip_c!r}."
            )
        if not isinstance(self.kl_importance_weight, bool):
            raise ValueError(f"`{n('kl_importance_weight')}` must be a bool; got {self.kl_importance_weight!r}.")
        if not self.kl_importance_weight and self.divergence != "urkl":
            raise ValueError(
                f"`{n('kl_importance_weight')}=False` is the uncorrected GRPO k3 penalty, an estimator of the reverse "
                f"KL: it is only defined with {n('divergence')}='urkl'; got {n('divergence')}={self.divergence!r}."
            )
        if self.kl_level == "sequence" and not self.kl_importance_weight:
            raise ValueError(
                f"`{n('kl_importance_weight')}=False` (GRPO's uncorrected k3) is a per-token penalty without importance "
                f"weights, so it has no sequence-level form: use {n('kl_level')}='token' with it, or "
                f"{n('kl_importance_weight')}=True for the exact sequence-level KL."
            )


def validate_rpg_hyperparameters(*, names: dict[str, str] | None = None, **fields) -> None:
    """Raise a `ValueError` naming the argument and the allowed values for any invalid RPG loss field (the fields of
    [`RPGLossSpec`]; `names` maps them to the caller's names, e.g. `{"clip": "rpg_clip", "epsilon_low": "epsilon"}`)."""
    RPGLossSpec.from_kwargs(names=names, **fields)


# ============================================================================================== ratios and clip
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
        exact_log_r = torch.broadcast_to(self.token_log_r if self.exact_log_r is None else self.exact_log_r, log_W.shape)
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
    that each token's KL gradient follows its own ``log ρ`` (docs/trl_options.md). Proposition 4.1 holds for
    token-level weights only.
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    token_log_ratio = torch.where(active, logps.to(dtype) - old_logps.to(dtype).detach(), zero)
    if ref_logps is None:
        token_log_r = exact_log_r = zero  # π_ref = π_old: r = 1 everywhere (a scalar that broadcasts)
    else:
        exact_log_r = torch.where(active, ref_logps.to(dtype).detach() - old_logps.to(dtype).detach(), zero)
        token_log_r = exact_log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_r = torch.exp(token_log_r)
    if importance_sampling_level == "sequence":
        mask = active.to(dtype)
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_w = torch.where(active, (token_log_ratio * mask).sum(-1, keepdim=True) / lengths, zero)
        log_w = clamp_log_ratio(log_w)
        log_r, r = token_log_r, token_r
        if ref_logps is not None:
            log_r = torch.where(active, (token_log_r * mask).sum(-1, keepdim=True) / lengths, zero)
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


def _clip_log(log_x: torch.Tensor, spec: RPGLossSpec) -> torch.Tensor:
    """``log clip(x, 1 − ε_low, 1 + ε_high)``, detached (Remark F.2)."""
    return log_x.detach().clamp(math.log(1.0 - spec.epsilon_low), math.log(1.0 + spec.epsilon_high))


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


# ============================================================================================== the KL term
def kl_values(ratios: RatioTensors, spec: RPGLossSpec) -> torch.Tensor:
    """The divergence estimate per token, ``S`` (B, T), differentiable: the importance-weighted per-token estimate
    (``kl_level="token"``, at the token ratios whatever the importance-sampling level), or the terms whose sum over a
    completion estimates the divergence between whole completions (``kl_level="sequence"``). GRPO's uncorrected k3 is evaluated at the token ratios."""
    term = spec.kl_term
    if not term.importance_weighted:
        return term.value(None, None, ratios.kl_log_w, ratios.token_log_r)
    if spec.kl_level == "sequence":
        return term.sequence_value(ratios.prefixes, ratios.kl_log_w, ratios.token_log_r)
    return term.value(ratios.kl_w, ratios.token_r, ratios.kl_log_w, ratios.token_log_r)


def _exact_token_weight(term: KLTerm, ratios: RatioTensors, spec: RPGLossSpec, regions: ClipRegions) -> torch.Tensor:
    """``K(w, r)`` at the unclipped (clamped) token ratios (never the sequence's GSPO-style ratio: the KL keeps its own
    importance weights whatever ``importance_sampling_level`` is)."""
    return term.weight(ratios.token_w, ratios.token_r, ratios.token_log_w, ratios.token_log_r)


def _truncation(w: torch.Tensor, spec: RPGLossSpec) -> torch.Tensor:
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


def sequence_log_parts(term: KLTerm, prefixes: Prefixes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log P_t, log N_t)`` with ``K_t = P_t − N_t`` and ``P, N ≥ 0``: the positive and the negative parts of the
    exact sequence-level weight of `term` (the KL-to-go split by the sign of ``log ρ_t'`` and summed with a reverse
    ``logcumsumexp``, the score term ``W≤t`` on the positive side, ``R≤t`` on the negative side), from the unclamped
    prefix log-ratios, (B, T) each, detached."""
    log_W, log_R, log_rho = prefixes.exact_log_W, prefixes.exact_log_R, prefixes.exact_log_rho
    nothing = torch.full_like(log_W, -math.inf)
    log_P = log_N = nothing
    if "to_go" in term.sequence_parts:
        log_terms = log_W + torch.log(log_rho.abs())  # −inf where log ρ_t' = 0 (and on inactive tokens)
        log_P = _reverse_logcumsumexp(torch.where(log_rho > 0, log_terms, nothing))
        log_N = _reverse_logcumsumexp(torch.where(log_rho < 0, log_terms, nothing))
    if "W" in term.sequence_parts:
        log_P = torch.logaddexp(log_P, log_W)
    if "-R" in term.sequence_parts:
        log_N = torch.logaddexp(log_N, log_R)
    return log_P, log_N


def sequence_log_truncation(term: KLTerm, prefixes: Prefixes, spec: RPGLossSpec) -> torch.Tensor:
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


def sequence_kl_weight(term: KLTerm, prefixes: Prefixes, log_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The sequence-level KL weight ``K_t`` of `term` times ``e^{−log_scale}`` (B, T), detached, in log space: the
    positive and negative parts ([`sequence_log_parts`]) are divided by the scale before they are exponentiated, so the
    weight has the exact sign at any completion length, and its magnitude is exact up to rounding wherever it stays
    below ``e^LOG_WEIGHT_CLAMP`` (beyond, that magnitude with the exact sign). With ``log_scale = −log s_t``
    ([`sequence_log_truncation`]) it is the truncated weight ``s_t·K_t``, whose parts are then bounded: ``c·Σ_{t'≥t}
    |log ρ_t'|`` for the KL-to-go and ``c`` for the score term."""
    log_P, log_N = sequence_log_parts(term, prefixes)
    if log_scale is not None:
        log_P, log_N = log_P - log_scale, log_N - log_scale
    return _difference_of_exps(log_P, log_N)


def _exact_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K_t`` of the whole-completion divergence at the exact prefix ratios (docs/design.md, sequence table), in log
    space ([`sequence_kl_weight`])."""
    return sequence_kl_weight(term, ratios.prefixes)


def _truncated_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``s_t·K_t``: the exact KL-to-go of each token scaled as a whole by one factor ``s_t = min(1, c / M_t)`` in
    ``(0, 1]`` ([`sequence_log_truncation`]), so each token's KL weight keeps the exact sign, is bounded by ``c`` times
    the sum of its ``|log ρ|`` to go (urkl), and equals the exact weight wherever none of the prefix ratios it weighs
    exceeds ``c``. Computed in log space, so this holds at any completion length (the factor divides each part before
    it is exponentiated). (Truncating each prefix on its own, ``Σ_{t'≥t} min(W≤t', c)·log ρ_t'``, can flip the sign
    of the sum; docs/design.md.)"""
    prefixes = ratios.prefixes
    return sequence_kl_weight(term, prefixes, sequence_log_truncation(term, prefixes, spec))


def _clipped_sequence_weight(term, ratios, spec, regions) -> torch.Tensor:
    """``K_t`` with the prefixes ``W≤t`` and the ``w_t`` inside ``log ρ_t = log w_t − log r_t`` clipped to the trust
    region, without the score term ``W≤t`` of ufkl and rkl (zero in expectation only when exact). ``R≤t`` is exact,
    its magnitude capped at ``e^LOG_WEIGHT_CLAMP``."""
    prefixes = ratios.prefixes
    log_W, log_w = _clip_log(prefixes.exact_log_W, spec), _clip_log(ratios.token_log_w, spec)
    W = torch.exp(log_W)
    R = torch.exp(prefixes.exact_log_R.clamp(max=LOG_WEIGHT_CLAMP))
    log_r = prefixes.exact_log_W.new_zeros(()) if ratios.exact_log_r is None else ratios.exact_log_r
    weight = term.sequence_weight(W, R, log_w - log_r)
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

    The paper's text, pseudo-code and code disagree here (docs/design.md, "The KL term outside the trust region"). At
    the token level, inside the trust region every mode gives the exact weight ``K``. At the sequence level a token's
    ``K_t`` weighs prefix ratios ``W≤t'`` that can lie outside the trust region (and beyond ``c``) while its own ``w_t``
    is inside: ``"exact"`` is exact everywhere, ``"truncated"`` wherever no prefix ratio that ``K_t`` weighs exceeds
    ``c``, ``"stopped"`` wherever the reward term is not clipped, ``"clipped"`` only where every prefix ratio it weighs
    and ``w_t`` lie in the trust region. ``token_weight`` and ``sequence_weight`` take ``(term, ratios, spec,
    regions)`` and return the detached KL weight per token, (B, T), at ``kl_level="token"`` and ``"sequence"``.
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
        "the KL weight at w̄ = clip(w, 1 − ε_low, 1 + ε_high) and log w̄ on every token (rpg_trl 0.1.0); with a "
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


def kl_weights(ratios: RatioTensors, spec: RPGLossSpec, regions: ClipRegions) -> torch.Tensor:
    """The KL part ``K`` of the gradient weight ``W = w·A − β·K`` per token, (B, T), detached.

    Token level: ``K(w, r)`` of the module table. Sequence level: the exact weight of the whole-completion divergence,
    ``K_t`` of the sequence table in ``docs/design.md`` (``−R≤t``, ``W≤t − R≤t``, ``Σ_{t'≥t} W≤t'·log ρ_t' + W≤t``,
    ``Σ_{t'≥t} W≤t'·log ρ_t'``). With the clip on, outside the trust region, the weight is the one of
    ``spec.kl_clip_mode`` ([`KL_CLIP_MODES`]); `regions` are the reward term's clip regions (the ``"stopped"`` mode
    removes the KL gradient there). GRPO's uncorrected k3: ``1 − π_ref/π_θ``, unclipped.
    """
    term = spec.kl_term
    with torch.no_grad():
        if not term.importance_weighted:
            return term.weight(None, None, ratios.token_log_w, ratios.token_log_r)
        mode = KL_CLIP_MODES[spec.kl_clip_mode if spec.clip else "exact"]
        if spec.kl_level == "sequence":
            return mode.sequence_weight(term, ratios, spec, regions)
        return mode.token_weight(term, ratios, spec, regions)


def token_kl(ratios: RatioTensors, divergence: str | RPGLossSpec, kl_importance_weight: bool = True) -> torch.Tensor:
    """The per-token divergence estimate that is logged (``kl``) and drives the reference sync: ``S`` at the
    token-level ratios (whatever the importance-sampling and KL levels), or GRPO's k3 when uncorrected. Detached, and
    0 on inactive tokens (every row of the table is 0 at ``w = r = 1``). `divergence` is a divergence name or an
    [`RPGLossSpec`]."""
    if isinstance(divergence, RPGLossSpec):
        divergence, kl_importance_weight = divergence.divergence, divergence.kl_importance_weight
    name = divergence if kl_importance_weight else "k3"
    if name not in ratios.token_kl_values:
        with torch.no_grad():
            term = KL_TERMS[name]
            ratios.token_kl_values[name] = term.value(
                ratios.token_w, ratios.token_r, ratios.token_log_w, ratios.token_log_r
            )
    return ratios.token_kl_values[name]


def sequence_kl(ratios: RatioTensors, spec: RPGLossSpec) -> torch.Tensor:
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


# ============================================================================================== the estimators
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


def differentiable_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: RPGLossSpec,
    reward_mask: torch.Tensor | None = None,
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
    """
    reward_loss = _reward_term_differentiable(ratios, advantages, regions, spec)
    if reward_mask is not None:
        reward_loss = reward_loss * reward_mask
    if spec.kl_term.importance_weighted and spec.kl_level == "sequence":
        # The weights of whole completions, in log space at any length (autograd through `S` would read the clamped
        # prefixes): the value is `S`, the gradient the weight of `kl_weights`, clipped or not.
        with torch.no_grad():
            value = kl_values(ratios, spec)
        kl = _ValueWithGradient.apply(value, kl_weights(ratios, spec, regions), ratios.kl_log_w)
    elif spec.clip and spec.kl_term.importance_weighted:
        value = token_kl(ratios, spec)  # the logged estimate: the same token ratios
        kl = _ValueWithGradient.apply(value, kl_weights(ratios, spec, regions), ratios.kl_log_w)
    else:
        kl = kl_values(ratios, spec)
    zero = torch.zeros((), dtype=reward_loss.dtype, device=reward_loss.device)
    return torch.where(ratios.active, torch.add(reward_loss, kl, alpha=spec.beta), zero)


def reinforce_per_token_loss(
    ratios: RatioTensors,
    advantages: torch.Tensor,
    regions: ClipRegions,
    spec: RPGLossSpec,
    reward_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE-style surrogate (Table 2, Appendix F, Eq. 4.1): ``−SG(W)·log w`` per token, (B, T), 0 on inactive
    tokens (where ``log w = 0``); its gradient with respect to ``log π_θ`` is ``−W``.

    ``W = [w·A if the reward term is active] − β·K̃`` with ``K̃`` from [`kl_weights`] (``kl_clip_mode``'s weight
    outside the trust region when the clip is on). The gradient flows through the unclamped token log-ratio.
    """
    with torch.no_grad():
        negative_weight = ratios.w.detach() * -advantages  # −w·A
        if spec.clip:
            negative_weight.masked_fill_(regions.any, 0.0)
        if reward_mask is not None:
            negative_weight.mul_(reward_mask)
        negative_weight.add_(kl_weights(ratios, spec, regions), alpha=spec.beta)  # −W = −w·A + β·K
    return negative_weight * ratios.token_log_ratio


#: The gradient estimators (Proposition 4.1: the same gradient), one signature:
#: ``(ratios, advantages, regions, spec, reward_mask) -> per-token loss`` (B, T), 0 on inactive tokens;
#: `reward_mask` multiplies the reward term only.
ESTIMATOR_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "reinforce": reinforce_per_token_loss,
    "differentiable": differentiable_per_token_loss,
}
ESTIMATORS = tuple(ESTIMATOR_FUNCTIONS)


def paper_name(divergence: str, estimator: str) -> str:
    """The paper's name of a (divergence, estimator) pair: ``RPG-[REINFORCE-]<DIVERGENCE>`` (Tables 1-4)."""
    return f"RPG-{'REINFORCE-' if estimator == 'reinforce' else ''}{divergence.upper()}"


#: Paper names of each (divergence, estimator) pair, used in docs, model cards and benchmark tables.
PAPER_NAMES = {(d, e): paper_name(d, e) for e in ESTIMATORS for d in DIVERGENCES}


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
    (``w``, 1 on inactive tokens), and (B,) ``sequence_kl`` (the whole-completion estimate, [`sequence_kl`]).

    ``reward_mask`` ((B, T), optional) multiplies the reward term only: it is for credit-assignment filters such as
    TRL's top-entropy and off-policy masks, which choose the tokens whose reward signal counts, while the KL
    regulariser keeps acting on every token (as TRL adds ``β·KL`` after its masks).
    """
    spec = _resolve_spec(spec, spec_fields)
    if kl_can_flip_sign(spec, separate_reference=ref_logps is not None):
        warnings.warn(kl_sign_message(spec, ref_logps is not None), KLSignWarning, stacklevel=2)
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
    per_token_loss = ESTIMATOR_FUNCTIONS[spec.estimator](ratios, adv, regions, spec, reward_mask)
    stats = {
        "kl": token_kl(ratios, spec),
        "sequence_kl": sequence_kl(ratios, spec),
        "is_low_clipped": regions.low,
        "is_high_clipped": regions.high,
        "is_dual_clipped": regions.dual,
        "is_clipped": regions.any,
        "importance_weight": ratios.w.detach(),
    }
    return per_token_loss, stats


def kl_can_flip_sign(spec: RPGLossSpec, separate_reference: bool = True) -> bool:
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


def kl_sign_message(spec: RPGLossSpec, separate_reference: bool) -> str:
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
    estimators give ``W = [w·A if active] − β·K̃`` on every token. ``kl_level="sequence"`` replaces the
    KL part by the exact gradient of the divergence between whole completions (``docs/design.md``).

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
            value estimates the reverse KL but its expected gradient is that of the forward KL(π_ref‖π_θ),
            docs/bench_optimum.md) and ``kl_level`` (``"token"``: each token's KL term weighted by its own ratio, the
            paper's code and every peer; ``"sequence"``: the exact gradient of the KL between whole completions,
            exact under ``aggregation="seq-mean-token-sum"``), ``kl_clip_mode`` (``DEFAULT_KL_CLIP_MODE``; how the
            clip weights the KL term outside the trust region: ``"exact"``, ``"truncated"``, ``"clipped"`` or
            ``"stopped"``, [`KL_CLIP_MODES`]).
        ref_logps (`torch.Tensor` of shape `(B, T)`, *optional*): ``log π_ref`` of the KL anchor. ``None`` anchors
            the KL to the sampling policy (``π_ref = π_old``, the paper's runs), which needs no reference model.
        num_items (`float` or `torch.Tensor`, *optional*): token-mean normaliser to use instead of ``mask.sum()``.
        max_length (`int`, *optional*): the length ``L`` of ``"seq-mean-token-sum-norm"`` (``Σ/(B·L)``); defaults to
            ``T``, the padded length of ``logps``.

    Returns:
        `tuple[torch.Tensor, dict[str, torch.Tensor]]`: the scalar loss and detached metrics: ``kl`` (mean per-token
        divergence estimate to the anchor), ``kl/sequence`` (mean over completions of the whole-completion estimate),
        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/dual_mean``, ``clip_ratio/region_mean``
        (fractions of active tokens), ``importance_weight/mean``, ``importance_weight/max``, ``importance_weight/min``,
        ``num_tokens`` and ``num_sequences`` (completions with at least one active token).

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
    return loss, summarize_stats(stats, fmask)


#: The per-token means of [`summarize_stats`] (fractions of the active tokens), in the order the trainers log them.
TOKEN_MEAN_METRICS = (
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/dual_mean",
    "clip_ratio/region_mean",
    "importance_weight/mean",
)


def summarize_stats(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reduce the per-token stats of [`rpg_per_token_loss`] to the detached scalar metrics of [`rpg_loss`]; `mask` is
    the mask they were computed with (the per-token stats are 0 outside it, so only the weight needs it)."""
    with torch.no_grad():
        w = stats["importance_weight"]
        mask = mask.to(w.dtype)
        num_tokens = mask.sum()
        weighted = w * mask
        per_token = (stats["kl"], stats["is_low_clipped"], stats["is_high_clipped"], stats["is_dual_clipped"])
        sums = [x.sum().to(w.dtype) for x in (*per_token, stats["is_clipped"])] + [weighted.sum()]
        metrics = dict(zip(TOKEN_MEAN_METRICS, (torch.stack(sums) / num_tokens.clamp(min=1.0)).unbind()))
        # Masked extremes without boolean indexing (which copies and synchronises); NaN when no token is active. The
        # largest: w > 0 on active tokens and w·mask = 0 elsewhere.
        w_min = torch.where(mask > 0, w, math.inf).amin()
        has_tokens = num_tokens > 0
        metrics["importance_weight/max"] = torch.where(has_tokens, weighted.amax(), math.nan)
        metrics["importance_weight/min"] = torch.where(has_tokens, w_min, math.nan)
        metrics["num_tokens"] = num_tokens
        # Mean over the completions that have tokens of the whole-completion divergence estimate.
        has_sequence = mask.sum(-1) > 0
        metrics["kl/sequence"] = (stats["sequence_kl"] * has_sequence).sum() / has_sequence.sum().clamp(min=1)
        metrics["num_sequences"] = has_sequence.sum().to(w.dtype)
        return metrics


def nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (or smallest) non-NaN entry of `values`, NaN when all are NaN: TRL's `nanmax`/`nanmin` computed on
    the device (theirs index by a boolean mask and test a device value, and each waits for the device)."""
    is_nan = values.isnan()
    kept = torch.where(is_nan, -math.inf if largest else math.inf, values)  # Python scalars: no tensor to fill
    extreme = kept.amax() if largest else kept.amin()
    return torch.where(is_nan.all(), math.nan, extreme)


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
