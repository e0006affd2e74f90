# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Checks of what enters a run: datasets without prompts, diverged policies, over-long sequences.

* **Datasets** ([`check_prompt_column`]): a training or evaluation dataset without a `prompt` column is refused when
  the trainer is built, instead of a `KeyError` at the first generation.
* **Diverged policies** ([`ImportanceWeightMonitor`]): log-ratios are clamped before `exp` in the loss, so the loss
  stays finite, and RPG-Style Clip removes the reward gradient of tokens outside the trust region
  (`clip_ratio/*` metrics). When the largest importance weight π_θ/π_old of a logging interval exceeds
  `RPGConfig.importance_weight_warning_threshold` (default 100), a warning says so, at most once every
  [`IMPORTANCE_WEIGHT_WARNING_INTERVAL`] optimizer steps.
* **Long prompts**: TRL 1.16 has no `max_prompt_length` and never truncates prompts; [`check_sequence_length`] warns
  once when a prompt plus `max_completion_length` exceeds the model's `max_position_embeddings`.
"""

from __future__ import annotations

import math

from transformers.utils import logging


logger = logging.get_logger(__name__)

#: Minimum number of optimizer steps between two warnings about exploding importance weights.
IMPORTANCE_WEIGHT_WARNING_INTERVAL = 100


# ---------------------------------------------------------------------------------------------------- datasets
def check_prompt_column(dataset, split: str = "train") -> None:
    """Raise a `ValueError` if `dataset` (a `datasets` map-style dataset, a dict of them, or None) lacks a `prompt`
    column. Datasets whose columns are unknown (e.g. some iterable datasets) pass."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            check_prompt_column(part, f"{split} ({name!r})")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" in columns:
        return
    raise ValueError(
        f"The {split} dataset has no 'prompt' column (its columns: {list(columns)}). RPGTrainer, like GRPOTrainer, "
        "generates completions for the 'prompt' of each row: a string, or a list of chat messages "
        "[{'role': 'user', 'content': ...}]. Rename the column that holds the prompts, e.g. "
        "`dataset.rename_column('question', 'prompt')`, or build the dataset with "
        "`rpg_trl.math_task.format_math_dataset`."
    )


# ---------------------------------------------------------------------------------------------------- diverged policy
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


# ---------------------------------------------------------------------------------------------------- long prompts
def check_sequence_length(trainer, inputs: dict) -> None:
    """Warn once if a prompt plus `max_completion_length` exceeds the model's `max_position_embeddings` (TRL 1.16
    neither truncates prompts nor checks this)."""
    if getattr(trainer, "_warned_sequence_length", False) or "prompt_mask" not in inputs:
        return
    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    prompt_length = int(inputs["prompt_mask"].sum(dim=1).max().item()) if inputs["prompt_mask"].numel() else 0
    if prompt_length + trainer.max_completion_length > limit:
        trainer._warned_sequence_length = True
        logger.warning(
            f"A prompt of {prompt_length} tokens plus max_completion_length = {trainer.max_completion_length} exceeds "
            f"the model's max_position_embeddings = {limit}. TRL 1.16 does not truncate prompts (it has no "
            "`max_prompt_length`): the model sees positions it was not trained on. Filter long prompts out of the "
            "dataset (e.g. `dataset.filter(lambda x: len(tokenizer(x['prompt']).input_ids) <= L)`) or lower "
            "`max_completion_length`. (Reported once.)"
        )
