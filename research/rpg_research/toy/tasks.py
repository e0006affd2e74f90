# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The tasks of ``rpg-trl demo --task``: what the demo's pipeline needs of each, by name ([`DEMO_TASKS`]).

* ``"addition"`` (the default): two-digit additions, the bare sum as the completion (3-4 tokens;
  [`rpg_research.toy.addition`]).
* ``"long_addition"``: four-digit additions worked out in rows, 109-110 tokens
  ([`rpg_research.toy.long_addition`]), where RPG's importance weights and its sequence-level KL act over many tokens.
* ``"ring_walk"``: walks of 64 letters around a ring of letters, each step +k or −k (65 tokens,
  [`rpg_research.toy.ring_walk`]), where every token stays uncertain (two right letters per step), so that RPG's
  importance weights compound over a completion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import addition, long_addition, ring_walk
from . import warm_start as addition_warm_start


@dataclass(frozen=True)
class DemoTask:
    """
    One task of ``rpg-trl demo``.

    Args:
        problems: What the problems are, in ``summary.json``.
        warm_start_data: What the warm start trains on, in the demo's first message (after its number of rows).
        readiness_check: Whether the warm start extends itself while the model cannot add (``sft_extra_rounds``).
        max_completion_length: Most new tokens, in training and in the held-out evaluation.
        model_sizes: Architecture of the task's Qwen3 by size name (``"small"`` first: the CPU one).
        defaults: The task's values of the demo arguments left unset (``None``), `eval_problems` included.
        warm_start_settings: How the warm start's data are made, recorded in ``summary.json``.
        make_splits: ``(seed, num_eval, sft_steps) -> splits`` with disjoint ``sft``, ``rl`` and ``eval`` lists of
            problems (``(a, b)`` additions, or objects with a ``prompt`` and a ``solution``:
            [`rpg_research.toy.evaluation.problem_prompt`]).
        warm_start: ``(splits, output_dir, *, steps, seed, extra_rounds, model_size, device) -> (model, tokenizer,
            report)``.
        reward: The verified reward, TRL's reward-function signature (``completions, solution``).
        build_rl_dataset: ``problems -> Dataset`` of prompts with their ``solution``.
        scored_by: How `reward` scores a completion, in ``summary.json``'s definition of the held-out score.
    """

    problems: str
    warm_start_data: str
    readiness_check: bool
    max_completion_length: int
    model_sizes: dict[str, dict]
    defaults: dict
    warm_start_settings: dict
    make_splits: Callable
    warm_start: Callable
    reward: Callable
    build_rl_dataset: Callable
    scored_by: str = "correct = math-verify match of the completion's answer with a+b"


def _addition_warm_start(splits, output_dir, *, steps, seed, extra_rounds, model_size, device="cpu"):
    return addition_warm_start.warm_start(
        splits, output_dir, steps=steps, seed=seed, extra_rounds=extra_rounds, device=device
    )


def _long_addition_warm_start(splits, output_dir, *, steps, seed, extra_rounds, model_size, device="cpu"):
    return long_addition.warm_start(splits, output_dir, steps=steps, seed=seed, size=model_size, device=device)


def _ring_walk_warm_start(splits, output_dir, *, steps, seed, extra_rounds, model_size, device="cpu"):
    return ring_walk.warm_start(splits, output_dir, steps=steps, seed=seed, size=model_size, device=device)


