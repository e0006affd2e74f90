# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the [`AsyncRPGTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..config import RPGLossArguments
from ..kl_control import KLControlArguments
from ..reliability.config import ReliabilityArguments
from ..reliability.vllm_server import REQUEST_TIMEOUT


@dataclass
class AsyncRPGConfig(RPGLossArguments, KLControlArguments, ReliabilityArguments, AsyncGRPOConfig):
    r"""
    Configuration class for the [`AsyncRPGTrainer`].

    Every parameter of TRL's [`~trl.experimental.async_grpo.AsyncGRPOConfig`] (vLLM server, rollout pipeline,
    `max_staleness`, `token_budget`, ...) plus RPG's loss fields, declared once in [`rpg_trl.config.RPGLossArguments`]
    and shared with [`RPGConfig`] (same names, defaults and checks): `divergence` (default `"urkl"`), `estimator`
    (`"reinforce"`), `rpg_clip` (`True`), `clip_c` (`10.0`), `kl_anchor` (`None` → `"sampling"`),
    `kl_importance_weight` (`True`), `kl_level` (`"token"`, the only level here), `kl_to_go` (`"log_ratio"`, the only
    one at the token level), `kl_estimate` (`"sample"`, the only one here: the sampler's distributions are vLLM's), `kl_to_go_baseline`
    (`"none"`, the only one at the token level),
    `beta` (`1e-4`) and `epsilon_high` (`0.28`); `epsilon` (`0.2`) is TRL's. Paper Sec. 3-5
    and Appendix H. The reliability fields are declared once in [`rpg_trl.reliability.config.ReliabilityArguments`] and
    shared with [`RPGConfig`] too: `importance_weight_warning_threshold` (`100`), `kl_drift_warning` (`True`),
    `kl_drift_min_kl` (`0.01`), `main_process_exit_timeout` (`60`, seconds) and `vllm_request_timeout` (below).

    In the asynchronous setting π_old, the policy that sampled a rollout, is the (stale) policy version whose
    log-probabilities the rollout sample carries, and the default KL anchor is that policy (`kl_anchor="sampling"`,
    π_ref = π_old, no reference model). `kl_anchor="reference"` (with `beta > 0`) anchors the KL to a frozen copy of the
    initial model instead (the base model with PEFT). The loss is a token mean over each micro-batch, AsyncGRPO's
    normaliser; there is no `aggregation` field and importance weights are per token. The adaptive KL coefficient
    (`kl_target`) is refused: β is fixed here. Its four fields ([`rpg_trl.kl_control.KLControlArguments`]) stay in this
    configuration, so that the command line accepts them as for [`RPGConfig`] and a run that sets one is refused with a
    message that names it, rather than by the argument parser.

    `vllm_request_timeout` (`float` or `None`, default `600.0`, as [`RPGConfig`]'s and checked by the same rule): seconds
    that one request to the vLLM server may take. Here it bounds each completion request of TRL's rollout worker
    (`POST /v1/completions`, in place of TRL's `request_timeout`): a request that times out ends the run with a
    `VLLMServerError` naming the server, the request and this option; other failures (refused connection, an HTTP error)
    are tried at most 3 times in all (TRL: 3 × 30), so the error comes within 3 × `vllm_request_timeout` + 4 s of the
    first try ([`rpg_trl.async_rpg.rollouts`]). `None`: TRL's `request_timeout` and retries, unbounded in practice.
    """

    # ReliabilityArguments' field, redeclared for its help: here it bounds the rollout worker's requests (same default,
    # same check).
    vllm_request_timeout: float | None = field(
        default=REQUEST_TIMEOUT,
        metadata={
            "help": "Seconds that one completion request of the rollout worker to the vLLM server may take; past it "
            "the run stops with a VLLMServerError naming the server, the request and this option (TRL's worker would "
            "retry it 3 × 30 times at `request_timeout`, about 15 h against a server that hangs, while the trainer "
            "waits without a word). It replaces TRL's `request_timeout` for these requests, and failures other than a "
            "timeout are tried at most 3 times in all: the error comes within 3 × this bound + 4 s. Same default as "
            f"RPGConfig's ({REQUEST_TIMEOUT:g}). None: TRL's `request_timeout` and retries."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.check_reliability_arguments()
        self.check_rpg_loss_arguments()
        if self.rpg_loss_spec().kl_needs_completion_order:
            raise ValueError(
                f"`kl_level={self.kl_level!r}` is not available with AsyncRPGTrainer: its loss sees one packed row of "
                "trained tokens per micro-batch, and the exact sequence-level KL needs each completion's prefix ratios "
                "in order. Use kl_level='token' here, or RPGTrainer for kl_level='sequence'."
            )
        if self.kl_estimate != "sample":
            raise ValueError(
                f"`kl_estimate={self.kl_estimate!r}` is not available with AsyncRPGTrainer: the exact per-position KL "
                "needs the anchor's next-token distribution at every position, and here the anchor (the policy that "
                "sampled each rollout) is vLLM's, which hands back only the sampled tokens' log-probabilities. Use "
                "kl_estimate='sample' here, or RPGTrainer for kl_estimate='vocabulary'."
            )
        self.check_kl_anchor(reference_requested=False)
        if self.kl_target is not None:
            raise ValueError(
                "`kl_target` (the adaptive KL coefficient) is not available with AsyncRPGTrainer: its controller runs "
                "in RPGTrainer only, and the asynchronous trainer keeps a fixed `beta`. Use RPGTrainer for a KL budget, "
                "or unset `kl_target`."
            )
        self.check_kl_control_arguments()
