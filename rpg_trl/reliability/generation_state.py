# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Exact resume from a checkpoint taken inside a generation cycle.

TRL's [`~trl.GRPOTrainer`] generates one batch every `steps_per_generation * num_iterations` micro-steps and keeps
it in `_buffered_inputs` (with the old log-probs and advantages) for the micro-steps that follow; a micro-step counter,
`_step`, says which slice comes next. Neither is in a `transformers` checkpoint. Resuming from a checkpoint written in
the middle of a cycle, TRL 1.16 finds `_buffered_inputs is None` and `_step = 0`, generates a new batch from the
prompts the data loader yields at that point and restarts the cycle there: the resumed run trains on other
completions, with other old log-probs, than the run that was interrupted, and its later generation steps shift.

[`save_generation_state`] writes the micro-step counter and the buffered batch when the checkpoint falls inside a
cycle, next to the RNG state of each process (`rpg_generation_state.pt`, or `rpg_generation_state_{rank}.pt` with
several processes); [`load_generation_state`] puts them back when resuming, so the resumed run continues with the very
batch the interrupted one was using. (Dynamic sampling saves where its replacement prompts continue itself:
[`~rpg_trl.dynamic_sampling.DynamicSamplingMixin`].) [`~rpg_trl.reliability.ReliabilityMixin`] calls them from
`_save_rng_state` and `_load_rng_state`,
so they follow the RNG state: written unless `save_only_model=True`, read when `resume_from_checkpoint` is given
(unless `ignore_data_skip=True`, which gives up exact resumption anyway).
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

#: File name, inside a checkpoint folder, of the generation state of a single-process run.
GENERATION_STATE_FILE = "rpg_generation_state.pt"


def generation_state_path(checkpoint: str, process_index: int, world_size: int) -> str:
    """The file of process `process_index` (named like transformers' `rng_state[_{rank}].pth`)."""
    name = GENERATION_STATE_FILE if world_size <= 1 else f"rpg_generation_state_{process_index}.pt"
    return os.path.join(checkpoint, name)


def _generate_every(trainer) -> int:
    return trainer.args.steps_per_generation * trainer.num_iterations


def save_generation_state(trainer, output_dir: str) -> None:
    """Write `trainer`'s micro-step counter and, inside a generation cycle, its buffered generation batch into the
    checkpoint folder `output_dir`. Called on every process (each writes its own file)."""
    step = int(trainer._step)
    inside_cycle = step % _generate_every(trainer) != 0 and trainer._buffered_inputs is not None
    state = {
        "step": step,
        "world_size": trainer.args.world_size,
        "steps_per_generation": trainer.args.steps_per_generation,
        "num_iterations": trainer.num_iterations,
        # At a cycle boundary the next micro-step generates anew: the buffer is not needed.
        "buffered_inputs": trainer._buffered_inputs if inside_cycle else None,
        # kl_estimate="vocabulary": the anchor's head copied at generation, which the buffered batch's anchor states
        # need (rpg_trl.vocabulary_kl); None where the live head serves.
        "anchor_heads": getattr(trainer, "_vocabulary_anchor_heads", None) if inside_cycle else None,
    }
    os.makedirs(output_dir, exist_ok=True)
    torch.save(state, generation_state_path(output_dir, trainer.args.process_index, trainer.args.world_size))


def load_generation_state(trainer, checkpoint: str | None) -> bool:
    """Restore the micro-step counter and the buffered generation batch saved by [`save_generation_state`].

    Returns `True` when restored. When the checkpoint has no (usable) generation state, logs a warning if it was taken
    inside a generation cycle (the resumed run then regenerates, which is not an exact continuation) and returns
    `False`.
    """
    if checkpoint is None:
        return False
    args = trainer.args
    path = generation_state_path(checkpoint, args.process_index, args.world_size)
    inside_cycle = (trainer.state.global_step * args.gradient_accumulation_steps) % _generate_every(trainer) != 0

    def fall_back(reason: str) -> bool:
        if inside_cycle:
            logger.warning(
                f"Resuming from {checkpoint}, taken inside a generation cycle (step {trainer.state.global_step}, "
                f"generation every {_generate_every(trainer)} micro-steps), but {reason}. The buffered completions "
                "are lost: a new batch is generated now, so the resumed run does not continue the interrupted one "
                "exactly."
            )
        return False

    if not os.path.isfile(path):
        return fall_back(f"it has no {os.path.basename(path)} (not written by RPGTrainer)")
    device = torch.device(trainer.accelerator.device)
    # A multi-process CPU run's device is `cpu:{rank}`, which `torch.load` cannot map to: load those onto "cpu".
    map_location = "cpu" if device.type == "cpu" else device
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # e.g. a buffer holding images, which `weights_only` refuses
        return fall_back(f"{path} could not be read ({type(exc).__name__}: {exc})")
    saved = (state.get("world_size"), state.get("steps_per_generation"), state.get("num_iterations"))
    current = (args.world_size, args.steps_per_generation, trainer.num_iterations)
    if saved != current:
        return fall_back(
            f"it was written with (world_size, steps_per_generation, num_iterations) = {saved}, not {current}"
        )
    trainer._step = int(state["step"])
    trainer._buffered_inputs = state["buffered_inputs"]
    if state.get("anchor_heads") is not None:
        trainer._vocabulary_anchor_heads = state["anchor_heads"]
    return True
