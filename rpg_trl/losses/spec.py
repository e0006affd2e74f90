# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""[`RPGLossSpec`]: everything that defines the RPG loss (paper Sec. 3-5), checked once at construction, and the
paper's names of its algorithms (Tables 1-4)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

from ._checks import (
    _check_choice,
    _check_finite_number,
)
from .baseline import DEFAULT_KL_TO_GO_BASELINE, KL_TO_GO_BASELINES
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
    KLSignWarning,
    KLTerm,
    kl_can_flip_sign,
    kl_sign_message,
)
from .ratios import (
    IMPORTANCE_SAMPLING_LEVELS,
)
from .surrogate import (
    AGGREGATIONS,
    ESTIMATORS,
)
from .vocabulary import DEFAULT_KL_ESTIMATE, KL_ESTIMATES, VOCABULARY_KL_CLIP_MODES


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
    #: how the KL-to-go of rkl and urkl is estimated at ``kl_level="sequence"``: a key of [`KL_TO_GO`]
    kl_to_go: str = DEFAULT_KL_TO_GO
    #: how each position's KL is estimated: from the sampled token, or exactly over the vocabulary ([`KL_ESTIMATES`])
    kl_estimate: str = DEFAULT_KL_ESTIMATE
    #: a baseline subtracted from each token's KL-to-go at ``kl_level="sequence"`` ([`KL_TO_GO_BASELINES`])
    kl_to_go_baseline: str = DEFAULT_KL_TO_GO_BASELINE

    def __post_init__(self):
        self.check()

    @property
    def kl_term(self) -> KLTerm:
        """The row of [`KL_TERMS`] this specification uses."""
        return KL_TERMS[self.divergence if self.kl_importance_weight else "k3"]

    @property
    def controlled_kl(self) -> ControlledKL:
        """The KL estimate that β weighs, as the loss's metrics name it: ``kl`` (token mean) with
        ``kl_level="token"``, ``kl/sequence`` (completion mean) with ``kl_level="sequence"`` ([`CONTROLLED_KL`])."""
        return CONTROLLED_KL[self.kl_level]

    @property
    def kl_needs_completion_order(self) -> bool:
        """Whether the KL's weights need each completion's tokens in order (the prefix ratios of
        ``kl_level="sequence"``), not just each token's own ratio."""
        return self.kl_level == "sequence"

    def kl_can_push_away(self, separate_reference: bool) -> bool:
        """Whether the KL weight can have the opposite sign of the exact one on some token, so that the KL term pushes
        π_θ away from its anchor there ([`kl_can_flip_sign`]); `separate_reference`: the anchor is a reference model,
        not the sampling policy."""
        return kl_can_flip_sign(self, separate_reference)

    def warn_if_kl_can_push_away(self, separate_reference: bool, stacklevel: int = 2) -> None:
        """Warn ([`KLSignWarning`]) when [`kl_can_push_away`](RPGLossSpec.kl_can_push_away) is True."""
        if self.kl_can_push_away(separate_reference):
            warnings.warn(kl_sign_message(self, separate_reference), KLSignWarning, stacklevel=stacklevel + 1)

    @property
    def on_policy_kl_gradient(self) -> str:
        """What the KL term's gradient is when π_θ = π_ref = π_old on every token (w = ρ = 1): the KL part of W (module
        table of `rpg_trl.losses`) is β·1 for fkl (a constant that the group-mean baseline does not remove), 0 for
        ufkl/urkl and −β for rkl; with ``kl_estimate="vocabulary"`` the exact gradient of a KL at its minimum, 0."""
        if self.kl_estimate == "vocabulary":
            return ON_POLICY_KL_GRADIENT["vocabulary"]
        return ON_POLICY_KL_GRADIENT[self.divergence]

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
        _check_choice(n("kl_to_go"), self.kl_to_go, KL_TO_GO)
        _check_choice(n("kl_estimate"), self.kl_estimate, KL_ESTIMATES)
        _check_choice(n("kl_to_go_baseline"), self.kl_to_go_baseline, KL_TO_GO_BASELINES)
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
        if self.kl_estimate == "vocabulary":
            _check_vocabulary_estimate(self, n)
        if self.kl_to_go_baseline != DEFAULT_KL_TO_GO_BASELINE:
            _check_kl_to_go_baseline(self, n)
        if self.kl_to_go != DEFAULT_KL_TO_GO:
            if not _has_kl_to_go(self):
                raise ValueError(
                    f"`{n('kl_to_go')}={self.kl_to_go!r}` estimates the KL-to-go of each token (the KL of the tokens "
                    f"after it), which only the reverse divergences have over whole completions: it needs "
                    f"{n('kl_level')}='sequence' and {n('divergence')} in ['rkl', 'urkl']; got "
                    f"{n('kl_level')}={self.kl_level!r}, {n('divergence')}={self.divergence!r}. Leave "
                    f"{n('kl_to_go')}={DEFAULT_KL_TO_GO!r} otherwise."
                )


