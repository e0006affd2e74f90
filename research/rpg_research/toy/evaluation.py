# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Held-out accuracy on the addition task, as a function and as a trainer callback that logs it."""

from __future__ import annotations

import functools

from .addition import MAX_COMPLETION_LENGTH, addition_reward, prompt_of


def problem_prompt(problem) -> str:
    """The prompt of `problem`: its ``prompt`` where it has one (a ring walk's
    [`rpg_research.toy.ring_walk.WalkProblem`]), else ``"a+b="`` for an addition ``(a, b)``."""
    prompt = getattr(problem, "prompt", None)
    return prompt if isinstance(prompt, str) else prompt_of(*problem)


def problem_solution(problem) -> str:
    """What the task's reward reads of `problem` (its ``solution`` column): its ``solution`` where it has one, else
    the sum ``a + b`` of an addition."""
    solution = getattr(problem, "solution", None)
    return solution if isinstance(solution, str) else str(problem[0] + problem[1])


def _sample(model, tokenizer, pairs, *, num_samples: int, greedy: bool, seed: int, max_new_tokens: int):
    """`model`'s completions for the problems `pairs` (left-padded prompts), at temperature 1.0 without top-k/top-p
    filtering, `num_samples` per problem (one greedy completion with `greedy`), from their own seeded random stream, in
    eval mode (the mode is restored); returns the tokenized prompts and the generated ids (prompt + completion)."""
    import torch
    from transformers import GenerationConfig

    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to evaluate.")
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
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
        inputs = tokenizer([problem_prompt(p) for p in pairs], return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return inputs, model.generate(**inputs, generation_config=config)
    finally:
        model.train(was_training)


def heldout_scores(
    model,
    tokenizer,
    pairs,
    reward_funcs: dict,
    *,
    num_samples: int = 4,
    greedy: bool = False,
    seed: int = 0,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
) -> dict[str, float]:
    """
    Mean score of `model`'s completions on the problems `pairs` under each reward function of `reward_funcs` (name ->
    `f(completions, solution)`, TRL's reward-function signature), all on the same completions.

    With `greedy=False`: the mean, over problems and over `num_samples` completions per problem sampled at
    temperature 1.0 without top-k/top-p filtering, of each reward (mean@k). With `greedy=True`: the mean over problems
    of the reward of the greedy completion. At most `max_new_tokens` tokens are generated. Sampling uses its own seeded
    random stream, so evaluating does not change the training run, and evaluating the same model twice gives the same
    numbers.
    """
    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to evaluate.")
    if not reward_funcs:
        raise ValueError("`reward_funcs` is empty: name at least one reward function to score the completions with.")
    inputs, output = _sample(
        model, tokenizer, pairs, num_samples=num_samples, greedy=greedy, seed=seed, max_new_tokens=max_new_tokens
    )
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    repeats = len(texts) // len(pairs)
    solutions = [problem_solution(p) for p in pairs for _ in range(repeats)]
    scores = {}
    for name, reward_func in reward_funcs.items():
        rewards = reward_func(texts, solutions)
        scores[name] = sum(r or 0.0 for r in rewards) / len(rewards)
    return scores


def token_kl_to_reference(
    model,
    reference,
    tokenizer,
    pairs,
    *,
    num_samples: int = 4,
    seed: int = 0,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
) -> float:
    """
    The token-level reverse KL from `model` (π_θ) to `reference` (π_ref) on its own completions: the mean, over the
    tokens of `num_samples` completions per problem of `pairs` sampled from π_θ at temperature 1 (up to and including
    the end token), of the exact KL(π_θ(·|prefix) ‖ π_ref(·|prefix)) over the whole vocabulary at that position. It
    is measured the same way whatever the trainer's regulariser (a comparable number for every arm of a benchmark),
    and, summed over a completion's tokens instead of averaged, its expectation is the KL between whole completions.
    Sampling uses its own seeded random stream.
    """
    _, completion_mask, (log_p, log_q) = _completion_log_probs(
        [model, reference], tokenizer, pairs, num_samples=num_samples, seed=seed, max_new_tokens=max_new_tokens
    )
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = completion_mask.to(kl.dtype)
    return float((kl * mask).sum() / mask.sum().clamp(min=1.0))


def _completion_log_probs(models, tokenizer, pairs, *, num_samples: int, seed: int, max_new_tokens: int):
    """`num_samples` completions per problem of `pairs` sampled from ``models[0]`` at temperature 1 ([`_sample`]),
    and the log-probabilities over the vocabulary that each of `models` gives at each completion position. Returns
    the completions' ids `(n, T)`, their mask `(n, T)` (the tokens up to and including the first end token) and one
    `(n, T, V)` float tensor per model."""
    import torch

    inputs, output = _sample(
        models[0], tokenizer, pairs, num_samples=num_samples, greedy=False, seed=seed, max_new_tokens=max_new_tokens
    )
    prompt_length = inputs["input_ids"].shape[1]
    completion = output[:, prompt_length:]
    # The completion's tokens up to and including the first end token.
    is_eos = completion == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    completion_mask = ~after_eos
    prompt_mask = inputs["attention_mask"].repeat_interleave(num_samples, dim=0)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=-1)
    # Position p's logits predict token p + 1: the completion's tokens are predicted from prompt_length − 1 on.
    positions = slice(prompt_length - 1, output.shape[1] - 1)
    # Position ids that skip the left padding, as generation used them.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    def log_probs(m):
        was_training = m.training
        m.eval()
        try:
            logits = m(output, attention_mask=attention_mask, position_ids=position_ids).logits
        finally:
            m.train(was_training)
        return torch.log_softmax(logits[:, positions].float(), -1)

    with torch.no_grad():
        return completion, completion_mask, [log_probs(m) for m in models]


