# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The supervised warm start of the addition task: train until the model can add, and a cached copy per seed that the
benchmarks share."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .addition import (
    DEMO_MODEL_KWARGS,
    SFT_EASY_FRACTION,
    SFT_LABEL_NOISE,
    AdditionSplits,
    build_model,
    build_sft_dataset,
)
from .evaluation import heldout_accuracy
from .training import sft_config, use_terse_progress


#: Readiness check of the warm start (see [`warm_start`]): problems checked, greedy accuracy required, extra rounds.
WARM_START_CHECK_PROBLEMS = 200
WARM_START_MIN_ACCURACY = 0.7
WARM_START_EXTRA_ROUNDS = 3


@dataclass
class WarmStartReport:
    """What [`warm_start`] did: supervised steps in total, rounds, and the greedy accuracy of the readiness check."""

    steps: int
    rounds: int
    check_accuracy: float | None


def warm_start(
    splits: AdditionSplits,
    output_dir: str,
    *,
    steps: int,
    seed: int,
    extra_rounds: int = WARM_START_EXTRA_ROUNDS,
    device: str = "cpu",
):
    """
    Build the demo model, train it with [`~trl.SFTTrainer`] until it can add, and save it with its trainer state.

    A first round of `steps` supervised steps (cosine schedule) is followed by a readiness check: the greedy accuracy
    on [`WARM_START_CHECK_PROBLEMS`] problems the warm start never sees (the first ones of the RL pool; RL only trains
    on them afterwards). Learning to add is a phase transition whose time varies with the seed; while the accuracy is
    below [`WARM_START_MIN_ACCURACY`], up to `extra_rounds` (default [`WARM_START_EXTRA_ROUNDS`]) more rounds of
    ``2/3 · steps`` steps (a warm restart of the schedule, new data order) follow. Most seeds stop after the first
    round. It trains on `device` ([`rpg_research.toy.training.device_training_kwargs`]).

    Returns:
        `(model, tokenizer, WarmStartReport)`.
    """
    from trl import SFTTrainer

    model, tokenizer = build_model(seed)
    if steps == 0:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        return model, tokenizer, WarmStartReport(steps=0, rounds=0, check_accuracy=None)
    dataset = build_sft_dataset(splits.sft, seed)
    check = splits.rl[:WARM_START_CHECK_PROBLEMS]
    total, round_steps = 0, steps
    for round_index in range(1 + extra_rounds):
        trainer = SFTTrainer(
            model=model,
            args=sft_config(
                output_dir, steps=round_steps, seed=seed + round_index, prepared=round_index > 0, device=device
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        use_terse_progress(trainer)
        trainer.train()
        dataset = trainer.train_dataset  # tokenized, with labels: the next rounds skip the preparation
        total += round_steps
        accuracy = heldout_accuracy(model, tokenizer, check, greedy=True)
        if accuracy >= WARM_START_MIN_ACCURACY or round_index == extra_rounds:
            break
        round_steps = max(1, (2 * steps) // 3)
        print(
            f"      The model cannot add yet (greedy accuracy {accuracy:.2f} on {len(check)} unseen problems < "
            f"{WARM_START_MIN_ACCURACY}): {round_steps} more supervised steps."
        )
    trainer.save_model(output_dir)
    trainer.save_state()
    return model, tokenizer, WarmStartReport(steps=total, rounds=round_index + 1, check_accuracy=accuracy)


def supervised_warm_start(
    model, tokenizer, make_dataset: Callable, output_dir: str, *, steps: int, seed: int, max_length: int, device: str
):
    """
    Train `model` with [`~trl.SFTTrainer`] for `steps` steps on the prompt-completion dataset `make_dataset()` (the
    preset of [`rpg_research.toy.training.sft_config`], sequences of at most `max_length` tokens) and save it with its
    tokenizer and trainer state in `output_dir`; with `steps=0`, save the untrained model. The warm start of the tasks
    without a readiness check (the long additions, the ring walk): the held-out score measured next is its result.

    Returns:
        `(model, tokenizer, WarmStartReport)` (one round, no check accuracy).
    """
    from trl import SFTTrainer

    if steps == 0:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        return model, tokenizer, WarmStartReport(steps=0, rounds=0, check_accuracy=None)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(output_dir, steps=steps, seed=seed, max_length=max_length, device=device),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )
    use_terse_progress(trainer)
    trainer.train()
    trainer.save_model(output_dir)
    trainer.save_state()
    return model, tokenizer, WarmStartReport(steps=steps, rounds=1, check_accuracy=None)


def cached_warm_start(
    splits: AdditionSplits,
    directory: str | Path,
    *,
    steps: int,
    seed: int,
    extra_rounds: int = WARM_START_EXTRA_ROUNDS,
    device: str = "cpu",
) -> dict:
    """
    [`warm_start`] into `directory`, or reuse the one there if it was trained with the same settings (recorded in
    ``warm_start.json``, `device` included); return its report as a dict (`steps`, `rounds`, `check_accuracy`). The benchmarks train one
    warm start per seed and share it between their methods and between runs.
    """
    settings = {
        "seed": seed,
        "sft_steps": steps,
        "sft_extra_rounds": extra_rounds,
        "model": DEMO_MODEL_KWARGS,
        "min_accuracy": WARM_START_MIN_ACCURACY,
        "label_noise": SFT_LABEL_NOISE,
        "easy_fraction": SFT_EASY_FRACTION,
    }
    if device != "cpu":  # a setting only off the CPU, so that the warm starts cached before it stay valid
        settings["device"] = device
    return reuse_or_train(
        directory,
        settings,
        lambda: warm_start(splits, str(directory), steps=steps, seed=seed, extra_rounds=extra_rounds, device=device)[
            2
        ],
        f"Warm start of seed {seed}: {steps} supervised steps",
    )


def reuse_or_train(directory: str | Path, settings: dict, train: Callable[[], WarmStartReport], message: str) -> dict:
    """The report of the warm start in `directory` when its ``warm_start.json`` records `settings`; else print
    `message`, run `train()` (which saves the model in `directory` and returns its report), record `settings` and the
    report there, and return the report (as a dict)."""
    directory = Path(directory)
    marker = directory / "warm_start.json"
    if marker.is_file():
        saved = json.loads(marker.read_text())
        if saved.get("settings") == settings:
            print(f"Reusing the warm start in {directory}")
            return saved["report"]
    print(message)
    report = train()
    directory.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"settings": settings, "report": asdict(report)}, indent=2) + "\n")
    return asdict(report)
