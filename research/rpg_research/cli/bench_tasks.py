# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The tasks of ``rpg-trl bench-algos --task`` ([`BENCH_TASKS`]): what its runs need of each, on top of the demo's
task ([`rpg_research.toy.tasks.DEMO_TASKS`]).

* ``"addition"`` (the default, every table before the fourth protocol of research/docs/bench_algos.md): two-digit additions,
  completions of 3-4 tokens, 128 completions per optimizer step, the proxy of [`rpg_research.toy.proxy.proxy_reward`].
* ``"long_addition"`` (the fourth protocol): four-digit additions worked out in rows, 109-110 tokens, 64 completions
  per optimizer step (8 prompts × 8 samples), the same flaw on the answer line
  ([`rpg_research.toy.proxy.answer_line_proxy_reward`]); the per-position diagnostics group the tokens by the row
  they belong to ([`BenchTask.position_groups`]).
* ``"ring_walk"``: walks of 64 letters, each step +k or −k around a ring (65 tokens, every one uncertain:
  [`rpg_research.toy.ring_walk`]), 64 completions per optimizer step, the proxy paying for letters after the walk
  ([`rpg_research.toy.proxy.ring_walk_proxy_reward`]); the diagnostics pool the walk's quarters and its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchTask:
    """
    One task of ``rpg-trl bench-algos``.

    Args:
        demo: The name of the demo's task ([`rpg_research.toy.tasks.DEMO_TASKS`]): splits, warm start, reward,
            prompts and completion length.
        completions_per_step: Completions per optimizer step (``per_device_train_batch_size``; prompts × 8 samples).
        proxy_reward: The KL table's flawed training reward (TRL's reward-function signature).
        strict_reward: The KL table's true reward, the held-out score.
        proxy_max_completion_length: Most new tokens in the KL table (the task's and the characters the proxy pays for).
        position_groups: ``(name, start, stop)``: the completion positions ``[start, stop)`` whose tokens the
            per-position diagnostics pool ([`rpg_research.cli.position_diagnostics`]).
    """

    demo: str
    completions_per_step: int
    proxy_reward: Callable
    strict_reward: Callable
    proxy_max_completion_length: int
    position_groups: tuple[tuple[str, int, int], ...]

    @property
    def demo_task(self):
        from ..toy.tasks import DEMO_TASKS

        return DEMO_TASKS[self.demo]


def _bench_tasks() -> dict[str, BenchTask]:
    from ..toy import long_addition, proxy, ring_walk
    from ..toy.addition import MAX_COMPLETION_LENGTH

    rows = tuple(
        (f"row {i + 1}", i * long_addition.ROW_LENGTH, (i + 1) * long_addition.ROW_LENGTH)
        for i in range(long_addition.NUM_DIGITS)
    )
    answer_start = long_addition.NUM_DIGITS * long_addition.ROW_LENGTH
    quarter = ring_walk.WALK_LENGTH // 4
    quarters = tuple((f"quarter {i + 1}", i * quarter, (i + 1) * quarter) for i in range(4))
    return {
        "addition": BenchTask(
            demo="addition",
            completions_per_step=128,
            proxy_reward=proxy.proxy_reward,
            strict_reward=proxy.strict_reward,
            proxy_max_completion_length=proxy.PROXY_MAX_COMPLETION_LENGTH,
            position_groups=(("completion", 0, MAX_COMPLETION_LENGTH),),
        ),
        "long_addition": BenchTask(
            demo="long_addition",
            completions_per_step=64,
            proxy_reward=proxy.answer_line_proxy_reward,
            strict_reward=proxy.answer_line_strict_reward,
            proxy_max_completion_length=proxy.long_max_completion_length(),
            position_groups=(*rows, ("answer line and end", answer_start, long_addition.MAX_COMPLETION_LENGTH)),
        ),
        "ring_walk": BenchTask(
            demo="ring_walk",
            completions_per_step=64,
            proxy_reward=proxy.ring_walk_proxy_reward,
            strict_reward=ring_walk.ring_walk_reward,
            proxy_max_completion_length=proxy.ring_walk_max_completion_length(),
            # The end: the end token, or the letters the proxy pays for.
            position_groups=(*quarters, ("end", ring_walk.WALK_LENGTH, proxy.ring_walk_max_completion_length())),
        ),
    }


#: The names of the tasks ([`bench_task`] gives each).
BENCH_TASK_NAMES = ("addition", "long_addition", "ring_walk")


def bench_task(name: str) -> BenchTask:
    """The [`BenchTask`] called `name` (one of [`BENCH_TASK_NAMES`])."""
    if name not in BENCH_TASK_NAMES:
        raise ValueError(f"`task` must be one of {list(BENCH_TASK_NAMES)}; got {name!r}.")
    return _bench_tasks()[name]


def task_splits(task_name: str, seed: int, num_eval: int, sft_steps: int):
    """The seed's splits of `task_name`: held-out and RL problems do not depend on `sft_steps`."""
    return bench_task(task_name).demo_task.make_splits(seed, num_eval, sft_steps)


def cached_task_warm_start(
    task_name: str,
    splits,
    directory: str | Path,
    *,
    steps: int,
    seed: int,
    extra_rounds: int,
    model_size: str = "small",
    device: str = "cpu",
):
    """The warm start of `seed` for `task_name` (its model of `model_size`, trained on `device`) in `directory`, reused
    when ``warm_start.json`` there records the same settings (the two-digit task's:
    [`rpg_research.toy.warm_start.cached_warm_start`], whose format this follows); returns its report as a dict."""
    if task_name == "addition":
        from ..toy.warm_start import cached_warm_start

        return cached_warm_start(splits, directory, steps=steps, seed=seed, extra_rounds=extra_rounds, device=device)
    from ..toy.warm_start import reuse_or_train

    task = bench_task(task_name).demo_task
    settings = {
        "task": task_name,
        "seed": seed,
        "sft_steps": steps,
        "model": task.model_sizes[model_size],
        **task.warm_start_settings,
    }
    if device != "cpu":  # a setting only off the CPU, as in the two-digit task's marker
        settings["device"] = device
    return reuse_or_train(
        directory,
        settings,
        lambda: task.warm_start(
            splits,
            str(directory),
            steps=steps,
            seed=seed,
            extra_rounds=extra_rounds,
            model_size=model_size,
            device=device,
        )[2],
        f"Warm start of seed {seed} ({task_name}): {steps} supervised steps",
    )
