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
  (``surrogate.differentiable_per_token_loss``).
* ``"reinforce"`` (Table 2, Appendix F): minimise ``−SG(W)·log π_θ`` with a stop-gradient weight
  (``surrogate.reinforce_per_token_loss``).

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
(``ratios.clamp_log_ratio``), so the clamp never takes the gradient off a token. The design is written out in
docs: *Design of the RPG loss in rpg_trl*.

Everything that defines the loss is one frozen [`RPGLossSpec`] (the trainers build it once from their configuration),
and ``kl_level="sequence"`` replaces the per-token KL weights of the table by the exact weights of the divergence between
whole completions, with prefix ratios, computed in log space at any length (``KLTerm.sequence_value`` /
``kl.sequence_kl_weight``; docs: *Design of the RPG loss in rpg_trl*, "Two KL levels").

The package, one concern a module: ``ratios`` (w, r, the prefixes, the clip regions), ``kl`` (the KL table, both KL
levels, every ``kl_clip_mode``), ``surrogate`` (the reward term, the two estimators, the aggregation and the metrics),
``spec`` ([`RPGLossSpec`]) and ``loss`` (the entry points [`rpg_loss`] and [`rpg_per_token_loss`]). Each module imports
only those before it in this list (``ratios`` ← ``kl`` ← ``surrogate`` ← ``spec`` ← ``loss``; ``kl`` and ``surrogate``
annotate a specification with the protocol ``kl.LossSpecFields``). ``rpg_trl.losses`` exports the names a user calls
(`__all__`): the entry points, the specification, the names of its options ([`DIVERGENCES`], [`ESTIMATORS`],
[`AGGREGATIONS`], [`IMPORTANCE_SAMPLING_LEVELS`], [`KL_LEVELS`], [`KL_CLIP_MODES`], [`KL_TO_GO`] and the defaults), the
KL table ([`KL_TERMS`]), the aggregation and the metrics of a per-token loss ([`aggregate_loss`], [`summarize_stats`],
[`DIAGNOSTIC_METRICS`]), the clamps, [`KLSignWarning`] and [`PAPER_NAMES`]. The building blocks (the ratios, the KL
weights, the estimators, the sums the trainers reduce across processes) stay in their modules, where the trainers and
the tests import them from (e.g. ``rpg_trl.losses.kl.sequence_kl_weight``).
"""

from .kl import (
    DEFAULT_KL_CLIP_MODE,
    DEFAULT_KL_TO_GO,
    DIVERGENCES,
    KL_CLIP_MODES,
    KL_LEVELS,
    KL_TERMS,
    KL_TO_GO,
    KLClipMode,
    KLSignWarning,
    KLTerm,
)
from .loss import rpg_loss, rpg_per_token_loss
from .ratios import IMPORTANCE_SAMPLING_LEVELS, LOG_RATIO_CLAMP, LOG_WEIGHT_CLAMP
from .spec import PAPER_NAMES, RPGLossSpec
from .surrogate import AGGREGATIONS, DIAGNOSTIC_METRICS, ESTIMATORS, aggregate_loss, summarize_stats


#: The names a user calls; everything else is imported from the module that defines it.
__all__ = [
    "AGGREGATIONS",
    "DEFAULT_KL_CLIP_MODE",
    "DEFAULT_KL_TO_GO",
    "DIAGNOSTIC_METRICS",
    "DIVERGENCES",
    "ESTIMATORS",
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
    "RPGLossSpec",
    "aggregate_loss",
    "rpg_loss",
    "rpg_per_token_loss",
    "summarize_stats",
]
