# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""How the toy task trains: the session settings, the device (the CPU by default, or CUDA), the supervised and RL training
presets, a terse progress bar; activation checkpointing is off on every CPU run (the library's testing package's
[`~rpg_trl.testing.training.no_activation_checkpointing`])."""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import ClassVar

# `activation_checkpointing` stays importable from here (`rpg-trl bench-speed` imports it so).
from rpg_trl.testing.training import activation_checkpointing, no_activation_checkpointing  # noqa: F401

from .addition import MAX_COMPLETION_LENGTH


@contextmanager
def cpu_session(num_threads: int):
    """
    Run the block with `num_threads` torch threads, without dataset-map progress bars, with transformers logging at
    error level (training progress bars stay) and without a deprecation warning raised inside TRL on every run;
    restore all of it afterwards.
    """
    import datasets
    import torch
    import transformers

    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    progress_bars = datasets.is_progress_bar_enabled()
    torch.set_num_threads(num_threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            # Raised inside TRL/transformers on every run, about a renamed attribute; nothing the user can act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        if progress_bars:
            datasets.enable_progress_bars()


#: Settings shared by every trainer of the demo and of the benchmarks on the addition task: no checkpoints or trackers
#: (and no activation checkpointing: [`no_activation_checkpointing`]); the device's are [`device_training_kwargs`].
TRAINING_KWARGS = {
    "report_to": "none",
    "save_strategy": "no",
    "dataloader_num_workers": 0,
    "disable_tqdm": False,
}
#: The devices the toy task trains on.
DEVICES = ("cpu", "cuda")


def device_training_kwargs(device: str = "cpu") -> dict:
    """
    The training arguments that choose `device`, as accelerate's and TRL's examples switch it: on "cpu", the CPU in
    float32 (`use_cpu=True`); on "cuda", the first GPU with bf16 autocast (`bf16=True`: float32 weights and optimizer,
    the forward passes in bfloat16, the Trainer's mixed precision).
    """
    if device not in DEVICES:
        raise ValueError(f"`device` must be one of {DEVICES}; got {device!r}. Use 'cuda' on a machine with a GPU.")
    return {"use_cpu": device == "cpu", "bf16": device == "cuda"}


def sft_config(
    output_dir: str, *, steps: int, seed: int, prepared: bool = False, max_length: int = 32, device: str = "cpu"
):
    """
    [`~trl.SFTConfig`] of the warm start: batch 32, AdamW at 5e-3 with cosine decay, weight decay 0.1, sequences of
    at most `max_length` tokens (32: the two-digit additions'), on `device` ([`device_training_kwargs`]).
    `prepared=True` declares the dataset already tokenized by a previous `SFTTrainer` (TRL's `skip_prepare_dataset`).
    """
    from trl import SFTConfig

    return SFTConfig(
        dataset_kwargs={"skip_prepare_dataset": True} if prepared else None,
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        weight_decay=0.1,
        max_length=max_length,
        logging_steps=50,
        seed=seed,
        **TRAINING_KWARGS,
        **device_training_kwargs(device),
        **no_activation_checkpointing(),
    )


def rl_training_kwargs(
    *,
    steps: int,
    seed: int,
    learning_rate: float,
    max_completion_length: int = MAX_COMPLETION_LENGTH,
    device: str = "cpu",
) -> dict:
    """
    Arguments shared by the RL phase of the demo and every algorithm of ``rpg-trl bench-algos``.

    128 completions per optimizer step (16 prompts × 8 samples), 4 optimizer steps per generation batch (64
    prompts), temperature 1.0, at most `max_completion_length` new tokens (4: the two-digit additions'); AdamW with the
    paper's weight decay (0.1), gradient clipping (1.0) and 10 warm-up steps followed by a constant learning rate
    (Appendix H); on `device` ([`device_training_kwargs`]).
    """
    return {
        "max_steps": steps,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 10,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "per_device_train_batch_size": 128,
        "num_generations": 8,
        "steps_per_generation": 4,
        "max_completion_length": max_completion_length,
        "temperature": 1.0,
        "logging_steps": 1,
        "seed": seed,
        **TRAINING_KWARGS,
        **device_training_kwargs(device),
        **no_activation_checkpointing(),
    }


def rpg_config(
    output_dir: str,
    *,
    steps: int,
    seed: int,
    learning_rate: float,
    max_completion_length: int = MAX_COMPLETION_LENGTH,
    device: str = "cpu",
    **rpg_kwargs,
):
    """[`RPGConfig`] of the demo: [`rl_training_kwargs`] on `device` plus RPG's paper defaults, overridable by
    `rpg_kwargs`."""
    from rpg_trl.config import RPGConfig

    training = rl_training_kwargs(
        steps=steps,
        seed=seed,
        learning_rate=learning_rate,
        max_completion_length=max_completion_length,
        device=device,
    )
    return RPGConfig(output_dir=output_dir, **training, **rpg_kwargs)


@functools.cache
def _terse_progress_callback_class():
    """The callback class, defined on first use (importing `transformers.trainer` takes seconds)."""
    from transformers import ProgressCallback

    class TerseProgressCallback(ProgressCallback):
        """TRL's progress bar, with the latest metrics shown after the bar instead of one printed line per log."""

        KEYS: ClassVar[dict[str, str]] = {
            "loss": "loss",
            "reward": "reward",
            "kl": "kl",
            "entropy": "entropy",
            "heldout/accuracy": "acc",
        }

        def __init__(self):
            super().__init__()
            self.postfix: dict[str, str] = {}

        def _show(self, logs):
            for key, short in self.KEYS.items():
                if isinstance(logs.get(key), float):
                    self.postfix[short] = f"{logs[key]:.3g}"
            if self.training_bar is not None and self.postfix:
                self.training_bar.set_postfix(self.postfix, refresh=False)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._show(logs or {})

        def on_step_end(self, args, state, control, **kwargs):
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                self._show(state.log_history[-1])
            super().on_step_end(args, state, control, **kwargs)

    return TerseProgressCallback


def use_terse_progress(trainer) -> None:
    """Replace the trainer's progress bar by one that shows the latest metrics after the bar (no printed log lines)."""
    from transformers import ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_terse_progress_callback_class()())