DEMO_TASKS: dict[str, DemoTask] = {
    "addition": DemoTask(
        problems="two-digit additions",
        warm_start_data="noisy additions (+ easy ones)",
        readiness_check=True,
        max_completion_length=addition.MAX_COMPLETION_LENGTH,
        model_sizes={"small": addition.DEMO_MODEL_KWARGS},
        defaults={
            "steps": 400,
            "sft_steps": 1500,
            "sft_extra_rounds": 3,
            "learning_rate": 6e-4,
            "eval_every": 50,
            "eval_problems": 400,
        },
        warm_start_settings={
            "label_noise": addition.SFT_LABEL_NOISE,
            "easy_fraction": addition.SFT_EASY_FRACTION,
            "min_check_accuracy": addition_warm_start.WARM_START_MIN_ACCURACY,
        },
        make_splits=lambda seed, num_eval, sft_steps: addition.make_splits(seed, num_eval=num_eval),
        warm_start=_addition_warm_start,
        reward=addition.addition_reward,
        build_rl_dataset=addition.build_rl_dataset,
    ),
    "long_addition": DemoTask(
        problems="four-digit additions worked out in rows",
        warm_start_data=f"worked four-digit additions, {long_addition.SFT_SLIP_RATE:.0%} of them with a slip",
        readiness_check=False,
        max_completion_length=long_addition.MAX_COMPLETION_LENGTH,
        model_sizes=long_addition.MODEL_SIZES,
        defaults={
            "steps": 40,
            "sft_steps": long_addition.SFT_STEPS,
            "sft_extra_rounds": 0,
            "learning_rate": 1e-4,
            "eval_every": 40,
            "eval_problems": 400,
        },
        warm_start_settings={"slip_rate": long_addition.SFT_SLIP_RATE, "num_digits": long_addition.NUM_DIGITS},
        # As many supervised problems as the warm start's batches of 32 use (one epoch): tokenizing more costs time.
        make_splits=lambda seed, num_eval, sft_steps: long_addition.make_splits(
            seed, num_eval=num_eval, num_sft=32 * max(1, sft_steps)
        ),
        warm_start=_long_addition_warm_start,
        reward=long_addition.long_addition_reward,
        build_rl_dataset=long_addition.build_rl_dataset,
    ),
    "ring_walk": DemoTask(
        problems=f"walks of {ring_walk.WALK_LENGTH} letters around a ring of {ring_walk.RING_SIZE} letters",
        warm_start_data=(
            f"problems' walks (a slip at {ring_walk.SFT_SLIP_RATE:.0%} of their steps, "
            f"{ring_walk.SFT_OVERRUN_RATE:.0%} of them too long)"
        ),
        readiness_check=False,
        max_completion_length=ring_walk.MAX_COMPLETION_LENGTH,
        model_sizes=ring_walk.MODEL_SIZES,
        defaults={
            "steps": 32,
            "sft_steps": ring_walk.SFT_STEPS,
            "sft_extra_rounds": 0,
            "learning_rate": 3e-4,
            "eval_every": 32,
            "eval_problems": ring_walk.NUM_EVAL,
        },
        warm_start_settings={
            "slip_rate": ring_walk.SFT_SLIP_RATE,
            "overrun_rate": ring_walk.SFT_OVERRUN_RATE,
            "max_overrun": ring_walk.MAX_OVERRUN,
            "ring_size": ring_walk.RING_SIZE,
            "max_step": ring_walk.MAX_STEP,
            "walk_length": ring_walk.WALK_LENGTH,
        },
        make_splits=lambda seed, num_eval, sft_steps: ring_walk.make_splits(seed, num_eval=num_eval),
        warm_start=_ring_walk_warm_start,
        reward=ring_walk.ring_walk_reward,
        build_rl_dataset=ring_walk.build_rl_dataset,
        scored_by=(
            f"score = fraction of the {ring_walk.WALK_LENGTH - 1} steps that are +k or -k around the ring, 0 unless "
            f"the completion is exactly {ring_walk.WALK_LENGTH} characters from the start letter"
        ),
    ),
}


def check_model_size_and_device(task: str, model_size: str, device: str) -> None:
    """
    Raise a `ValueError` unless `model_size` is one of [`DEMO_TASKS`]`[task]`'s sizes and `device` one of the toy
    training's devices that this machine has (``"cuda"`` needs a GPU torch can see). `task` must be a key of
    [`DEMO_TASKS`].
    """
    from .training import DEVICES

    sizes = DEMO_TASKS[task].model_sizes
    if model_size not in sizes:
        raise ValueError(f"`model_size` must be one of {sorted(sizes)} with `task={task!r}`; got {model_size!r}.")
    if device not in DEVICES:
        raise ValueError(f"`device` must be one of {DEVICES}; got {device!r}.")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"`device` is 'cuda' but torch {torch.__version__} finds no CUDA GPU here; use `--device cpu`."
            )
