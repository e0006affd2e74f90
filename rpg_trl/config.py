# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the [`RPGTrainer`]."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .losses import AGGREGATIONS, DIVERGENCES, ESTIMATORS, validate_rpg_hyperparameters


KL_ANCHORS = ("sampling", "reference")

#: How TRL's `loss_type` maps onto RPG's loss aggregation when `aggregation` is left unset.
LOSS_TYPE_TO_AGGREGATION = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum",
    "luspo": "seq-mean-token-sum",
}


@dataclass
class RPGConfig(GRPOConfig):
    r"""
    Configuration class for the [`RPGTrainer`].

    [`RPGConfig`] inherits every parameter of [`trl.GRPOConfig`] and adds the knobs of Regularized Policy Gradient
    ([On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning](https://huggingface.co/papers/2505.17508),
    ICLR 2026). Defaults follow the paper's setup (Sec. 5 and Appendix H) where it differs from GRPO's: `beta=1e-4`,
    `epsilon_high=0.28`, `scale_rewards="none"` (advantage = reward − group mean), token-mean aggregation, and the
    KL anchored to the sampling policy (no reference model in memory).

    Parameters:
        divergence (`str`, *optional*, defaults to `"urkl"`):
            KL regulariser: `"fkl"` KL(π_ref‖π_θ), `"ufkl"` its unnormalised form, `"rkl"` KL(π_θ‖π_ref), `"urkl"` its
            unnormalised form (the k3 family).
        estimator (`str`, *optional*, defaults to `"reinforce"`):
            `"reinforce"` (stop-gradient weights, Table 2) or `"differentiable"` (Tables 1 and 4).
        rpg_clip (`bool`, *optional*, defaults to `True`):
            Apply RPG-Style Clip (dual clip with `epsilon`, `epsilon_high` and `clip_c`, Sec. 3.3).
        clip_c (`float`, *optional*, defaults to `10.0`):
            Dual-clip bound c > 1 for negative advantages.
        kl_anchor (`str`, *optional*, defaults to `"sampling"`):
            `"sampling"`: the KL is anchored to the policy that sampled the batch (π_ref = π_old, the paper's runs; no
            reference model is loaded). `"reference"`: the KL is anchored to a reference model (TRL's `ref_model`, or
            the base model / "ref" adapter with PEFT).
        kl_importance_weight (`bool`, *optional*, defaults to `True`):
            `False` switches to GRPO's uncorrected k3 penalty (no importance weight), the biased baseline of the paper's
            KL-weighting ablation (Sec. 2.2). Requires `divergence="urkl"`.
        aggregation (`str` or `None`, *optional*, defaults to `None`):
            Loss aggregation: `"token-mean"`, `"seq-mean-token-mean"` or `"seq-mean-token-sum"`. `None` derives it
            from `loss_type` (`dapo`/`bnpo` → token-mean, `grpo` → seq-mean-token-mean, `dr_grpo`/`luspo` →
            seq-mean-token-sum).
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
    kl_anchor: str = field(
        default="sampling",
        metadata={
            "help": "What the KL regularises toward. 'sampling' (default): the policy that sampled the batch, "
            "π_ref = π_old, the paper's iterative reference update (Sec. 5); no reference model is loaded. "
            "'reference': a reference model (a copy of the initial policy, or the base model / 'ref' adapter with "
            "PEFT), which requires beta > 0.",
            "choices": list(KL_ANCHORS),
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
    aggregation: str | None = field(
        default=None,
        metadata={
            "help": "Loss aggregation: 'token-mean' (the paper's), 'seq-mean-token-mean' or 'seq-mean-token-sum'. "
            "None (default) derives it from `loss_type`: dapo/bnpo -> token-mean, grpo -> seq-mean-token-mean, "
            "dr_grpo/luspo -> seq-mean-token-sum.",
            "choices": [None, *AGGREGATIONS],
        },
    )

    # Paper defaults that differ from GRPO's (Sec. 5, Appendix H).
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
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Reward scaling of the advantage. Default 'none': advantage = reward − group mean, without "
            "division by the std (the paper's baseline, Sec. 5). 'group' and 'batch' divide by the group or "
            "batch std as in GRPO."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.aggregation is None:
            if self.loss_type not in LOSS_TYPE_TO_AGGREGATION:
                raise ValueError(
                    f"`loss_type={self.loss_type!r}` selects a different surrogate loss, which RPG replaces. Use one "
                    f"of {sorted(LOSS_TYPE_TO_AGGREGATION)} (which only choose the aggregation) or set `aggregation` "
                    f"to one of {list(AGGREGATIONS)}."
                )
            self.aggregation = LOSS_TYPE_TO_AGGREGATION[self.loss_type]
        validate_rpg_hyperparameters(
            divergence=self.divergence,
            estimator=self.estimator,
            beta=self.beta,
            clip=self.rpg_clip,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon_high,
            clip_c=self.clip_c,
            aggregation=self.aggregation,
            importance_sampling_level=self.importance_sampling_level,
            kl_importance_weight=self.kl_importance_weight,
        )
        if self.kl_anchor not in KL_ANCHORS:
            raise ValueError(f"`kl_anchor` must be one of {list(KL_ANCHORS)}; got {self.kl_anchor!r}.")
        if self.kl_anchor == "reference" and self.beta == 0.0:
            raise ValueError(
                "`kl_anchor='reference'` with `beta=0` would load a reference model that the loss never uses. Set "
                "`beta > 0` (the paper uses 1e-4), or `kl_anchor='sampling'`."
            )
        if self.sync_ref_model and self.kl_anchor != "reference":
            raise ValueError(
                "`sync_ref_model=True` needs a reference model, but `kl_anchor='sampling'` anchors the KL to the "
                "sampling policy, which moves every generation already. Set `kl_anchor='reference'` or "
                "`sync_ref_model=False`."
            )
        if self.delta is not None:
            raise ValueError(
                "`delta` (INTELLECT-2 two-sided clipping) is not used by RPG; RPG-Style Clip bounds negative-advantage "
                "weights with `clip_c`. Unset `delta`."
            )
        if self.use_adaptive_entropy:
            raise ValueError(
                "`use_adaptive_entropy` is not supported by RPGTrainer; use a static `entropy_coef` instead."
            )
        if self.kl_anchor == "sampling" and self.beta > 0 and self.divergence in ("ufkl", "urkl"):
            generate_every = self.steps_per_generation * self.num_iterations
            if generate_every <= self.gradient_accumulation_steps:
                warnings.warn(
                    f"With kl_anchor='sampling' and divergence={self.divergence!r}, the KL gradient is exactly zero "
                    "when every optimizer step uses freshly generated data (steps_per_generation * num_iterations <= "
                    "gradient_accumulation_steps): π_θ = π_ref at each step. The paper takes several optimizer steps "
                    "per generation batch; raise `steps_per_generation` or `num_iterations` to make the KL act.",
                    stacklevel=2,
                )
