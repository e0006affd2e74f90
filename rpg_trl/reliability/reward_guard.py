# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The reward guard: bad reward values and failing reward functions, named at the sample where they happen.

TRL's convention is kept: a reward function returns one value per completion, and `None` means "this function does not
score this sample"; TRL then leaves the function out of that sample's weighted sum (`nansum`), and a completion that no
function scores gets advantage 0. [`RewardGuard`] extends the convention to every non-finite value: `NaN`, `±inf` and
numbers that overflow float32 are turned into `None`, with a warning naming the function (rate-limited: at the 1st,
10th, 100th, ... batch where that function does it). An infinite reward would otherwise make its group's mean infinite
and every advantage of the group `NaN`. A reward function that raises is re-raised as a [`RewardFunctionError`] naming
the function and the first sample (index in the process's batch, prompt and completion) on which it fails when called
alone; a value that is not a number (a string, a list) and a wrong number of values are errors that name the function
and the sample too. Each of these is tested (docs: *Guarantees*, "How bad rewards are handled", lists the tests).

With a limit (`RPGConfig.reward_timeout`, seconds; `None`, the default, sets none), a call of a reward function that
does not return within it ends the run with a [`RewardTimeoutError`] naming the function and the first sample that,
scored alone, does not return within the limit either (index, prompt and completion), instead of a silent stall. A
synchronous function then runs in a daemon thread while the caller waits at most the limit: a Python thread cannot be
killed, so the stuck call goes on running in that thread, its result and its `log_extra`/`log_metric` calls ignored,
until it returns or the process exits (a daemon thread does not hold the exit back). An async function is cancelled
with `asyncio.wait_for` (at its next `await`; one that blocks its event loop without awaiting is not bounded). Tested
with a slow sample, a batch slow as a whole, an async function and through `RPGTrainer.train()` (docs: *Guarantees*,
"How bad rewards are handled").
"""

from __future__ import annotations

import asyncio
import functools
import math
import numbers
import threading
import time
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from transformers.utils import logging
from trl.trainer.utils import is_async_callable


logger = logging.get_logger(__name__)

#: Largest float32: rewards are stored as float32 tensors by TRL, so larger magnitudes would become infinite.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: At most this many single-sample calls are made to find the sample on which a reward function fails.
MAX_LOCATE_CALLS = 1024


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one number (or `None`) per completion."""


class RewardTimeoutError(RewardFunctionError):
    """A call of a reward function did not return within `reward_timeout` seconds."""


class _Overtime(Exception):
    """A call did not return within its limit (internal: turned into a [`RewardTimeoutError`])."""


def check_reward_timeout(timeout, name: str = "reward_timeout") -> None:
    """Raise a `ValueError` naming `name` unless `timeout` is None (no limit) or a finite number of seconds > 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.0 < timeout < math.inf:
        raise ValueError(
            f"`{name}` must be a finite number of seconds > 0, or None for no limit (the default); got {timeout!r}."
        )


def _call_within(func, kwargs: dict, timeout: float | None, name: str):
    """`func(**kwargs)`, or [`_Overtime`] if it does not return within `timeout` seconds (`None`: no limit, called in
    this thread). With a limit the call runs in a daemon thread, which is left running when it overruns (a Python
    thread cannot be stopped); its later `log_extra`/`log_metric` calls are then ignored."""
    if timeout is None:
        return func(**kwargs)
    abandoned = threading.Event()
    kwargs = _muted_once_abandoned(kwargs, abandoned)
    outcome: dict = {}
    done = threading.Event()

    def target():
        try:
            outcome["value"] = func(**kwargs)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"reward-{name}", daemon=True).start()
    if not done.wait(timeout):
        abandoned.set()
        raise _Overtime()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def _await_within(func, kwargs: dict, timeout: float | None):
    """`await func(**kwargs)`, cancelled with [`_Overtime`] if it does not finish within `timeout` seconds."""
    if timeout is None:
        return await func(**kwargs)
    try:
        return await asyncio.wait_for(func(**kwargs), timeout)
    except asyncio.TimeoutError:
        raise _Overtime() from None


def _muted_once_abandoned(kwargs: dict, abandoned: threading.Event) -> dict:
    """`kwargs` with the trainer's logging hooks made inert once the call is `abandoned`, so that a call left running
    after the run has failed does not write into the trainer's logs."""
    muted = dict(kwargs)
    for key in ("log_extra", "log_metric"):
        hook = kwargs.get(key)
        if callable(hook):

            def gated(*args, _hook=hook, **kw):
                if not abandoned.is_set():
                    return _hook(*args, **kw)

            muted[key] = gated
    return muted


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
        timeout = getattr(trainer.args, "reward_timeout", None)  # RPGConfig's; configurations without it set no limit
        trainer.reward_funcs = [
            func if isinstance(func, nn.Module) else self.wrap(func, name, process_index=process, timeout=timeout)
            for func, name in zip(original, trainer.reward_func_names, strict=True)
        ]
        try:
            yield
        finally:
            trainer.reward_funcs = original

    def wrap(self, func, name: str, process_index: int = 0, timeout: float | None = None):
        """A guarded version of the reward function `func` (synchronous or async), called by keyword as TRL does.
        `timeout`: seconds one call may take before the run ends with a [`RewardTimeoutError`] (`None`: no limit)."""
        if is_async_callable(func):

            @functools.wraps(func)
            async def guarded_async(**kwargs):
                try:
                    output = await _await_within(func, kwargs, timeout)
                except _Overtime:
                    index, error = await self._locate_async(func, kwargs, timeout)
                    raise self._overtime(name, kwargs, index, error, timeout, process_index) from None
                except Exception as exc:
                    index, _ = await self._locate_async(func, kwargs, timeout)
                    raise self._failure(name, exc, kwargs, index, process_index) from exc
                return self.sanitize(name, output, kwargs, process_index)

            return guarded_async

        @functools.wraps(func)
        def guarded(**kwargs):
            try:
                output = _call_within(func, kwargs, timeout, name)
            except _Overtime:
                index, error = self._locate(func, kwargs, timeout, name)
                raise self._overtime(name, kwargs, index, error, timeout, process_index) from None
            except Exception as exc:
                index, _ = self._locate(func, kwargs, timeout, name)
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

    # Locating a sample: each sample is scored alone, in order, until one fails. With a limit, each of those calls has
    # the limit too, and no new call starts once the search has taken the limit in all, so that an error ends the run
    # within 3 limits of the failing call's start (the call, the search, the last single call).
    def _locate(self, func, kwargs: dict, timeout: float | None = None, name: str = "") -> tuple[int | None, object]:
        """`(index, what)` of the first sample on which `func`, called alone, raises (`what`: the exception) or does
        not return within `timeout` (`what`: None); `(None, None)` if no sample does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, single in self._single_sample_calls(kwargs):
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                _call_within(func, single, timeout, name)
            except _Overtime:
                return index, None
            except Exception as exc:
                return index, exc
        return None, None

    async def _locate_async(self, func, kwargs: dict, timeout: float | None = None) -> tuple[int | None, object]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, single in self._single_sample_calls(kwargs):
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                await _await_within(func, single, timeout)
            except _Overtime:
                return index, None
            except Exception as exc:
                return index, exc
        return None, None

    @staticmethod
    def _overtime(name, kwargs, index, error, timeout, process_index) -> RewardTimeoutError:
        n = len(kwargs.get("prompts", ()))
        head = (
            f"Reward function '{name}' did not return within reward_timeout={timeout:g} s on a batch of {n} "
            f"completions (process {process_index})."
        )
        tail = (
            " The stuck call cannot be stopped (a Python thread cannot be killed): it goes on in a daemon thread, its "
            "result ignored, until it returns or the process exits. Make the function bounded (e.g. return None for a "
            "completion it cannot score in time), or raise `reward_timeout`."
        )
        if index is None:
            completion = kwargs["completions"][0] if kwargs.get("completions") else None
            return RewardTimeoutError(
                f"{head} Called on each sample alone (for up to {timeout:g} s in all), none exceeded the limit: the "
                f"batch as a whole takes too long, or the function is stuck on shared state. First completion: "
                f"{_preview(completion)}.{tail}"
            )
        prompt = kwargs["prompts"][index]
        completion = kwargs["completions"][index] if "completions" in kwargs else None
        alone = (
            f"called on sample {index} alone it did not return within the limit either"
            if error is None
            else f"called on sample {index} alone it raised {type(error).__name__}: {error}"
        )
        return RewardTimeoutError(
            f"{head} The first sample on which it fails alone: {alone}. Prompt: {_preview(prompt)}. Completion: "
            f"{_preview(completion)}.{tail}"
        )

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
