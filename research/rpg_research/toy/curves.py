# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Training curves read back from a run: its ``log_history``, one metric's series, smoothing, and the stability
measure of the benchmarks (largest drop of a moving average below its running maximum)."""

from __future__ import annotations

import json
import math
import os
import statistics


TRAINER_STATE_NAME = "trainer_state.json"


def find_trainer_state(run_dir: str) -> str:
    """
    Path of the ``trainer_state.json`` of the run in `run_dir`: the one in `run_dir` itself, else the one in its
    latest ``checkpoint-<step>/`` folder.

    Raises:
        FileNotFoundError: when `run_dir` does not exist or holds no trainer state, with what to pass instead.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"Run directory {run_dir!r} does not exist.")
    path = os.path.join(run_dir, TRAINER_STATE_NAME)
    if os.path.isfile(path):
        return path
    checkpoint = get_last_checkpoint(run_dir)
    if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
        return os.path.join(checkpoint, TRAINER_STATE_NAME)
    raise FileNotFoundError(
        f"No {TRAINER_STATE_NAME} in {run_dir!r} nor in a checkpoint-*/ folder inside it. Pass the `output_dir` of a "
        "Trainer run that saved its state (`trainer.save_state()` after training, or `save_strategy` other than "
        "'no' for checkpoints)."
    )


def load_log_history(run_dir: str) -> list[dict]:
    """The ``log_history`` of the run in `run_dir` (see [`find_trainer_state`])."""
    path = find_trainer_state(run_dir)
    with open(path) as f:
        state = json.load(f)
    history = state.get("log_history")
    if not isinstance(history, list):
        raise TypeError(f"{path!r} has no `log_history` list; is it a transformers TrainerState file?")
    return history


def metric_series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of metric `key` in a `log_history` (entries without it are skipped)."""
    steps, values = [], []
    for entry in history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(entry.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing); `weight=0` returns `values`."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"`weight` (smoothing) must be in [0, 1); got {weight!r}.")
    if weight == 0.0:
        return list(values)
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1.0 - weight) * value
        out.append(average / (1.0 - weight**i))
    return out


#: Window (in generation batches) of the moving average of the reward before measuring its largest drop.
REWARD_WINDOW = 5


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what is available)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def max_drawdown(values: list[float]) -> float:
    """Largest fall of `values` below their running maximum (0 for a non-decreasing sequence)."""
    peak, drop = -math.inf, 0.0
    for value in values:
        peak = max(peak, value)
        drop = max(drop, peak - value)
    return drop


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of `values` (standard deviation 0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
