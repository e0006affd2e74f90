# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the [`RPGTrainer`].

RPG's fields are declared once, in dataclass mixins that other configurations share, each beside what it configures:

* [`RPGLossArguments`] (here): the loss (divergence, estimator, RPG-Style Clip, KL anchor, β); also used by the
  asynchronous trainer's configuration.
* [`~rpg_trl.kl_control.KLControlArguments`]: the adaptive KL coefficient; the asynchronous trainer's configuration
  has its fields too, and refuses them. Importable from here too.
* [`~rpg_trl.dynamic_sampling.DynamicSamplingArguments`]: DAPO dynamic sampling; also used by the research package's
  REINFORCE++ baselines and the baselines of the project's math example (`rpg_math.py`). Importable from here too.
* [`~rpg_trl.reliability.config.ReliabilityArguments`]: the reliability checks that both RPG trainers honour
  (importance-weight and KL-drift warnings, process-failure and vLLM request time-outs).
* [`RPGConfig`] = all four + TRL's [`~trl.GRPOConfig`] + the aggregation, the reference sync and the reward time-out;
  its docstring groups every RPG field under a heading, as TRL's groups its own.

Each mixin checks its own fields in a named method that the configuration's `__post_init__` calls; `RPGConfig` also
refuses values of TRL's own fields that TRL accepts when the configuration and the trainer are built but that fail, or
silently misbehave, later in training (`RPGConfig._check_trl_values`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .dynamic_sampling import DynamicSamplingArguments
from .kl_control import KLControlArguments
from .losses import (
    AGGREGATIONS,
    DEFAULT_KL_CLIP_MODE,
    DEFAULT_KL_TO_GO,
    DIVERGENCES,
    ESTIMATORS,
    KL_CLIP_MODES,
    KL_LEVELS,
    KL_TO_GO,
    RPGLossSpec,
)
from .losses.baseline import DEFAULT_KL_TO_GO_BASELINE, KL_TO_GO_BASELINES
from .losses.vocabulary import DEFAULT_KL_ESTIMATE, KL_ESTIMATES
from .reliability import reward_guard
from .reliability.config import ReliabilityArguments


KL_ANCHORS = ("sampling", "reference")

#: The aggregation that reproduces each TRL `loss_type`'s normaliser (`GRPOTrainer._compute_loss`, TRL 1.16). bnpo and
#: dapo are both token means: dapo divides by the token count of the whole generation batch (over processes and
#: accumulation steps), bnpo by that of each micro-batch.
LOSS_TYPE_TO_AGGREGATION = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}
#: The TRL `loss_type` whose normaliser each aggregation uses when `aggregation` is set explicitly.
AGGREGATION_TO_LOSS_TYPE = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
    "seq-mean-token-sum": "luspo",
}
#: TRL loss types that are other surrogate losses (not just a normaliser), which RPG replaces, and why.
REPLACED_LOSS_TYPES = {
    "cispo": "CISPO clips the importance weight inside a REINFORCE term; RPG's REINFORCE estimator "
    "(`estimator='reinforce'`) with RPG-Style Clip is the regularised counterpart",
    "sapo": "SAPO replaces the clip by a soft gate; RPG uses RPG-Style Clip (`rpg_clip`, `clip_c`)",
    "vespo": "VESPO reweights whole sequences by a learned gamma weight; RPG's weights are the importance weights "
    "of Sec. 3",
}


class OnPolicyKLWarning(UserWarning):
    """The KL to the sampling policy cannot act: every optimizer step uses freshly generated data, so π_θ = π_old and
    the KL term has no gradient (`RPGConfig` warns at construction)."""


