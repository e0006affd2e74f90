# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Diverged policies: a warning when the importance weights of a logging interval explode.

Log-ratios are clamped before `exp` in the loss, so the loss stays finite, and RPG-Style Clip (paper Sec. 3.3) removes
the reward gradient of tokens outside the trust region (`clip_ratio/*` metrics). When the largest importance weight
π_θ/π_old of a logging interval exceeds `importance_weight_warning_threshold` (default 100), a warning says so, at most
once every [`IMPORTANCE_WEIGHT_WARNING_INTERVAL`] optimizer steps: [`ImportanceWeightMonitor`] decides,
[`ImportanceWeightMonitorMixin`] gives it to a trainer ([`~rpg_trl.RPGTrainer`] and
[`~rpg_trl.async_rpg.AsyncRPGTrainer`]).

The importance-sampling correction for vLLM (TRL's `vllm_importance_sampling_correction`) needs the server's sampling
log-probs: [`count_nonfinite_sampling_logps`] counts those that are NaN or infinite in each generation batch (metric
`vllm/nonfinite_logps`) and warns once per run, since TRL then silently uses a ratio of 1.
"""

from __future__ import annotations

import math

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

#: Minimum number of optimizer steps between two warnings about exploding importance weights.
IMPORTANCE_WEIGHT_WARNING_INTERVAL = 100


def check_warning_threshold(threshold, name: str = "importance_weight_warning_threshold") -> None:
    """Raise a `ValueError` naming `name` unless `threshold` is a finite number > 1 (a bound on π_θ/π_old) or None."""
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1.0 < threshold < math.inf
    ):
        raise ValueError(f"`{name}` must be a finite number > 1 (a bound on π_θ/π_old) or None; got {threshold!r}.")


class ImportanceWeightMonitor:
    """Warns when the largest importance weight π_θ/π_old exceeds `threshold`, at most once every `interval` steps."""

    def __init__(self, threshold: float | None, interval: int = IMPORTANCE_WEIGHT_WARNING_INTERVAL):
        self.threshold = threshold
        self.interval = interval
        self.last_warning_step: int | None = None
        self.num_warnings = 0

    def check(self, w_max: float | None, step: int, clip_fractions: dict[str, float] | None = None) -> bool:
        """Warn if `w_max > threshold` and no warning was given in the last `interval` steps; return whether it
        warned."""
        if self.threshold is None or w_max is None or not (w_max > self.threshold):  # NaN: no tokens
            return False
        if self.last_warning_step is not None and step - self.last_warning_step < self.interval:
            return False
        self.last_warning_step = step
        self.num_warnings += 1
        clipped = ", ".join(f"{k} = {v:.3g}" for k, v in (clip_fractions or {}).items())
        logger.warning(
            f"Step {step}: the importance weight π_θ/π_old reached {w_max:.4g}, above "
            f"importance_weight_warning_threshold = {self.threshold:g}: the policy has moved far from the policy "
            f"that sampled the batch{f' ({clipped})' if clipped else ''}. The loss stays finite (log-ratios are "
            "clamped and RPG-Style Clip drops the reward gradient outside the trust region), but such steps carry "
            "little signal: lower `learning_rate` or `steps_per_generation * num_iterations`. (Reported at most once "
            f"every {self.interval} steps.)"
        )
        return True

    def check_logged(self, metrics: dict, step: int) -> bool:
        """[`check`] on the trainer's not-yet-logged training metrics (`importance_weight/max` and `clip_ratio/*`
        lists, one value per micro-batch, already reduced over processes)."""
        w_max = [v for v in metrics.get("importance_weight/max", ()) if not math.isnan(v)]
        if not w_max:
            return False
        clip_fractions = {
            key: sum(values) / len(values)
            for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean")
            if (values := [v for v in metrics.get(key, ()) if not math.isnan(v)])
        }
        return self.check(max(w_max), step, clip_fractions)


class ImportanceWeightMonitorMixin:
    """Warns, from a trainer's `log`, when the importance weights of the logging interval exploded (rate-limited).

    Goes before the TRL trainer in a class line; the trainer logs `importance_weight/max` and `clip_ratio/*` per
    micro-batch, and its `args` carry `importance_weight_warning_threshold` (None: never warn).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: The monitor (its `num_warnings` counts the warnings given).
        self.importance_weight_monitor = ImportanceWeightMonitor(self.args.importance_weight_warning_threshold)

    def log(self, logs, start_time=None):
        if self.model.training:  # the training metrics of this logging interval, before `log` clears them
            self.importance_weight_monitor.check_logged(self._metrics["train"], self.state.global_step)
        super().log(logs, start_time)


# ---------------------------------------------------------------------------------------------------- server log-probs
#: The metric of [`count_nonfinite_sampling_logps`]: per generation batch, the completion tokens (all processes) whose
#: sampling log-prob from vLLM is NaN or infinite.
NONFINITE_LOGPS_METRIC = "vllm/nonfinite_logps"


def count_nonfinite_sampling_logps(trainer, batch: dict) -> int | None:
    """Count the completion tokens of a scored batch (GRPOTrainer's `_generate_and_score_completions` output) whose
    sampling log-prob (`sampling_per_token_logps`, vLLM's) is not finite, over all processes; log the count as
    [`NONFINITE_LOGPS_METRIC`] and warn the first time it is not zero (once per trainer). Returns the count, or None
    when the batch has no sampling log-probs (no vLLM). A collective call when the batch has them.

    TRL 1.16 gives a NaN token an importance-sampling ratio of exactly 1 (it `nan_to_num`s the log-ratio), and an
    infinite one a ratio at the clip bound: the correction of `vllm_importance_sampling_correction` is off for them,
    and nothing else says so."""
    logps = batch.get("sampling_per_token_logps")
    if logps is None:
        return None
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    local = (~torch.isfinite(logps) & mask).sum()
    total = torch.stack([local, mask.sum()]).to(trainer.accelerator.device)
    count, tokens = (int(v) for v in trainer.accelerator.gather(total).view(-1, 2).sum(dim=0).tolist())
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][NONFINITE_LOGPS_METRIC].append(float(count))
    if count and not getattr(trainer, "_warned_nonfinite_logps", False):
        trainer._warned_nonfinite_logps = True
        logger.warning(
            f"Step {trainer.state.global_step}: {count} of the {tokens} completion tokens of a generation batch have a "
            "non-finite (NaN or infinite) sampling log-prob from the vLLM server. TRL 1.16 sets the importance-sampling "
            "ratio of a NaN one to exactly 1 (of an infinite one, to the clip bound), so "
            "`vllm_importance_sampling_correction` does not correct them. The "
            f"metric `{NONFINITE_LOGPS_METRIC}` counts them in every generation batch. Check the server's model, dtype "
            "and `vllm_importance_sampling_*` settings. (Reported once.)"
        )
    return count
