# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Held-out accuracy on the addition task, as a function and as a trainer callback that logs it."""

from __future__ import annotations

import functools

from .addition import MAX_COMPLETION_LENGTH, addition_reward, prompt_of


def heldout_accuracy(model, tokenizer, pairs, *, num_samples: int = 4, greedy: bool = False, seed: int = 0) -> float:
    """
    Accuracy of `model` on the problems `pairs`.

    With `greedy=False`: the mean, over problems and over `num_samples` completions per problem sampled at
    temperature 1.0 without top-k/top-p filtering, of [`addition_reward`] (mean@k). With `greedy=True`: the fraction
    of problems whose greedy completion is right. Sampling uses its own seeded random stream, so evaluating does not
    change the training run, and evaluating the same model twice gives the same number.
    """
    import torch
    from transformers import GenerationConfig

    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to evaluate.")
    config = GenerationConfig(
        max_new_tokens=MAX_COMPLETION_LENGTH,
        do_sample=not greedy,
        temperature=1.0 if not greedy else None,
        top_k=None,
        top_p=None,
        num_return_sequences=1 if greedy else num_samples,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    was_training = model.training
    model.eval()
    try:
        inputs = tokenizer([prompt_of(a, b) for a, b in pairs], return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            output = model.generate(**inputs, generation_config=config)
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        model.train(was_training)
    repeats = len(texts) // len(pairs)
    solutions = [str(a + b) for a, b in pairs for _ in range(repeats)]
    rewards = addition_reward(texts, solutions)
    return sum(r or 0.0 for r in rewards) / len(rewards)


@functools.cache
def _held_out_accuracy_callback_class():
    """The callback class, defined on first use (importing `transformers.trainer` takes seconds)."""
    from transformers import TrainerCallback

    class HeldOutAccuracyCallback(TrainerCallback):
        """Evaluates [`heldout_accuracy`] at the start of training and every `every` steps, and appends it to the
        trainer's `log_history`.

        The entries (``{"heldout/accuracy": ..., "heldout/greedy_accuracy": ..., "step": ...}``) are saved in
        ``trainer_state.json`` with the training metrics, so ``rpg-trl plot`` draws them next to the reward; they are
        also kept in `curve`.
        """

        def __init__(self, model, tokenizer, pairs, *, every: int, num_samples: int, seed: int):
            self.model, self.tokenizer, self.pairs = model, tokenizer, pairs
            self.every, self.num_samples, self.seed = every, num_samples, seed
            self.curve: list[dict] = []

        def evaluate(self, state):
            sampled = heldout_accuracy(
                self.model, self.tokenizer, self.pairs, num_samples=self.num_samples, seed=self.seed
            )
            greedy = heldout_accuracy(self.model, self.tokenizer, self.pairs, greedy=True)
            entry = {"heldout/accuracy": sampled, "heldout/greedy_accuracy": greedy, "step": state.global_step}
            self.curve.append(entry)
            state.log_history.append(entry)

        def on_train_begin(self, args, state, control, **kwargs):
            self.evaluate(state)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % self.every == 0 or state.global_step == state.max_steps:
                self.evaluate(state)

    return HeldOutAccuracyCallback


def heldout_accuracy_callback(model, tokenizer, pairs, *, every: int, num_samples: int = 4, seed: int = 0):
    """A trainer callback that tracks [`heldout_accuracy`] of `model` on `pairs` every `every` steps (and at step 0)."""
    return _held_out_accuracy_callback_class()(
        model, tokenizer, pairs, every=every, num_samples=num_samples, seed=seed
    )
