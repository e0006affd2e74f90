# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The addition task of ``rpg-trl demo`` and the benchmarks: two-digit additions ``a+b=``, scored by exact match.

The 8100 problems (10 ≤ a, b ≤ 99) are split, once per seed, into a held-out evaluation set (never trained on), an RL
prompt pool and a supervised pool ([`make_splits`]). The supervised rows carry noisy labels ([`build_sft_dataset`]);
the RL rows carry the exact sum, read by [`addition_reward`]. [`build_model`] builds the task's ~0.45M-parameter
Qwen3 with a character tokenizer ([`rpg_research.toy.models`]).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


#: Architecture of the demo model: a 3-layer Qwen3 with grouped-query attention, ~0.45M parameters.
DEMO_MODEL_KWARGS = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 32,
}
#: Operands of the task: two-digit numbers.
OPERAND_RANGE = range(10, 100)
#: Label noise of the warm start: each wrong label is the sum shifted by one of these offsets.
NOISE_OFFSETS = (-1, 1, -10, 10)
#: Fraction of wrong labels in the warm start, and fraction of its rows that have a one-digit operand.
SFT_LABEL_NOISE = 0.5
SFT_EASY_FRACTION = 0.7
#: Longest completion: three digits and the end-of-sequence token.
MAX_COMPLETION_LENGTH = 4


@dataclass
class AdditionSplits:
    """Disjoint sets of ``(a, b)`` problems: supervised warm start, RL prompts, held-out evaluation."""

    sft: list[tuple[int, int]]
    rl: list[tuple[int, int]]
    eval: list[tuple[int, int]]


def shuffled_pools(problems: list, seed: int, num_eval: int, num_rl: int) -> tuple[list, list, list]:
    """`problems` shuffled with `seed` (in place) and cut into ``(held-out, RL, supervised)`` pools: the first
    `num_eval`, the next `num_rl`, the rest, which must not be empty."""
    if num_eval + num_rl >= len(problems):
        raise ValueError(
            f"`num_eval + num_rl` must leave problems for the warm start (< {len(problems)}); got {num_eval} + {num_rl}."
        )
    random.Random(seed).shuffle(problems)
    return problems[:num_eval], problems[num_eval : num_eval + num_rl], problems[num_eval + num_rl :]


def make_splits(seed: int, num_eval: int = 400, num_rl: int = 1600) -> AdditionSplits:
    """Shuffle the 8100 two-digit problems with `seed` and split them into held-out, RL and supervised pools."""
    held_out, rl, sft = shuffled_pools([(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE], seed, num_eval, num_rl)
    return AdditionSplits(eval=held_out, rl=rl, sft=sft)


def prompt_of(a: int, b: int) -> str:
    """The prompt of problem ``(a, b)``: ``"a+b="``."""
    return f"{a}+{b}="


def noisy_sum(a: int, b: int, rng: random.Random, label_noise: float) -> int:
    """``a + b``, or with probability `label_noise` the sum shifted by ±1 or ±10 (kept non-negative)."""
    total = a + b
    if rng.random() < label_noise:
        total += rng.choice([offset for offset in NOISE_OFFSETS if total + offset >= 0])
    return total


def build_sft_dataset(
    pairs, seed: int, label_noise: float = SFT_LABEL_NOISE, easy_fraction: float = SFT_EASY_FRACTION
):
    """
    Prompt-completion dataset of the warm start.

    One row per problem of `pairs`, labelled with [`noisy_sum`] (the noise is drawn once, so the model sees a fixed
    wrong label for half of the problems), plus additions with a one-digit operand (``7+45=``, ``45+7=``), equally
    noisy, so that they make up `easy_fraction` of the rows (default 0.7: 7 easy rows for 3 two-digit ones). The easy
    rows are a curriculum: they teach the digit sums and the carry, and make the moment the model starts to
    generalise to two-digit problems earlier and far less dependent on the seed (measured on 9 seeds: 500-1250 steps
    with 0.7, versus 300 to more than 2000 with no easy rows).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [{"prompt": prompt_of(a, b), "completion": str(noisy_sum(a, b, rng, label_noise))} for a, b in pairs]
    easy = [(a, b) for a in range(1, 100) for b in range(1, 10)] + [
        (b, a) for a in range(10, 100) for b in range(1, 10)
    ]
    num_easy = round(len(rows) * easy_fraction / (1.0 - easy_fraction)) if easy_fraction < 1.0 else 0
    for _ in range(num_easy):
        a, b = easy[rng.randrange(len(easy))]
        rows.append({"prompt": prompt_of(a, b), "completion": str(noisy_sum(a, b, rng, label_noise))})
    rng.shuffle(rows)
    return Dataset.from_list(rows)


def build_rl_dataset(pairs):
    """Prompt-only dataset of the RL phase, with the exact sum in the ``solution`` column read by the reward."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_of(a, b), "solution": str(a + b)} for a, b in pairs])


def addition_reward(completions: list[str], solution: list[str], **kwargs) -> list[float | None]:
    """
    Exact-match reward of the task: 1.0 when the completion is the right sum, else 0.0.

    The prompt ``"a+b="`` asks for the bare number, so the completion is scored as the answer line ``Answer: <c>``
    by [`rpg_trl.math_task.rewards.accuracy_reward`] (math-verify): ``"57"`` and ``"057"`` both match ``57``. A
    completion made of digits only (nearly all of them) is compared as an integer, which is math-verify's verdict on
    it (``research/tests/test_demo.py::test_addition_reward_digits_agree_with_math_verify``) at a thousandth of its cost; the
    rest go to math-verify.
    """
    from rpg_trl.math_task.rewards import accuracy_reward

    rewards: list[float | None] = [None] * len(completions)
    rest = []
    for i, (completion, answer) in enumerate(zip(completions, solution, strict=True)):
        if completion.isascii() and completion.isdigit() and str(answer).isdigit():
            rewards[i] = 1.0 if int(completion) == int(answer) else 0.0
        else:
            rest.append(i)
    if rest:
        verified = accuracy_reward([f"Answer: {completions[i]}" for i in rest], [solution[i] for i in rest])
        for i, reward in zip(rest, verified):
            rewards[i] = reward
    return rewards


def evaluation_seed(seed: int) -> int:
    """Seed of the held-out sampling of run `seed` (fixed, so that before/after and all methods see the same draws)."""
    return seed + 10_000


def build_model(seed: int):
    """The task's tokenizer and randomly initialised ~0.45M-parameter Qwen3 ([`DEMO_MODEL_KWARGS`])."""
    from .models import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, seed=seed, **DEMO_MODEL_KWARGS)
    return model, tokenizer
