# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The long-addition task of ``rpg-trl demo --task long_addition``: four-digit additions worked out row by row.

The prompt is ``a+b=`` (1000 ≤ a, b ≤ 9999). The completion writes the addition out as a pupil does, one row per
column from the units up, then the answer line ([`worked_solution`]); for ``4829+3716=``::

    4829+3716:9+6+0=15:5...
    .482+.371:2+1+1=04:45..
    ..48+..37:8+7+0=15:545.
    ...4+...3:4+3+1=08:8545
    Answer: 8545

Row ``i`` holds the operands with their ``i`` last digits struck off (shifted right, ``.`` on the left), the
column's two digits (the operands' last digits on the row) and the carry coming in (the first digit of the row
above's sum), the two-digit column sum, and the result so far (the sum's units digit, then the row above's result).
Every character is a copy at a fixed distance (the row above, shifted by one) or a sum of digits on its own row, so a
447k-parameter model learns the procedure in minutes on a CPU; a layout that leaves the operands in the prompt asks it
to find the i-th digit of each, which it learned far more slowly (seen while designing the task; no command here
measures it). Four rows of 24 characters, ``"Answer: "``, four or
five digits and the end-of-sequence token: 109-110 tokens with the character tokenizer, where the two-digit demo
writes 3-4. Only the answer line is scored, by the project's math-verify reward ([`long_addition_reward`]); the rows
are how the model gets there, and a slip in any of them carries through to the answer.

The warm start ([`warm_start`], [`build_sft_dataset`]) learns from worked solutions of which a fraction
[`SFT_SLIP_RATE`] contain one slip: a column sum off by one, carried through consistently to the answer, as a pupil
who miscounts once. The model learns the procedure and, with it, a rate of slips per column: it ranks the right answer
first (high greedy accuracy) and samples it far less often, and there is room for RL to sharpen.

[`build_model`] builds the task's Qwen3 at one of the sizes of [`MODEL_SIZES`]: ``"small"`` for a CPU,
``"large"`` for a GPU run, the same code. Splits ([`make_splits`]) draw disjoint problems per seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .addition import prompt_of


#: Digits of each operand.
NUM_DIGITS = 4
#: Architectures of the task's model, by size: ``"small"`` trains on a CPU in minutes, ``"large"`` is for a GPU run.
MODEL_SIZES = {
    "small": {
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "max_position_embeddings": 128,
    },
    "large": {
        "hidden_size": 384,
        "num_hidden_layers": 8,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 1152,
        "max_position_embeddings": 128,
    },
}
#: Fraction of the warm start's worked solutions with one slip (a column sum off by one, carried through).
SFT_SLIP_RATE = 0.6
#: Supervised steps (batch 32) of the warm start, and the problems drawn for it by default (one epoch of them).
SFT_STEPS = 400
NUM_SFT_PROBLEMS = 32 * SFT_STEPS
#: Characters of a row of the worked solution, its line break included (see [`worked_solution`]).
ROW_LENGTH = 3 * NUM_DIGITS + 12
#: Longest completion: the rows, ``"Answer: "``, ``NUM_DIGITS + 1`` digits and the end-of-sequence token.
MAX_COMPLETION_LENGTH = NUM_DIGITS * ROW_LENGTH + len("Answer: ") + NUM_DIGITS + 1 + 1
#: Longest prompt plus completion, in tokens (the warm start's `max_length`).
MAX_LENGTH = 2 * NUM_DIGITS + 2 + MAX_COMPLETION_LENGTH


@dataclass
class LongAdditionSplits:
    """Disjoint sets of ``(a, b)`` problems: supervised warm start, RL prompts, held-out evaluation."""

    sft: list[tuple[int, int]]
    rl: list[tuple[int, int]]
    eval: list[tuple[int, int]]


def make_splits(
    seed: int, num_eval: int = 400, num_rl: int = 4000, num_sft: int = NUM_SFT_PROBLEMS
) -> LongAdditionSplits:
    """Draw `num_eval + num_rl + num_sft` distinct problems of two operands of [`NUM_DIGITS`] digits with `seed` and split them
    into held-out, RL and supervised pools (disjoint: no problem is in two of them)."""
    for name, value in (("num_eval", num_eval), ("num_rl", num_rl), ("num_sft", num_sft)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
    rng = random.Random(seed)
    low, high = 10 ** (NUM_DIGITS - 1), 10**NUM_DIGITS - 1
    seen: set[tuple[int, int]] = set()
    pairs = []
    while len(pairs) < num_eval + num_rl + num_sft:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return LongAdditionSplits(
        eval=pairs[:num_eval], rl=pairs[num_eval : num_eval + num_rl], sft=pairs[num_eval + num_rl :]
    )


def worked_solution(a: int, b: int, slip: tuple[int, int] | None = None) -> str:
    """
    The completion of problem ``(a, b)``: one row per column, units first, then ``Answer: <sum>`` (see the module
    docstring). Row ``i`` reads ``A+B:x+y+c=ss:R``: the operands with their ``i`` last digits struck off (shifted
    right, ``.`` on the left), the column's digits ``x`` and ``y`` (the operands' last digits on the row), the carry
    ``c`` coming in (the first digit of the row above's sum), the two-digit column sum ``ss``, and the result so far
    ``R`` (the units digit of ``ss`` followed by the row above's ``R``, ``.`` on the right). The answer is the last
    carry, if any, followed by the last row's ``R``.

    `slip` ``(column, offset)`` writes that column's sum off by `offset` (±1); the carry, the results and the answer
    follow from the written sum, so the answer is wrong by ``offset · 10^column`` and consistent with the steps.
    """
    low, high = 10 ** (NUM_DIGITS - 1), 10**NUM_DIGITS
    if not (low <= a < high and low <= b < high):
        raise ValueError(f"Both operands must have {NUM_DIGITS} digits; got {a} and {b}.")
    rows, result, carry = [], "", 0
    for column in range(NUM_DIGITS):
        x, y = a // 10**column % 10, b // 10**column % 10
        total = x + y + carry
        if slip is not None and slip[0] == column:
            total += slip[1]
            if not 0 <= total <= 19:
                raise ValueError(f"A slip of {slip[1]:+d} in column {column} gives the sum {total}, outside 0-19.")
        result = str(total % 10) + result
        operands = "+".join(str(n // 10**column).rjust(NUM_DIGITS, ".") for n in (a, b))
        rows.append(f"{operands}:{x}+{y}+{carry}={total:02d}:{result.ljust(NUM_DIGITS, '.')}")
        carry = total // 10
    return "\n".join([*rows, f"Answer: {'1' if carry else ''}{result}"])


def random_slip(rng: random.Random) -> tuple[int, int]:
    """A slip for [`worked_solution`]: a uniformly drawn column and an offset of −1 or +1."""
    return rng.randrange(NUM_DIGITS), rng.choice((-1, 1))


def noisy_solution(a: int, b: int, rng: random.Random, slip_rate: float) -> str:
    """[`worked_solution`] of ``(a, b)``, with probability `slip_rate` with one slip ([`random_slip`]; an
    offset that would leave the column's sum outside 0-19 is flipped)."""
    if rng.random() >= slip_rate:
        return worked_solution(a, b)
    column, offset = random_slip(rng)
    try:
        return worked_solution(a, b, (column, offset))
    except ValueError:
        return worked_solution(a, b, (column, -offset))


def build_sft_dataset(pairs, seed: int, slip_rate: float = SFT_SLIP_RATE):
    """Prompt-completion dataset of the warm start: one worked solution per problem of `pairs`, a fraction
    `slip_rate` of them with one slip ([`noisy_solution`], drawn once with `seed`)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list(
        [{"prompt": prompt_of(a, b), "completion": noisy_solution(a, b, rng, slip_rate)} for a, b in pairs]
    )


def build_rl_dataset(pairs):
    """Prompt-only dataset of the RL phase, with the exact sum in the ``solution`` column read by the reward."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_of(a, b), "solution": str(a + b)} for a, b in pairs])


def long_addition_reward(completions: list[str], solution: list[str], **kwargs) -> list[float | None]:
    """
    Reward of the task: 1.0 when the completion's answer line gives the right sum, else 0.0; the steps are not checked.

    The answer is the one the project's math-verify reward reads ([`rpg_trl.math_task.rewards.extract_answer`]: the
    last ``Answer:`` line); it is scored by [`rpg_research.toy.addition.addition_reward`], which compares an answer
    of digits only as an integer (math-verify's verdict on it) and sends anything else to math-verify
    ([`rpg_trl.math_task.rewards.accuracy_reward`]). A completion without an answer line scores 0.0.
    """
    from rpg_trl.math_task.rewards import extract_answer

    from .addition import addition_reward

    answers = [extract_answer(completion) for completion in completions]
    scored = [i for i, answer in enumerate(answers) if answer is not None]
    rewards: list[float | None] = [0.0] * len(completions)
    verdicts = addition_reward([answers[i] for i in scored], [solution[i] for i in scored])
    for i, reward in zip(scored, verdicts):
        rewards[i] = reward
    return rewards


def build_model(seed: int, size: str = "small"):
    """The task's character tokenizer and randomly initialised Qwen3 of `size` ([`MODEL_SIZES`])."""
    from .models import build_sized_model

    return build_sized_model(seed, MODEL_SIZES, size)


def warm_start(
    splits: LongAdditionSplits, output_dir: str, *, steps: int, seed: int, size: str = "small", device: str = "cpu"
):
    """
    Build the task's model ([`build_model`]), train it with [`~trl.SFTTrainer`] for `steps` steps on the worked
    solutions of ``splits.sft`` ([`build_sft_dataset`]; the preset of [`rpg_research.toy.training.sft_config`]), and
    save it with its trainer state in `output_dir`. There is no readiness check: the held-out accuracy the demo
    measures next is the warm start's result.

    Returns:
        `(model, tokenizer, WarmStartReport)` (one round, no check accuracy).
    """
    from .warm_start import supervised_warm_start

    model, tokenizer = build_model(seed, size)
    return supervised_warm_start(
        model,
        tokenizer,
        lambda: build_sft_dataset(splits.sft, seed),
        output_dir,
        steps=steps,
        seed=seed,
        max_length=MAX_LENGTH,
        device=device,
    )
