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
        ref_model_sync_kl_threshold (`float` or `None`, *optional*, defaults to `None`):
            κ: with `kl_anchor="reference"`, sync π_ref ← π_θ when the moving average of the token KL to the reference
            exceeds κ ([`~rpg_trl.callbacks.RefModelSyncCallback`]); combines with TRL's `sync_ref_model`,
            `ref_model_sync_steps` and `ref_model_mixup_alpha`.
        ref_model_sync_kl_ema (`float`, *optional*, defaults to `0.9`):
            Weight γ of the previous value in that moving average.
        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            DAPO dynamic sampling: replace groups whose rewards are all equal by newly generated groups
            ([`rpg_trl.dynamic_sampling`]).
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `20`):
            Most generation rounds per generation batch with `dynamic_sampling`.
        dynamic_sampling_metric (`str` or `None`, *optional*, defaults to `None`):
            Reward function whose per-group variance decides which groups are kept (`None`: the total reward).
        importance_weight_warning_threshold (`float` or `None`, *optional*, defaults to `100.0`):
            Warn when the largest importance weight π_θ/π_old of a logging interval exceeds it.
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

    # Iterative reference updates with a separate reference (RPG_SPEC §5, `rpg_trl.callbacks.RefModelSyncCallback`).
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

    # DAPO dynamic sampling (Yu et al., 2025; the paper's runs, Sec. 5), `rpg_trl.dynamic_sampling`.
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: drop the groups whose rewards are all equal (accuracy all 0 or all 1: zero "
            "advantage) and generate completions for new training prompts until every generation batch is full of "
            "groups with signal, for at most `dynamic_sampling_max_rounds` generation rounds. Default False (TRL's "
            "sampling); the paper's runs use it. Requires per_device_train_batch_size * steps_per_generation to be a "
            "multiple of num_generations and a map-style training dataset."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=20,
        metadata={
            "help": "Most generation rounds (the first included) per generation batch with `dynamic_sampling`; if the "
            "batch is still short after the last round it is filled with zero-variance groups (advantage 0) and "
            "`dynamic_sampling/filled_fraction` says how many. Default 20 (the paper's setup)."
        },
    )
    dynamic_sampling_metric: str | None = field(
        default=None,
        metadata={
            "help": "Name of the reward function whose per-group variance decides which groups are kept (e.g. "
            "'accuracy_reward', DAPO's and the paper's filter on accuracy, so that an overlong penalty alone does not "
            "keep a group). None (default): the weighted sum of all rewards (TRL's `reward`)."
        },
    )

    # Reliability (`rpg_trl.safety`, docs/guarantees.md).
    importance_weight_warning_threshold: float | None = field(
        default=100.0,
        metadata={
            "help": "Warn (at most once every 100 optimizer steps) when the largest importance weight π_θ/π_old of a "
            "logging interval exceeds this value: the policy has diverged from the policy that sampled the batch. "
            "Default 100 (log-ratio ≈ 4.6, far beyond the clip bounds 1 + epsilon_high and clip_c = 10). None: never "
            "warn."
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
            names={"clip": "rpg_clip", "epsilon_low": "epsilon"},
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
        if self.ref_model_sync_kl_threshold is not None:
            if not self.ref_model_sync_kl_threshold > 0:
                raise ValueError(
                    f"`ref_model_sync_kl_threshold` (κ) must be > 0; got {self.ref_model_sync_kl_threshold}. Use None "
                    "to disable the KL-triggered reference sync."
                )
            if self.kl_anchor != "reference":
                raise ValueError(
                    "`ref_model_sync_kl_threshold` needs a reference model to sync, but `kl_anchor='sampling'` "
                    "anchors the KL to the sampling policy (no reference exists). Set `kl_anchor='reference'` or "
                    "`ref_model_sync_kl_threshold=None`."
                )
        if not 0.0 <= self.ref_model_sync_kl_ema < 1.0:
            raise ValueError(f"`ref_model_sync_kl_ema` must be in [0, 1); got {self.ref_model_sync_kl_ema}.")
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
        max_rounds = self.dynamic_sampling_max_rounds
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(
                f"`dynamic_sampling_max_rounds` must be an integer >= 1 (generation rounds per batch, the first "
                f"included; the paper uses 20); got {max_rounds!r}."
            )
        local_generation_batch = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and local_generation_batch % self.num_generations != 0:
            raise ValueError(
                f"`dynamic_sampling` keeps or drops whole groups on the process that generated them, so each process's "
                f"generation batch (per_device_train_batch_size * steps_per_generation = {local_generation_batch}) "
                f"must be a multiple of num_generations ({self.num_generations}). Change per_device_train_batch_size "
                "or steps_per_generation (or generation_batch_size)."
            )

        # Reliability checks (rpg_trl.safety; tests/test_reliability.py): values that would fail or give NaN later.
        import math

        threshold = self.importance_weight_warning_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1.0 < threshold < math.inf
        ):
            raise ValueError(
                f"`importance_weight_warning_threshold` must be a finite number > 1 (a bound on π_θ/π_old) or None; "
                f"got {threshold!r}."
            )
        if not (isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < math.inf):
            raise ValueError(
                f"`temperature` must be a finite number > 0 (TRL divides the logits by it; use a small value such as "
                f"0.1 for near-greedy sampling); got {self.temperature!r}."
            )
        for name in ("num_iterations", "steps_per_generation", "max_completion_length"):
            value = getattr(self, name)
            if name == "max_completion_length" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        if self.reward_weights is not None and not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.reward_weights
        ):
            raise ValueError(
                f"`reward_weights` must be finite numbers, one per reward function; got {self.reward_weights!r}."
            )
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                f"`scale_rewards` must be 'group', 'batch' or 'none' (the paper's: advantage = reward − group mean); "
                f"got {self.scale_rewards!r}."
            )
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(
                "`multi_objective_aggregation` must be 'sum_then_normalize' or 'normalize_then_sum'; got "
                f"{self.multi_objective_aggregation!r}."
            )
        if not (isinstance(self.top_entropy_quantile, (int, float)) and 0.0 < self.top_entropy_quantile <= 1.0):
            raise ValueError(
                f"`top_entropy_quantile` must be in (0, 1] (the fraction of highest-entropy tokens that get a "
                f"gradient; 1.0 keeps all); got {self.top_entropy_quantile!r}."
            )
        if not (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)):
            raise ValueError(f"`entropy_coef` must be a finite number; got {self.entropy_coef!r}.")
        delta_kl = self.off_policy_mask_threshold
        if delta_kl is not None and not (isinstance(delta_kl, (int, float)) and 0.0 <= delta_kl < math.inf):
            raise ValueError(
                f"`off_policy_mask_threshold` (a KL bound) must be a finite number >= 0 or None; got {delta_kl!r}."
            )
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"`top_p` must be in (0, 1] (1.0 disables nucleus sampling); got {self.top_p!r}.")
