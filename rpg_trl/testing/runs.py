# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Short RPG runs on a CPU with a tiny local Qwen3 ([`rpg_trl.testing.models`]), for the library's tests and a user's
tests of an RPG set-up: the training arguments of a short, quiet run ([`tiny_run_args`]), its prompts and reward
([`PROMPTS`], [`count_sevens`]), the trainer itself ([`make_trainer`]) and a scored off-policy batch that feeds the
loss directly ([`fixed_inputs`]); the model and data of a math-task run ([`save_math_assets`]).
"""

from __future__ import annotations

import json
import string

import torch
from datasets import Dataset

from .models import build_char_tokenizer, save_tiny_model
from .training import no_activation_checkpointing


#: 100 "a+b=" prompts, all covered by the default character tokenizer ([`build_char_tokenizer`]).
PROMPTS = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})


def quiet_cpu_args(output_dir, **overrides) -> dict:
    """`RPGConfig` keyword arguments of a short CPU run that logs every step with seed 0 and writes nothing else (no
    report, no checkpoint, no progress bar); `overrides` add to or replace them."""
    return {
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }


def tiny_run_args(output_dir, **overrides) -> dict:
    """[`quiet_cpu_args`] of a 2-step run on the tiny Qwen3: 2 groups of 4 completions of 8 tokens per step,
    learning rate 1e-2, no gradient checkpointing; `overrides` add to or replace them."""
    defaults = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        **no_activation_checkpointing(),
        learning_rate=1e-2,
    )
    return quiet_cpu_args(output_dir, **{**defaults, **overrides})


def count_sevens(completions, **kwargs):
    """An obvious reward: the fraction of '7' characters in an 8-character completion."""
    return [c.count("7") / 8 for c in completions]


def make_trainer(model_dir, tmp_path, trainer_cls=None, config_cls=None, reward=count_sevens, **overrides):
    """A trainer (`RPGTrainer` by default, or e.g. TRL's `GRPOTrainer` with `GRPOConfig`) of a [`tiny_run_args`] run
    on the tiny model in `model_dir`, with the [`PROMPTS`] and the character tokenizer."""
    from rpg_trl import RPGConfig, RPGTrainer

    args = (config_cls or RPGConfig)(**tiny_run_args(tmp_path, **overrides))
    return (trainer_cls or RPGTrainer)(
        model_dir, reward, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )


def policy_logps(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The trainer's per-token log-probs of the completion tokens under its current model (no gradient), (B, T)."""
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1),
        )[0]


def fixed_inputs(trainer, batch_size=8, completion_len=6, seed=0, spread=0.5):
    """A scored batch in the format `GRPOTrainer._compute_loss` receives, off-policy: π_old and π_ref are the
    current policy's log-probs shifted by independent uniform noise in [-spread, spread] (spread 0.2 keeps every
    importance weight inside RPG-Style Clip's trust region [0.8, 1.28]); ragged completions."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.processing_class.vocab_size
    prompt_ids = torch.randint(2, vocab, (batch_size, 4), generator=g)
    completion_ids = torch.randint(2, vocab, (batch_size, completion_len), generator=g)
    completion_mask = torch.ones(batch_size, completion_len, dtype=torch.long)
    for i in range(batch_size):
        completion_mask[i, completion_len - (i % 4) :] = 0
    logps = policy_logps(trainer, prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask)

    def noise():
        return (2 * torch.rand(logps.shape, generator=g) - 1) * spread

    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch_size, generator=g),
        "old_per_token_logps": logps + noise(),
        "ref_per_token_logps": logps + noise(),
        "num_items_in_batch": completion_mask.sum(),
    }


def save_math_assets(root) -> dict:
    """The inputs of a run of the math task (`rpg_trl.math_task`: the paper's prompt, `problem`/`question` and
    `answer` columns, as the project's example `rpg_math.py` reads them), written under the folder `root` (a
    `pathlib.Path`): a tiny Qwen3 whose character tokenizer covers the paper's prompt (`model`), 24 "What is a+b?" training problems (`train.jsonl`) and 4 "What is a*2?"
    evaluation problems (`tiny_eval.jsonl`). Returns their paths by those names (the tiny model answers wrong; fine)."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = build_char_tokenizer(string.printable)
    # One token per character, newlines included (the prompt has blank lines).
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    model = save_tiny_model(root / "model", tokenizer=tokenizer, max_position_embeddings=512)
    train = root / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"problem": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n"
            for a in range(1, 9)
            for b in range(1, 4)
        )
    )
    evaluation = root / "tiny_eval.jsonl"
    evaluation.write_text(
        "".join(json.dumps({"question": f"What is {a}*2?", "answer": str(2 * a)}) + "\n" for a in range(1, 5))
    )
    return {"root": root, "model": model, "train": str(train), "eval": str(evaluation)}