def _has_kl_to_go(fields) -> bool:
    """Whether each token's KL weight holds a KL-to-go (the KL of the tokens after it): the sequence level of the
    reverse divergences, what `kl_to_go` and `kl_to_go_baseline` act on."""
    return fields.kl_level == "sequence" and "to_go" in KL_TERMS[fields.divergence].sequence_parts


def _check_vocabulary_estimate(fields, n) -> None:
    """The options that ``kl_estimate="vocabulary"`` cannot honour, each refused with what to use instead (`fields`: the
    specification's fields, `n`: the caller's name of a field)."""
    if not fields.kl_importance_weight:
        raise ValueError(
            f"`{n('kl_importance_weight')}=False` is GRPO's uncorrected k3, a penalty on the sampled token; "
            f"{n('kl_estimate')}='vocabulary' computes each position's KL exactly, so there is no sampled token to "
            f"weight. Use {n('kl_estimate')}='sample' with it, or {n('kl_importance_weight')}=True."
        )
    if fields.clip and fields.kl_clip_mode not in VOCABULARY_KL_CLIP_MODES:
        raise ValueError(
            f"`{n('kl_clip_mode')}={fields.kl_clip_mode!r}` evaluates the sampled token's KL weight at its clipped "
            f"importance weight; with {n('kl_estimate')}='vocabulary' no position's KL holds an importance weight. "
            f"Use one of {list(VOCABULARY_KL_CLIP_MODES)} (help(rpg_trl.losses.vocabulary))."
        )
    if fields.kl_to_go != DEFAULT_KL_TO_GO:
        raise ValueError(
            f"`{n('kl_to_go')}={fields.kl_to_go!r}` replaces the later tokens' sampled log-ratios in each KL-to-go; "
            f"with {n('kl_estimate')}='vocabulary' the KL-to-go is built from the exact per-position KLs. Leave "
            f"{n('kl_to_go')}={DEFAULT_KL_TO_GO!r}."
        )


def _check_kl_to_go_baseline(fields, n) -> None:
    """A baseline of the KL-to-go needs a KL-to-go (the sequence level, rkl or urkl) and the exact weights."""
    if not _has_kl_to_go(fields):
        raise ValueError(
            f"`{n('kl_to_go_baseline')}={fields.kl_to_go_baseline!r}` subtracts a baseline from each token's KL-to-go "
            f"(the KL of the tokens after it), which only the reverse divergences have over whole completions: it needs "
            f"{n('kl_level')}='sequence' and {n('divergence')} in ['rkl', 'urkl']; got {n('kl_level')}="
            f"{fields.kl_level!r}, {n('divergence')}={fields.divergence!r}."
        )
    if fields.clip and fields.kl_clip_mode != "exact":
        raise ValueError(
            f"`{n('kl_to_go_baseline')}={fields.kl_to_go_baseline!r}` needs the exact KL weights, W≤t times the KL-to-go "
            f"relative to the prefix; `{n('kl_clip_mode')}={fields.kl_clip_mode!r}` changes them outside the trust "
            f"region. Use {n('kl_clip_mode')}='exact' (or {n('clip')}=False) with it."
        )


#: The KL term's gradient on-policy (π_θ = π_ref = π_old), per divergence ([`RPGLossSpec.on_policy_kl_gradient`]).
ON_POLICY_KL_GRADIENT = {
    "fkl": "zero in expectation (β times the score ∇log π_θ, whose mean under π_θ is 0)",
    "ufkl": "exactly zero",
    "rkl": "zero in expectation (−β times the score ∇log π_θ, whose mean under π_θ is 0)",
    "urkl": "exactly zero",
    "vocabulary": "exactly zero (the gradient of each position's exact KL at π_θ = π_ref)",
}


def validate_rpg_hyperparameters(*, names: dict[str, str] | None = None, **fields) -> None:
    """Raise a `ValueError` naming the argument and the allowed values for any invalid RPG loss field (the fields of
    [`RPGLossSpec`]; `names` maps them to the caller's names, e.g. `{"clip": "rpg_clip", "epsilon_low": "epsilon"}`)."""
    RPGLossSpec.from_kwargs(names=names, **fields)


def paper_name(divergence: str, estimator: str) -> str:
    """The paper's name of a (divergence, estimator) pair: ``RPG-[REINFORCE-]<DIVERGENCE>`` (Tables 1-4)."""
    return f"RPG-{'REINFORCE-' if estimator == 'reinforce' else ''}{divergence.upper()}"


#: Paper names of each (divergence, estimator) pair, used in docs, model cards and benchmark tables.
PAPER_NAMES = {(d, e): paper_name(d, e) for e in ESTIMATORS for d in DIVERGENCES}
