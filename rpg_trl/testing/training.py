# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Training settings of CPU runs, for the library's tests and a user's tests of an RPG set-up (the research package's
demo and benchmarks use them too): the activation-checkpointing argument in the installed transformers' spelling
([`activation_checkpointing`]), and deterministic rollouts that replace generation, so that trainers can be compared
(or timed) on the same batches ([`make_fixed_rollout`]).
"""

from __future__ import annotations

import functools


@functools.cache
def activation_checkpointing(enabled: bool) -> dict:
    """
    The training argument that turns activation checkpointing on or off, in the spelling of the installed
    transformers: `activation_checkpointing` from the release that introduced it (`gradient_checkpointing` is its
    deprecated alias there), `gradient_checkpointing` before (e.g. 5.17, the newest that vLLM 0.31 accepts).
    """
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}


def no_activation_checkpointing() -> dict:
    """[`activation_checkpointing`] off: the setting of every CPU run of the tests (and of the research package's demo
    and benchmarks)."""
    return activation_checkpointing(False)


def make_fixed_rollout(completion_length: int, vocab_low: int, vocab_high: int, seed: int = 0):
    """A deterministic TRL `rollout_func`: each prompt text maps to fixed completions of `completion_length` tokens, so
    that trainers can be compared (or timed) on the same batches.

    The k-th occurrence of a prompt in a process's batch gets the k-th completion of that prompt, so the groups of
    `num_generations` completions differ within a group and are identical across runs, trainers and batch layouts.
    Token ids are drawn from `[vocab_low, vocab_high)` (choose a range without EOS/pad so every completion is full).
    """
    import zlib

    import torch

    def rollout(prompts, trainer):
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            text = (
                prompt
                if isinstance(prompt, str)
                else trainer.processing_class.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            )
            k = seen.get(text, 0)
            seen[text] = k + 1
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(text.encode()) * 101 + k)
            prompt_ids.append(trainer.processing_class(text, add_special_tokens=False)["input_ids"])
            ids = torch.randint(vocab_low, vocab_high, (completion_length,), generator=generator)
            completion_ids.append(ids.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout
