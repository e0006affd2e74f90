# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Guards against hostile inputs: bad rewards, malformed datasets, diverged policies, over-long sequences.

What [`~rpg_trl.RPGTrainer`] does with them (each rule is tested in `tests/test_reliability.py`):

* **Rewards** ([`RewardGuard`]). TRL's convention is kept: a reward function returns one value per completion, and
  `None` means "this function does not score this sample"; TRL then leaves the function out of that sample's weighted
  sum (`nansum`), and a completion that no function scores gets advantage 0. RPG extends the convention to every
  non-finite value: `NaN`, `±inf` and numbers that overflow float32 are turned into `None`, with a warning naming the
  function (rate-limited: at the 1st, 10th, 100th, ... batch where that function does it). An infinite reward would
  otherwise make its group's mean infinite and every advantage of the group `NaN`. A reward function that raises is
  re-raised as a [`RewardFunctionError`] naming the function and the first sample (index in the process's batch,
  prompt and completion) on which it fails when called alone; a value that is not a number (a string, a list) and a
  wrong number of values are errors that name the function and the sample too.
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

import functools
import math
import numbers
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from transformers.utils import logging
from trl.trainer.utils import is_async_callable


logger = logging.get_logger(__name__)

#: Largest float32: rewards are stored as float32 tensors by TRL, so larger magnitudes would become infinite.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: Minimum number of optimizer steps between two warnings about exploding importance weights.
IMPORTANCE_WEIGHT_WARNING_INTERVAL = 100
#: At most this many single-sample calls are made to find the sample on which a reward function fails.
MAX_LOCATE_CALLS = 1024


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one number (or `None`) per completion."""


def _preview(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_reward(value):
    """`float` for a finite real number, `math.nan` for a non-finite one (float32 overflow included), `None` for
    None, and `TypeError` for anything else (strings, lists, complex numbers...)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):  # a one-element real tensor
        if value.numel() != 1 or value.dtype.is_complex:
            raise TypeError(f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = value.item()
    elif isinstance(value, (np.ndarray, np.generic)):  # a one-element real array or numpy scalar
        if value.size != 1 or value.dtype.kind not in "biuf":
            raise TypeError(f"numpy value of shape {value.shape} and dtype {value.dtype}")
        value = value.item()
    if not isinstance(value, numbers.Real):  # bool and numpy scalars are Real; str, complex, lists are not
        raise TypeError(type(value).__name__)
    value = float(value)
    return value if math.isfinite(value) and abs(value) <= FLOAT32_MAX else math.nan


class RewardGuard:
    """
    Wraps reward functions so that their outputs follow RPG's rules (module docstring) and their failures name the
    function and the sample. Holds the per-function counters of the rate-limited warnings.

    [`~rpg_trl.RPGTrainer`] uses one guard for its lifetime: [`installed`] puts guarded versions of its reward
    functions in place while TRL's `_calculate_rewards` runs (reward models, `nn.Module`s, are left as they are).
    """

    def __init__(self):
        self.non_finite_batches: dict[str, int] = {}

    @contextmanager
    def installed(self, trainer):
        """Replace `trainer.reward_funcs` by guarded wrappers for the duration of the `with` block."""
        original = trainer.reward_funcs
        process = getattr(trainer.accelerator, "process_index", 0)
        trainer.reward_funcs = [
            func if isinstance(func, nn.Module) else self.wrap(func, name, process_index=process)
            for func, name in zip(original, trainer.reward_func_names, strict=True)
        ]
        try:
            yield
        finally:
            trainer.reward_funcs = original

    def wrap(self, func, name: str, process_index: int = 0):
        """A guarded version of the reward function `func` (synchronous or async), called by keyword as TRL does."""
        if is_async_callable(func):

            @functools.wraps(func)
            async def guarded_async(**kwargs):
                try:
                    output = await func(**kwargs)
                except Exception as exc:
                    index = await self._locate_async(func, kwargs)
                    raise self._failure(name, exc, kwargs, index, process_index) from exc
                return self.sanitize(name, output, kwargs, process_index)

            return guarded_async

        @functools.wraps(func)
        def guarded(**kwargs):
            try:
                output = func(**kwargs)
            except Exception as exc:
                index = self._locate(func, kwargs)
                raise self._failure(name, exc, kwargs, index, process_index) from exc
            return self.sanitize(name, output, kwargs, process_index)

        return guarded

    # ------------------------------------------------------------------------------------------------ outputs
    def sanitize(self, name: str, output, kwargs: dict, process_index: int = 0) -> list[float | None]:
        """Check `output` (one value per completion) and return it as floats, with `None` for every `None`, NaN,
        infinite or float32-overflowing value; warn (rate-limited) when there were non-finite values."""
        expected = len(kwargs.get("prompts", ()))
        try:
            values = list(output)
        except TypeError:
            raise RewardFunctionError(
                f"Reward function '{name}' returned {type(output).__name__} {_preview(output, 80)}; expected a list "
                f"with one float (or None) per completion ({expected} here)."
            ) from None
        if len(values) != expected:
            raise RewardFunctionError(
                f"Reward function '{name}' returned {len(values)} rewards for {expected} completions (process "
                f"{process_index}); it must return exactly one value (float or None) per completion."
            )
        rewards: list[float | None] = []
        non_finite = []
        for index, value in enumerate(values):
            try:
                reward = _as_reward(value)
            except TypeError:
                raise RewardFunctionError(
                    f"Reward function '{name}' returned {_preview(value, 80)} ({type(value).__name__}) for sample "
                    f"{index} of {expected} (process {process_index}); a reward must be a number or None."
                ) from None
            if reward is not None and math.isnan(reward):
                non_finite.append((index, value))
                reward = None
            rewards.append(reward)
        if non_finite:
            self._warn_non_finite(name, non_finite, expected, process_index)
        return rewards

    def _warn_non_finite(self, name, non_finite, expected, process_index) -> None:
        count = self.non_finite_batches.get(name, 0) + 1
        self.non_finite_batches[name] = count
        if str(count).rstrip("0") != "1":  # report at the 1st, 10th, 100th, ... batch
            return
        index, value = non_finite[0]
        logger.warning(
            f"Reward function '{name}' returned {len(non_finite)} non-finite value(s) out of {expected} on process "
            f"{process_index} (first: {value!r} for sample {index}). They count as None: this function gives no "
            f"reward to those samples, and a sample that no reward function scores gets advantage 0. This is batch "
            f"#{count} with non-finite rewards from '{name}' (reported at the 1st, 10th, 100th, ... such batch)."
        )

    # ------------------------------------------------------------------------------------------------ failures
    @staticmethod
    def _single_sample_calls(kwargs: dict):
        """(index, kwargs) for each sample: every per-sample list sliced to that sample; logging hooks muted."""
        n = len(kwargs.get("prompts", ()))
        for index in range(min(n, MAX_LOCATE_CALLS)):
            single = {}
            for key, value in kwargs.items():
                if key in ("log_extra", "log_metric"):
                    single[key] = lambda *args, **kw: None
                elif isinstance(value, list) and len(value) == n:
                    single[key] = value[index : index + 1]
                else:
                    single[key] = value
            yield index, single

    def _locate(self, func, kwargs: dict) -> int | None:
        for index, single in self._single_sample_calls(kwargs):
            try:
                func(**single)
            except Exception:
                return index
        return None

    async def _locate_async(self, func, kwargs: dict) -> int | None:
        for index, single in self._single_sample_calls(kwargs):
            try:
                await func(**single)
            except Exception:
                return index
        return None

    @staticmethod
    def _failure(name, exc, kwargs, index, process_index) -> RewardFunctionError:
        n = len(kwargs.get("prompts", ()))
        what = f"{type(exc).__name__}: {exc}"
        if index is None:
            return RewardFunctionError(
                f"Reward function '{name}' raised {what} on a batch of {n} completions (process {process_index}); "
                "called on each sample alone it did not fail, so the failure depends on the batch as a whole."
            )
        prompt = kwargs["prompts"][index]
        completion = kwargs["completions"][index] if "completions" in kwargs else None
        return RewardFunctionError(
            f"Reward function '{name}' raised {what} on sample {index} of {n} (process {process_index}; the first "
            f"sample on which it fails when called alone). Prompt: {_preview(prompt)}. Completion: "
            f"{_preview(completion)}. Fix the function, or make it return None for samples it cannot score."
        )


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
        "`dataset.rename_column('question', 'prompt')`, or build the dataset with `rpg_trl.data.format_math_dataset`."
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