@dataclass
class RPGLossArguments:
    """RPG's loss fields (paper Sec. 3-5, Appendix H), shared by [`RPGConfig`] and the asynchronous trainer's config.

    Declared before the TRL config in the class line (`class RPGConfig(RPGLossArguments, ..., GRPOConfig)`), so that
    the paper defaults of `beta` and `epsilon_high` replace TRL's.
    """

    divergence: str = field(
        default="urkl",
        metadata={
            "help": "KL regulariser of the RPG objective: 'fkl' = KL(π_ref‖π_θ), 'ufkl' = unnormalised forward KL, "
            "'rkl' = KL(π_θ‖π_ref), 'urkl' = unnormalised reverse KL (= the k3 estimator family). Default 'urkl', "
            "the paper's best variant (RPG-REINFORCE-URKL, Table 3).",
            "choices": list(DIVERGENCES),
        },
    )
    estimator: str = field(
        default="reinforce",
        metadata={
            "help": "Gradient estimator: 'reinforce' minimises −SG(W)·log π_θ (Table 2, Appendix F); 'differentiable' "
            "minimises −w·A + β·KL surrogate through the importance weight (Tables 1 and 4). Both give the same "
            "gradient when unclipped (Proposition 4.1). Default 'reinforce'.",
            "choices": list(ESTIMATORS),
        },
    )
    rpg_clip: bool = field(
        default=True,
        metadata={
            "help": "Apply RPG-Style Clip (Sec. 3.3, Algorithms 1-2): the reward term gets no gradient for A > 0 "
            "and w > 1 + epsilon_high, nor for A < 0 and w < 1 - epsilon or w > clip_c. Default True, as in the "
            "paper's runs."
        },
    )
    clip_c: float = field(
        default=10.0,
        metadata={"help": "Dual-clip bound c > 1 for negative advantages (Ye et al., 2020). Paper scripts: 10.0."},
    )
    kl_anchor: str | None = field(
        default=None,
        metadata={
            "help": "What the KL regularises toward. 'sampling': the policy that sampled the batch, π_ref = π_old, "
            "the paper's iterative reference update (Sec. 5); no reference model is loaded. 'reference': a "
            "reference model (a copy of the initial policy, or the base model / 'ref' adapter with PEFT), which "
            "requires beta > 0. None (default): 'reference' when a reference is asked for (`sync_ref_model` or "
            "`ref_model_sync_kl_threshold`), else 'sampling'.",
            "choices": [None, *KL_ANCHORS],
        },
    )
    kl_importance_weight: bool = field(
        default=True,
        metadata={
            "help": "Weight the KL term by the importance ratio as RPG derives (default True). False uses GRPO's "
            "uncorrected k3 penalty, the biased baseline of the paper's KL-weighting ablation (Sec. 2.2); only with "
            "divergence='urkl'."
        },
    )
    kl_level: str = field(
        default="token",
        metadata={
            "help": "Where the KL term's importance weights are taken. 'token' (default): each token's KL term is "
            "weighted by its own ratio π_θ/π_old, as in the paper's code, TRL and every peer. 'sequence': the exact "
            "gradient of the divergence between whole completions (the paper's objective, Sec. 2-3), with prefix "
            "ratios π_θ(y≤t)/π_old(y≤t); exact with aggregation 'seq-mean-token-sum' (loss_type='luspo'). "
            "help(rpg_trl.losses) gives the weights of both levels.",
            "choices": list(KL_LEVELS),
        },
    )
    kl_clip_mode: str = field(
        default=DEFAULT_KL_CLIP_MODE,
        metadata={
            "help": "How RPG-Style Clip treats the KL term outside the trust region; the reward term is clipped in every "
            "mode, and per token every mode is exact inside the trust region (over whole completions, see "
            "help(rpg_trl.losses.KLClipMode)). 'exact': the KL weight at the unclipped ratio (the authors' code, TRL's "
            "use_bias_correction_kl, slime). 'truncated': the importance weight inside the KL weight capped at clip_c "
            "(over whole completions, one factor min(1, clip_c / largest prefix ratio) on each token's KL-to-go; fkl "
            "left exact), the sign kept. 'clipped': the KL weight at clip(w, 1 - epsilon, 1 + epsilon_high) (Algorithm "
            "1 literally), which can push the policy away from its anchor (warned). 'stopped': no KL "
            "gradient where the reward term is clipped (Sec. G.2, Algorithm 2). Default "
            f"{DEFAULT_KL_CLIP_MODE!r}, chosen on the KL table of the project's CPU benchmark (a toy task, with a "
            "reference model: 'exact' and 'truncated' collapsed on no run, and the rule fixed before the runs picked "
            "the higher mean true reward, 0.537 against 0.517, a difference within the arms' intervals; docs: *Design "
            'of the RPG loss in rpg_trl*, "The KL term outside the trust region"); '
            "rpg_trl.losses.KL_CLIP_MODES names each mode's reading of the paper.",
            "choices": list(KL_CLIP_MODES),
        },
    )
    kl_to_go: str = field(
        default=DEFAULT_KL_TO_GO,
        metadata={
            "help": "With kl_level='sequence' and divergence 'urkl' or 'rkl': how each token's KL-to-go (the KL of the "
            "tokens after it, weighted by their prefix ratios) is estimated. 'log_ratio' (default): the later tokens' "
            "sampled log-ratios log ρ as they are. 'k3': each later token's log ρ replaced by k3 = log ρ + 1/ρ - 1, "
            "which has the same expectation given the tokens before it (a zero-mean control variate), so the gradient "
            "stays unbiased while the later tokens' noise falls from first to second order in log ρ; for long "
            'completions (docs: *Design of the RPG loss in rpg_trl*, "The KL-to-go at length").',
            "choices": list(KL_TO_GO),
        },
    )
    kl_estimate: str = field(
        default=DEFAULT_KL_ESTIMATE,
        metadata={
            "help": "How each position's KL is estimated. 'sample' (default): from the sampled token's log-ratio, "
            "importance-weighted (the KL table of help(rpg_trl.losses)). 'vocabulary': exactly, over the whole "
            "vocabulary, from the policy's and the anchor's next-token distributions at that position (their final "
            "hidden states and LM heads, in tiles, without the (B, T, V) logits; logits divided by `temperature`): the "
            "Rao-Blackwellised estimate, unbiased and never noisier than sampling; its gradient is the exact gradient "
            "of each position's KL, so `estimator` then chooses the reward term's form only, and the normalised and "
            "unnormalised divergences coincide. The logged `kl` is then the exact one. Needs TRL 1.16; with "
            "kl_clip_mode 'exact', 'truncated' or 'stopped' (help(rpg_trl.losses.vocabulary)).",
            "choices": list(KL_ESTIMATES),
        },
    )
    kl_to_go_baseline: str = field(
        default=DEFAULT_KL_TO_GO_BASELINE,
        metadata={
            "help": "With kl_level='sequence' and divergence 'urkl' or 'rkl' (either kl_estimate): 'none' (default) or "
            "'leave_one_out', which subtracts from each token's KL-to-go (the term that multiplies its score) the "
            "prefix ratio times the mean, over the other completions of the same prompt in the micro-batch, of the "
            "KL-to-go relative to the prefix at that position: a baseline that does not depend on the token, so the "
            "gradient stays unbiased and its noise falls. Needs kl_clip_mode='exact' (or rpg_clip=False). "
            "help(rpg_trl.losses.baseline).",
            "choices": list(KL_TO_GO_BASELINES),
        },
    )

    # Paper defaults that differ from TRL's (Sec. 5, Appendix H).
    beta: float = field(
        default=1e-4,
        metadata={
            "help": "KL coefficient β. Default 1e-4 (paper, Appendix H). With kl_anchor='sampling' no reference "
            "model is loaded whatever its value; beta=0 gives plain (clipped) importance-weighted REINFORCE."
        },
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={
            "help": "Upper clip ε_2: the reward term of positive-advantage tokens stops at w = 1 + epsilon_high. "
            "Default 0.28 (paper, Appendix H; also DAPO). The lower clip is `epsilon` (default 0.2)."
        },
    )

    #: How the loss specification's fields are spelled in the configuration, for error messages.
    _LOSS_SPEC_NAMES = {"clip": "rpg_clip", "epsilon_low": "epsilon"}

    def _loss_spec_fields(self) -> dict:
        """The [`RPGLossSpec`] fields of this configuration; a configuration with more loss options (the aggregation,
        the importance-sampling level) adds them."""
        return dict(
            divergence=self.divergence,
            estimator=self.estimator,
            beta=self.beta,
            clip=self.rpg_clip,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
            clip_c=self.clip_c,
            kl_importance_weight=self.kl_importance_weight,
            kl_level=self.kl_level,
            kl_clip_mode=self.kl_clip_mode,
            kl_to_go=self.kl_to_go,
            kl_estimate=self.kl_estimate,
            kl_to_go_baseline=self.kl_to_go_baseline,
        )

    def rpg_loss_spec(self) -> RPGLossSpec:
        """The loss this configuration specifies, as the frozen [`RPGLossSpec`] that the trainers pass to
        [`rpg_trl.losses.rpg_per_token_loss`]; invalid fields raise a `ValueError` that names the configuration's field."""
        names = self._LOSS_SPEC_NAMES
        if getattr(self, "use_bias_correction_kl", True) is False:  # TRL's switch set `kl_importance_weight`: name it
            names = {**names, "kl_importance_weight": "use_bias_correction_kl"}
        return RPGLossSpec.from_kwargs(names=names, **self._loss_spec_fields())

    def check_rpg_loss_arguments(self) -> None:
        """Validate the loss fields (`ValueError` naming the field, the allowed values and the fix), in
        [`RPGLossSpec`]."""
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.rpg_loss_spec()
        if self.kl_anchor is not None and self.kl_anchor not in KL_ANCHORS:
            raise ValueError(f"`kl_anchor` must be one of {list(KL_ANCHORS)} or None; got {self.kl_anchor!r}.")

    def check_kl_anchor(self, *, reference_requested: bool = False, reason: str = "") -> None:
        """Resolve `kl_anchor=None` (the default) and check the anchor against β.

        `reference_requested` says that the user asked for a reference model (`reason` names the option): with
        `kl_anchor` unset the KL is then anchored to it (an info log says so); an explicit `kl_anchor="sampling"`
        with such an option is an error.
        """
        if self.kl_anchor is None:
            self.kl_anchor = "reference" if reference_requested else "sampling"
            if reference_requested:
                from transformers.utils import logging

                logging.get_logger(__name__).info(
                    f"{reason} asks for a reference model, so the KL is anchored to it (kl_anchor='reference'); set "
                    "kl_anchor explicitly to silence this message."
                )
        elif reference_requested and self.kl_anchor == "sampling":
            raise ValueError(
                f"{reason} needs a reference model, but `kl_anchor='sampling'` anchors the KL to the sampling policy "
                "(no reference model exists; it moves with every generation already). Set `kl_anchor='reference'` "
                "(or leave it unset), or remove the option."
            )
        self.rpg_loss_spec().warn_if_kl_can_push_away(self.kl_anchor == "reference", stacklevel=4)
        if self.kl_anchor == "reference" and self.beta == 0.0:
            chosen = f" (chosen because {reason} asks for a reference)" if reference_requested else ""
            raise ValueError(
                f"`kl_anchor='reference'`{chosen} with `beta=0` would load a reference model that the loss never "
                "uses. Set `beta > 0` (the paper uses 1e-4), or `kl_anchor='sampling'` without reference options."
            )


