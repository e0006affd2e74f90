# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Fixed rollouts: a deterministic TRL `rollout_func`, so that trainers can be compared (or timed) on the same batches."""

from __future__ import annotations


def make_fixed_rollout(completion_length: int, vocab_low: int, vocab_high: int, seed: int = 0):
    """A deterministic TRL `rollout_func`: each prompt text maps to fixed completions of `completion_length` tokens.

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
