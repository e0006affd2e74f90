# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Diverged policies: a warning when the importance weights of a logging interval explode.

Log-ratios are clamped before `exp` in the loss, so the loss stays finite, and RPG-Style Clip (paper Sec. 3.3) removes
the reward gradient of tokens outside the trust region (`clip_ratio/*` metrics). When the largest importance weight
π_θ/π_old of a logging interval exceeds `importance_weight_warning_threshold` (default 100), a warning says so, at most
once every [`IMPORTANCE_WEIGHT_WARNING_INTERVAL`] optimizer steps: [`ImportanceWeightMonitor`] decides,
[`ImportanceWeightMonitorMixin`] gives it to a trainer ([`~rpg_trl.RPGTrainer`] and
[`~rpg_trl.async_rpg.AsyncRPGTrainer`]).
"""

from __future__ import annotations

import math

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
