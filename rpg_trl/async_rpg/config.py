# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the [`AsyncRPGTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..config import KLControlArguments, RPGLossArguments


@dataclass
class AsyncRPGConfig(RPGLossArguments, KLControlArguments, AsyncGRPOConfig):
    r"""
    Configuration class for the [`AsyncRPGTrainer`].

    Every parameter of TRL's [`~trl.experimental.async_grpo.AsyncGRPOConfig`] (vLLM server, rollout pipeline,
    `max_staleness`, `token_budget`, ...) plus RPG's loss fields, declared once in [`rpg_trl.config.RPGLossArguments`]
    and shared with [`RPGConfig`] (same names, defaults and checks): `divergence` (default `"urkl"`), `estimator`
    (`"reinforce"`), `rpg_clip` (`True`), `clip_c` (`10.0`), `kl_anchor` (`None` → `"sampling"`),
    `kl_importance_weight` (`True`), `kl_level` (`"token"`, the only level here), `kl_to_go` (`"log_ratio"`, the only one at the token level), `beta` (`1e-4`), `epsilon_high`
    (`0.28`), `importance_weight_warning_threshold` (`100`), `kl_drift_warning` (`True`), `kl_drift_min_kl`
    (`0.01`) and `main_process_exit_timeout` (`60`, seconds); `epsilon` (`0.2`) is TRL's. Paper Sec. 3-5 and
    Appendix H.

    In the asynchronous setting π_old, the policy that sampled a rollout, is the (stale) policy version whose
    log-probabilities the rollout sample carries, and the default KL anchor is that policy (`kl_anchor="sampling"`,
    π_ref = π_old, no reference model). `kl_anchor="reference"` (with `beta > 0`) anchors the KL to a frozen copy of the
    initial model instead (the base model with PEFT). The loss is a token mean over each micro-batch, AsyncGRPO's
    normaliser; there is no `aggregation` field and importance weights are per token. The adaptive KL coefficient
    (`kl_target`) is refused: β is fixed here.
    """

    def __post_init__(self):
        super().__post_init__()
        self.check_rpg_loss_arguments()
        if self.rpg_loss_spec().kl_needs_completion_order:
            raise ValueError(
                f"`kl_level={self.kl_level!r}` is not available with AsyncRPGTrainer: its loss sees one packed row of "
                "trained tokens per micro-batch, and the exact sequence-level KL needs each completion's prefix ratios "
                "in order. Use kl_level='token' here, or RPGTrainer for kl_level='sequence'."
            )
        self.check_kl_anchor(reference_requested=False)
        if self.kl_target is not None:
            raise ValueError(
                "`kl_target` (the adaptive KL coefficient) is not available with AsyncRPGTrainer: its controller runs "
                "in RPGTrainer only, and the asynchronous trainer keeps a fixed `beta`. Use RPGTrainer for a KL budget, "
                "or unset `kl_target`."
            )
        self.check_kl_control_arguments()