@dataclass
class RPGConfig(RPGLossArguments, KLControlArguments, DynamicSamplingArguments, ReliabilityArguments, GRPOConfig):
    r"""
    Configuration class for the [`RPGTrainer`].

    [`RPGConfig`] inherits every parameter of [`trl.GRPOConfig`] and adds the knobs of Regularized Policy Gradient
    ([On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning](https://huggingface.co/papers/2505.17508),
    ICLR 2026). Defaults follow the paper's setup (Sec. 5 and Appendix H) where it differs from GRPO's: `beta=1e-4`,
    `epsilon_high=0.28`, `scale_rewards="none"` (advantage = reward − group mean), token-mean aggregation, and the
    KL anchored to the sampling policy (no reference model in memory).

    Parameters:
        > Parameters that control the loss

        divergence (`str`, *optional*, defaults to `"urkl"`):
            KL regulariser: `"fkl"` KL(π_ref‖π_θ), `"ufkl"` its unnormalised form, `"rkl"` KL(π_θ‖π_ref), `"urkl"` its
            unnormalised form (the k3 family).
        estimator (`str`, *optional*, defaults to `"reinforce"`):
            `"reinforce"` (stop-gradient weights, Table 2) or `"differentiable"` (Tables 1 and 4).
        rpg_clip (`bool`, *optional*, defaults to `True`):
            Apply RPG-Style Clip (dual clip with `epsilon`, `epsilon_high` and `clip_c`, Sec. 3.3).
        clip_c (`float`, *optional*, defaults to `10.0`):
            Dual-clip bound c > 1 for negative advantages.
        epsilon_high (`float` or `None`, *optional*, defaults to `0.28`):
            Upper clip ε_2 of RPG-Style Clip: the reward term of positive-advantage tokens stops at
            w = 1 + `epsilon_high` (paper, Appendix H; also DAPO; TRL's default is `None`, i.e. `epsilon`). The lower
            clip is TRL's `epsilon` (default `0.2`).
        kl_importance_weight (`bool`, *optional*, defaults to `True`):
            `False` switches to GRPO's uncorrected k3 penalty (no importance weight), the biased baseline of the paper's
            KL-weighting ablation (Sec. 2.2). Requires `divergence="urkl"`.
        kl_level (`str`, *optional*, defaults to `"token"`):
            `"token"`: each token's KL term is weighted by its own ratio (the paper's code, TRL and every peer).
            `"sequence"`: the exact gradient of the divergence between whole completions, with prefix ratios
            π_θ(y≤t)/π_old(y≤t) (outside the trust region, weighted as `kl_clip_mode` says); exact with
            `loss_type="luspo"` (aggregation `"seq-mean-token-sum"`). See docs: *Design of the RPG loss in rpg_trl*,
            "Two KL levels". At either level the trainer logs whether the whole-completion weights collapse and how
            much of the gradient weight the KL term holds: `kl/log_prefix_weight/{max,min,std}`, `kl/prefix_ess` and
            `kl/weight_share` (docs: *Every `GRPOConfig` option under `RPGTrainer`*, "Metrics").
        kl_clip_mode (`str`, *optional*, defaults to `"truncated"`):
            How RPG-Style Clip treats the KL weight outside the trust region (the reward term is clipped in every
            mode): `"truncated"` (the ratio inside the KL weight capped at `clip_c`; over whole completions one factor
            min(1, c / largest prefix ratio) on each token's KL-to-go; fkl's weight, which does not grow with the
            ratio, left exact; the sign kept at both levels; the default, chosen on the KL table of the project's CPU
            benchmark: `"exact"` and `"truncated"` collapsed on no run, and `"truncated"` had the higher mean true
            reward, within the arms' intervals), `"exact"` (the unclipped ratio: the authors' code, TRL, slime),
            `"clipped"` (at clip(w, 1 − ε, 1 + ε_high), Algorithm 1 literally: it can push the policy away from its
            anchor, with a reference model, with rkl, or over whole completions, and warns so) or `"stopped"` (no KL
            gradient where the reward term is clipped, Algorithm 2). See docs: *Design of the RPG loss in rpg_trl*,
            "The KL term outside the trust region".
        kl_to_go (`str`, *optional*, defaults to `"log_ratio"`):
            With `kl_level="sequence"` and `divergence` `"urkl"` or `"rkl"`, how each token's KL-to-go is estimated:
            `"log_ratio"` (the later tokens' sampled log π_θ/π_ref) or `"k3"` (each later token's log ρ replaced by
            k3 = log ρ + 1/ρ − 1: the same expectation given the tokens before it, so the gradient stays unbiased,
            with less noise at length). Refused with the token level and with fkl/ufkl, which have no KL-to-go. See
            docs: *Design of the RPG loss in rpg_trl*, "The KL-to-go at length".
        kl_estimate (`str`, *optional*, defaults to `"sample"`):
            How each position's KL is estimated: `"sample"` (from the sampled token, importance-weighted) or
            `"vocabulary"` (exactly, over the whole vocabulary, from both models' final hidden states and LM heads in
            tiles; the Rao-Blackwellised estimate: unbiased, never noisier; the logged `kl` is then exact). With
            `"vocabulary"`, `estimator` chooses the reward term's form only, `urkl`/`rkl` and `ufkl`/`fkl` coincide,
            and `kl_clip_mode="clipped"`, `kl_to_go="k3"` and `kl_importance_weight=False` are refused. See docs:
            *Design of the RPG loss in rpg_trl*, "The exact per-position KL".
        kl_to_go_baseline (`str`, *optional*, defaults to `"none"`):
            With `kl_level="sequence"`, `divergence` `"urkl"` or `"rkl"` and `kl_clip_mode="exact"` (or
            `rpg_clip=False`): `"leave_one_out"` subtracts from each token's KL-to-go the prefix ratio times the mean,
            over the other completions of its prompt in the micro-batch, of the KL-to-go relative to the prefix at that
            position (a control variate: unbiased, less noise). See docs: *Design of the RPG loss in rpg_trl*, "The
            exact per-position KL".
        aggregation (`str` or `None`, *optional*, defaults to `None`):
            Loss aggregation: `"token-mean"`, `"seq-mean-token-mean"`, `"seq-mean-token-sum"` or
            `"seq-mean-token-sum-norm"`. `None` derives it from `loss_type` and uses TRL's normaliser for it exactly
            (`dapo`/`bnpo` → token-mean over the generation batch / the micro-batch, `grpo` → seq-mean-token-mean,
            `dr_grpo` → seq-mean-token-sum-norm, `luspo` → seq-mean-token-sum). `cispo`, `sapo` and `vespo` are other
            surrogate losses, which RPG replaces: they are refused.
        scale_rewards (`str`, *optional*, defaults to `"none"`):
            Reward scaling of the advantage: `"none"` gives advantage = reward − group mean, without division by the
            std (the paper's baseline, Sec. 5; TRL's default is `"group"`); `"group"` and `"batch"` divide by the
            group or batch std as in GRPO.

        > Parameters that control the KL coefficient

        beta (`float`, *optional*, defaults to `1e-4`):
            KL coefficient β (paper, Appendix H; TRL's default is `0.0`). With `kl_anchor="sampling"` no reference
            model is loaded whatever its value; `beta=0` gives plain (clipped) importance-weighted REINFORCE. With
            `kl_target`, the initial value of the adaptive β.
        kl_target (`float` or `None`, *optional*, defaults to `None`):
            δ: an adaptive β (Ziegler et al., 2019; [`~rpg_trl.kl_control.AdaptiveKLCallback`]) that holds RPG's
            importance-weighted KL estimate (`kl`, or `kl/sequence` with `kl_level="sequence"`) near δ, starting from
            `beta`. `None`: a fixed β.
        kl_horizon (`float` or `None`, *optional*, defaults to `None`):
            H, in samples: β ← β·(1 + clip(KL/δ − 1, −0.2, 0.2)·n/H) after each optimizer step of n samples. `None`
            gives 10000 with `kl_target`.
        kl_beta_min (`float` or `None`, *optional*, defaults to `None`):
            Floor (> 0) of the adaptive β. Only with `kl_target`; `None`: no floor.
        kl_beta_max (`float` or `None`, *optional*, defaults to `None`):
            Ceiling of the adaptive β. Only with `kl_target`; `None`: no ceiling.

        > Parameters that control the reference model

        kl_anchor (`str` or `None`, *optional*, defaults to `None`):
            `"sampling"`: the KL is anchored to the policy that sampled the batch (π_ref = π_old, the paper's runs; no
            reference model is loaded). `"reference"`: the KL is anchored to a reference model (TRL's `ref_model`, or
            the base model / "ref" adapter with PEFT). `None`: `"reference"` when `sync_ref_model` or
            `ref_model_sync_kl_threshold` asks for a reference, else `"sampling"`.
        ref_model_sync_kl_threshold (`float` or `None`, *optional*, defaults to `None`):
            κ: with `kl_anchor="reference"`, sync π_ref ← π_θ when the moving average of the token KL to the reference
            exceeds κ ([`~rpg_trl.ref_sync.RefModelSyncCallback`]); combines with TRL's `sync_ref_model`,
            `ref_model_sync_steps` and `ref_model_mixup_alpha`.
        ref_model_sync_kl_ema (`float`, *optional*, defaults to `0.9`):
            Weight γ of the previous value in that moving average.

        > Parameters that control dynamic sampling

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            DAPO dynamic sampling: replace groups whose rewards are all equal by newly generated groups
            ([`rpg_trl.dynamic_sampling`]).
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `20`):
            Most generation rounds per generation batch with `dynamic_sampling`.
        dynamic_sampling_metric (`str` or `None`, *optional*, defaults to `None`):
            Reward function whose per-group variance decides which groups are kept (`None`: the total reward).

        > Parameters that control reliability

        importance_weight_warning_threshold (`float` or `None`, *optional*, defaults to `100.0`):
            Warn when the largest importance weight π_θ/π_old of a logging interval exceeds it.
        kl_drift_warning (`bool`, *optional*, defaults to `True`):
            With a reference model (`kl_anchor="reference"`, `beta > 0`), warn once ([`~rpg_trl.reliability.kl_drift.
            KLDriftWarning`]) when the KL to it stops holding the policy; a reference sync starts the watch again.
            `False` turns the check off.
        kl_drift_min_kl (`float`, *optional*, defaults to `0.01`):
            The drift warning's floor: no warning while the period's mean KL to the reference is below it.
        main_process_exit_timeout (`float`, *optional*, defaults to `60.0`):
            Multi-process runs: seconds the other processes wait, after the main process reported a failure (e.g. of
            the vLLM server), for it to end before they end themselves and the launcher ends it (its cleanup and
            traceback may then be cut short). Raise it when the main process needs longer to clean up.
        vllm_request_timeout (`float` or `None`, *optional*, defaults to `600.0`):
            vLLM server mode: seconds that one request to the server (a generation batch, a weight sync, a cache reset)
            may take; past it the run stops on every process with a `VLLMServerError` naming the server, the request
            and this option. `None`: no bound. Not TRL's `vllm_server_timeout` (the wait for the server at start-up).
        reward_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds that one call of a reward function (one batch) may take; past it the run ends with a
            [`~rpg_trl.reliability.reward_guard.RewardTimeoutError`] naming the function and the first completion that
            it cannot score within the limit alone ([`~rpg_trl.reliability.reward_guard`]). With a limit, synchronous
            reward functions run in a helper thread (math-verify's signal-based limits then fail in them;
            `rpg_trl.math_task.accuracy_reward` works in any thread). `None`: no limit.
    """

    # The loss: its aggregation and the advantage (the other loss fields are `RPGLossArguments`').
    aggregation: str | None = field(
        default=None,
        metadata={
            "help": "Loss aggregation: 'token-mean' (the paper's; TRL's dapo normaliser, the global token count), "
            "'seq-mean-token-mean' (grpo), 'seq-mean-token-sum' (luspo) or 'seq-mean-token-sum-norm' (dr_grpo: "
            "divided by batch size × max_completion_length). None (default) derives it from `loss_type`, with "
            "TRL's normaliser for each (bnpo: the token count of each micro-batch).",
            "choices": [None, *AGGREGATIONS],
        },
    )
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Reward scaling of the advantage. Default 'none': advantage = reward − group mean, without "
            "division by the std (the paper's baseline, Sec. 5). 'group' and 'batch' divide by the group or "
            "batch std as in GRPO."
        },
    )

    # The reference model: iterative reference updates with a separate reference (paper Sec. 5,
    # `rpg_trl.ref_sync.RefModelSyncCallback`).
    ref_model_sync_kl_threshold: float | None = field(
        default=None,
        metadata={
            "help": "κ: with kl_anchor='reference', sync the reference to the policy (π_ref ← π_θ) when the moving "
            "average of the token KL between them (the `kl` metric, reduced over processes) exceeds κ; the separate-"
            "reference form of the paper's iterative reference update (Sec. 5). Works with a full reference model "
            "and with PEFT (a 'ref' adapter). Combines with `sync_ref_model` (every `ref_model_sync_steps` steps, "
            "mixing with `ref_model_mixup_alpha`). None (default): no KL-triggered sync."
        },
    )
    ref_model_sync_kl_ema: float = field(
        default=0.9,
        metadata={
            "help": "γ in [0, 1) of the moving average m ← γ·m + (1 − γ)·KL compared with "
            "`ref_model_sync_kl_threshold`; it restarts from the first KL after each sync. Default 0.9 (about a "
            "10-step window); 0 compares the last step's KL alone."
        },
    )

    # Reliability: the reward functions' time limit (`rpg_trl.reliability.reward_guard`). Not in ReliabilityArguments,
    # which the asynchronous trainer's config shares: its rewards are scored by TRL's rollout worker, without the guard.
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds that one call of a reward function (one batch of completions) may take before the run "
            "ends with a RewardTimeoutError naming the function and the first completion that it cannot score within "
            "the limit alone, instead of stalling silently. The stuck call cannot be stopped (a Python thread "
            "cannot be killed): it goes on in a daemon thread, its result ignored, until it returns or the process "
            "exits. With a limit, synchronous reward functions run in a helper thread, where math-verify's "
            "signal-based time limits fail (rpg_trl.math_task.accuracy_reward works in any thread). None (default): "
            "no limit."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.check_reliability_arguments()
        reward_guard.check_reward_timeout(self.reward_timeout)
        self._check_trl_values()
        self._check_loss_type()
        self._check_unsupported_options()
        self.check_rpg_loss_arguments()
        self._check_reference()
        self._check_kl_control()
        self._warn_on_policy_kl()
        self.check_dynamic_sampling_arguments()

    def _loss_spec_fields(self) -> dict:
        return dict(
            super()._loss_spec_fields(),
            aggregation=self.aggregation,
            importance_sampling_level=self.importance_sampling_level,
        )

    def _check_loss_type(self) -> None:
        """Derive `aggregation` from TRL's `loss_type` (or `loss_type` from an explicit `aggregation`)."""
        if self.loss_type in REPLACED_LOSS_TYPES:
            raise ValueError(
                f"`loss_type={self.loss_type!r}` selects a different surrogate loss, which RPG replaces "
                f"({REPLACED_LOSS_TYPES[self.loss_type]}). Use one of {sorted(LOSS_TYPE_TO_AGGREGATION)} (which only "
                f"choose how the loss is normalised) or set `aggregation` to one of {list(AGGREGATIONS)}."
            )
        if self.loss_type not in LOSS_TYPE_TO_AGGREGATION:
            raise ValueError(
                f"`loss_type` must be one of {sorted(LOSS_TYPE_TO_AGGREGATION)} with RPG; got {self.loss_type!r}."
            )
        if self.aggregation is None:
            self.aggregation = LOSS_TYPE_TO_AGGREGATION[self.loss_type]
        elif (
            self.aggregation in AGGREGATION_TO_LOSS_TYPE
            and LOSS_TYPE_TO_AGGREGATION[self.loss_type] != self.aggregation
        ):
            if self.loss_type != "dapo":  # TRL's default, so not necessarily the user's choice
                raise ValueError(
                    f"`aggregation={self.aggregation!r}` and `loss_type={self.loss_type!r}` ask for different "
                    f"normalisers; set only one of them (`loss_type={self.loss_type!r}` alone gives "
                    f"aggregation={LOSS_TYPE_TO_AGGREGATION[self.loss_type]!r})."
                )
            # The trainer normalises as TRL does for the loss type of this aggregation.
            self.loss_type = AGGREGATION_TO_LOSS_TYPE[self.aggregation]

    def _check_reference(self) -> None:
        """The KL anchor and the reference-sync options (paper Sec. 5)."""
        requested = []
        if self.sync_ref_model:
            requested.append("`sync_ref_model=True`")
        if self.ref_model_sync_kl_threshold is not None:
            requested.append("`ref_model_sync_kl_threshold`")
        self.check_kl_anchor(reference_requested=bool(requested), reason=" and ".join(requested))
        if self.ref_model_sync_kl_threshold is not None and not self.ref_model_sync_kl_threshold > 0:
            raise ValueError(
                f"`ref_model_sync_kl_threshold` (κ) must be > 0; got {self.ref_model_sync_kl_threshold}. Use None "
                "to disable the KL-triggered reference sync."
            )
        if not 0.0 <= self.ref_model_sync_kl_ema < 1.0:
            raise ValueError(f"`ref_model_sync_kl_ema` must be in [0, 1); got {self.ref_model_sync_kl_ema}.")
        # TRL's fields, kept: TRL accepts 0 steps and fails at the first step (ZeroDivisionError in its callback), and
        # an alpha outside (0, 1] silently never syncs (0) or extrapolates past the policy (> 1).
        if self.ref_model_sync_steps < 1:
            raise ValueError(
                f"`ref_model_sync_steps` must be >= 1 (the sync interval in optimizer steps); got "
                f"{self.ref_model_sync_steps}."
            )
        if self.sync_ref_model and not 0.0 < self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(
                f"`ref_model_mixup_alpha` must be in (0, 1] (π_ref ← α·π_θ + (1 − α)·π_ref); got "
                f"{self.ref_model_mixup_alpha}."
            )

    def _check_kl_control(self) -> None:
        """The adaptive KL coefficient (`kl_target`), after the KL anchor is resolved."""
        self.check_kl_control_arguments()
        if self.kl_target is None or self.kl_anchor != "sampling":
            return
        generate_every = self.steps_per_generation * self.num_iterations
        if self.gradient_accumulation_steps % generate_every == 0:
            raise ValueError(
                f"`kl_target` with kl_anchor='sampling' needs optimizer steps on data of an older policy, but every "
                f"step uses freshly generated data (steps_per_generation * num_iterations = {generate_every} divides "
                f"gradient_accumulation_steps = {self.gradient_accumulation_steps}): π_θ = π_old at each step, the KL "
                "estimate is 0 and β could only fall. Raise `steps_per_generation` or `num_iterations`, or anchor the "
                "KL to a reference model (kl_anchor='reference')."
            )

    def _check_unsupported_options(self) -> None:
        """TRL options that RPG refuses, or honours under its own name (docs: *Every `GRPOConfig` option under
        `RPGTrainer`* lists every option)."""
        if self.delta is not None:
            raise ValueError(
                "`delta` (INTELLECT-2 two-sided clipping) is not used by RPG; RPG-Style Clip bounds negative-advantage "
                "weights with `clip_c`. Unset `delta`."
            )
        if not self.use_bias_correction_kl:
            # GRPO's uncorrected k3 penalty: RPG's `kl_importance_weight=False` (an estimator of the reverse KL, so
            # only with divergence="urkl"; checked by RPGLossSpec).
            self.kl_importance_weight = False

    def _warn_on_policy_kl(self) -> None:
        """Warn when the KL to the sampling policy cannot act (π_θ = π_old at every optimizer step)."""
        if self.kl_anchor != "sampling" or self.beta == 0:
            return
        # Each generation batch serves `generate_every` micro-steps; all of them fall inside one optimizer step (so
        # π_θ = π_old for every micro-batch) exactly when it divides gradient_accumulation_steps (TRL's own test for
        # skipping old_per_token_logps).
        generate_every = self.steps_per_generation * self.num_iterations
        if self.gradient_accumulation_steps % generate_every != 0:
            return
        effect = self.rpg_loss_spec().on_policy_kl_gradient
        warnings.warn(
            f"With kl_anchor='sampling' and divergence={self.divergence!r}, every optimizer step uses freshly "
            f"generated data (steps_per_generation * num_iterations = {generate_every} divides "
            f"gradient_accumulation_steps = {self.gradient_accumulation_steps}), so π_θ = π_ref = π_old at each "
            f"step and the KL term's gradient is {effect}: the KL does not regularise. The paper takes several "
            "optimizer steps per generation batch; raise `steps_per_generation` or `num_iterations`.",
            OnPolicyKLWarning,
            stacklevel=3,
        )

    def _check_trl_values(self) -> None:
        """Values that TRL accepts and that fail, or give NaN, later in training (each refused at construction with a
        message that names the field: `test_invalid_config_is_rejected_at_construction_naming_the_field`)."""
        # Each check is kept because TRL 1.16 refuses none of these values when `GRPOConfig` and `GRPOTrainer` are
        # built (tried on a tiny model); the comment on each says what TRL does with it instead.
        # temperature 0 or < 0: the first generation fails in transformers' logits warper; inf trains on uniform noise.
        if not (isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < math.inf):
            raise ValueError(
                f"`temperature` must be a finite number > 0 (TRL divides the logits by it; use a small value such as "
                f"0.1 for near-greedy sampling); got {self.temperature!r}."
            )
        # num_iterations=0 trains silently without an optimizer pass; steps_per_generation=0 fails at the first step in
        # torch's sampler ("batch_size=0"); max_completion_length=0 fails in transformers as `max_new_tokens`.
        for name in ("num_iterations", "steps_per_generation", "max_completion_length"):
            value = getattr(self, name)
            if name == "max_completion_length" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        # A non-finite weight trains silently on NaN rewards (TRL checks only their number, in GRPOTrainer).
        if self.reward_weights is not None and not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.reward_weights
        ):
            raise ValueError(
                f"`reward_weights` must be finite numbers, one per reward function; got {self.reward_weights!r}."
            )
        # An unknown scaling (RPG redeclares the field, with the paper's default) fails at the first generation batch.
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                f"`scale_rewards` must be 'group', 'batch' or 'none' (the paper's: advantage = reward − group mean); "
                f"got {self.scale_rewards!r}."
            )
        # An unknown aggregation fails only at the first generation batch, after the model and the data are loaded.
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(
                "`multi_objective_aggregation` must be 'sum_then_normalize' or 'normalize_then_sum'; got "
                f"{self.multi_objective_aggregation!r}."
            )
        # Outside (0, 1] TRL trains silently (a quantile > 1 masks nothing, 0 keeps only the top-entropy token).
        if not (isinstance(self.top_entropy_quantile, (int, float)) and 0.0 < self.top_entropy_quantile <= 1.0):
            raise ValueError(
                f"`top_entropy_quantile` must be in (0, 1] (the fraction of highest-entropy tokens that get a "
                f"gradient; 1.0 keeps all); got {self.top_entropy_quantile!r}."
            )
        # A non-finite coefficient is applied as is: the loss is infinite or NaN.
        if not (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)):
            raise ValueError(f"`entropy_coef` must be a finite number; got {self.entropy_coef!r}.")
        # A negative KL bound trains silently, dropping the negative-advantage sequences (KL 0 on policy exceeds it).
        delta_kl = self.off_policy_mask_threshold
        if delta_kl is not None and not (isinstance(delta_kl, (int, float)) and 0.0 <= delta_kl < math.inf):
            raise ValueError(
                f"`off_policy_mask_threshold` (a KL bound) must be a finite number >= 0 or None; got {delta_kl!r}."
            )
        # top_p=0 silently samples greedily (a group's completions alike: zero advantages); above 1 it is ignored.
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"`top_p` must be in (0, 1] (1.0 disables nucleus sampling); got {self.top_p!r}.")
