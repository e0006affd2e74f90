# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Checks of what enters a run: datasets without prompts, over-long sequences.

* **Datasets** ([`check_prompt_column`]): a training or evaluation dataset without a `prompt` column is refused when
  the trainer is built, instead of a `KeyError` at the first generation.
* **Long prompts**: TRL 1.16 has no `max_prompt_length` and never truncates prompts; [`check_sequence_length`] warns
  once when a prompt plus `max_completion_length` exceeds the model's `max_position_embeddings`.
"""

from __future__ import annotations

from transformers.utils import logging


logger = logging.get_logger(__name__)


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