#: Entropy (nats) from which a completion token counts as uncertain in [`completion_statistics`].
UNCERTAIN_ENTROPY = 0.3


def completion_statistics(
    model,
    tokenizer,
    pairs,
    reward_func,
    *,
    num_samples: int = 4,
    seed: int = 0,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
    threshold: float = UNCERTAIN_ENTROPY,
) -> dict:
    """
    How uncertain `model`'s own completions are, and what they score: on `num_samples` completions per problem of
    `pairs` sampled at temperature 1 (the completions [`heldout_scores`] draws with the same `seed`), the entropy of
    the model's next-token distribution (temperature 1, the whole vocabulary) at each completion token, up to and
    including the end token.

    Returns:
        `uncertain_fraction` (the fraction of those tokens whose entropy is at least `threshold` nats),
        `entropy_mean` (nats per token), `tokens_mean` (tokens per completion, the end token included),
        `characters_mean` (characters of the decoded completion) and `reward_mean` (`reward_func`'s mean, i.e.
        [`heldout_scores`]'s mean@`num_samples`).
    """
    completion, mask, (log_p,) = _completion_log_probs(
        [model], tokenizer, pairs, num_samples=num_samples, seed=seed, max_new_tokens=max_new_tokens
    )
    entropy = -(log_p.exp() * log_p).sum(-1)[mask]
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    solutions = [problem_solution(p) for p in pairs for _ in range(num_samples)]
    rewards = reward_func(texts, solutions)
    return {
        "uncertain_fraction": float((entropy >= threshold).float().mean()),
        "entropy_mean": float(entropy.mean()),
        "tokens_mean": float(mask.sum()) / len(texts),
        "characters_mean": sum(map(len, texts)) / len(texts),
        "reward_mean": sum(r or 0.0 for r in rewards) / len(rewards),
        "threshold": threshold,
        "num_completions": len(texts),
    }


def heldout_accuracy(model, tokenizer, pairs, *, num_samples: int = 4, greedy: bool = False, seed: int = 0) -> float:
    """
    Accuracy of `model` on the problems `pairs` ([`heldout_scores`] with [`addition_reward`]).

    With `greedy=False`: the mean, over problems and over `num_samples` completions per problem sampled at
    temperature 1.0 without top-k/top-p filtering, of [`addition_reward`] (mean@k). With `greedy=True`: the fraction
    of problems whose greedy completion is right. Sampling uses its own seeded random stream, so evaluating does not
    change the training run, and evaluating the same model twice gives the same number.
    """
    scores = heldout_scores(
        model, tokenizer, pairs, {"accuracy": addition_reward}, num_samples=num_samples, greedy=greedy, seed=seed
    )
    return scores["accuracy"]


@functools.cache
def _held_out_accuracy_callback_class():
    """The callback class, defined on first use (importing `transformers.trainer` takes seconds)."""
    from transformers import TrainerCallback

    class HeldOutAccuracyCallback(TrainerCallback):
        """Evaluates [`heldout_scores`] (by default the accuracy, [`heldout_accuracy`]) at the start of training and
        every `every` steps, and appends it to the trainer's `log_history`.

        The entries (``{"heldout/accuracy": ..., "heldout/greedy_accuracy": ..., "step": ...}``, one
        ``heldout/<name>`` per reward function and the greedy score of the first) are saved in
        ``trainer_state.json`` with the training metrics, so ``rpg-trl plot`` draws them next to the reward; they are
        also kept in `curve`.
        """

        def __init__(
            self,
            model,
            tokenizer,
            pairs,
            *,
            every: int,
            num_samples: int,
            seed: int,
            reward_funcs=None,
            max_new_tokens=MAX_COMPLETION_LENGTH,
        ):
            self.model, self.tokenizer, self.pairs = model, tokenizer, pairs
            self.every, self.num_samples, self.seed = every, num_samples, seed
            self.reward_funcs = reward_funcs or {"accuracy": addition_reward}
            self.max_new_tokens = max_new_tokens
            self.curve: list[dict] = []

        def evaluate(self, state):
            scores = functools.partial(
                heldout_scores, self.model, self.tokenizer, self.pairs, max_new_tokens=self.max_new_tokens
            )
            sampled = scores(self.reward_funcs, num_samples=self.num_samples, seed=self.seed)
            first = next(iter(self.reward_funcs))
            greedy = scores({first: self.reward_funcs[first]}, greedy=True)[first]
            entry = {f"heldout/{name}": value for name, value in sampled.items()}
            entry.update({f"heldout/greedy_{first}": greedy, "step": state.global_step})
            self.curve.append(entry)
            state.log_history.append(entry)

        def on_train_begin(self, args, state, control, **kwargs):
            self.evaluate(state)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % self.every == 0 or state.global_step == state.max_steps:
                self.evaluate(state)

    return HeldOutAccuracyCallback


def heldout_accuracy_callback(
    model,
    tokenizer,
    pairs,
    *,
    every: int,
    num_samples: int = 4,
    seed: int = 0,
    reward_funcs: dict | None = None,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
):
    """
    A trainer callback that tracks [`heldout_accuracy`] of `model` on `pairs` every `every` steps (and at step 0), or,
    given `reward_funcs` (name -> reward function; the first named ``"accuracy"`` feeds the benchmarks' tables), each
    of their scores on the same completions of at most `max_new_tokens` tokens.
    """
    return _held_out_accuracy_callback_class()(
        model,
        tokenizer,
        pairs,
        every=every,
        num_samples=num_samples,
        seed=seed,
        reward_funcs=reward_funcs,
        max_new_tokens=max_new_tokens,
    )
