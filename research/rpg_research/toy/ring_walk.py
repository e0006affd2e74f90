# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ring-walk task of ``rpg-trl demo --task ring_walk``: long completions whose every token stays uncertain.

The alphabet ``a``-``z`` is a ring of [`RING_SIZE`] letters. A problem is a start letter ``s`` and a step
``k`` (1 ≤ k ≤ [`MAX_STEP`]); the prompt is ``"walk s k:"`` (``"walk d 3:"``). The completion is a walk of exactly
[`WALK_LENGTH`] letters, then the end-of-sequence token: the first letter is ``s`` and each next letter is the
previous one shifted by ``+k`` or ``−k`` around the ring (``d`` then ``g`` or ``a``, then ``j``, ``d`` or ``x``...).
Every such walk is right, so the best policy picks ``+k`` or ``−k`` freely: about log 2 ≈ 0.69 nats of entropy on
each of the 63 steps. Where the two long additions ([`rpg_research.toy.long_addition`]) copy most characters (a few
percent of their tokens are uncertain), here the tokens stay uncertain by construction, and RPG's importance weights
compound over a completion.

The true reward ([`ring_walk_reward`]) is the fraction of the 63 transitions that are valid, and 0.0 unless the
completion is exactly [`WALK_LENGTH`] characters (it stopped, with the end token, right after the last letter)
starting with ``s``. The flawed proxy of the KL table ([`rpg_research.toy.proxy.ring_walk_proxy_reward`]) pays for
letters written after the last one.

The warm start ([`warm_start`], [`build_sft_dataset`]) learns from walks whose steps are each a *slip* with
probability [`SFT_SLIP_RATE`] (a random letter other than the two valid ones; the walk goes on from it), a fraction
[`SFT_OVERRUN_RATE`] of them with 1-[`MAX_OVERRUN`] valid letters more after the last one (which the proxy then
has to exploit). Splits ([`make_splits`]) shuffle the 234 problems with the seed into disjoint held-out, RL and
supervised pools. [`build_model`] builds the task's Qwen3 at one of [`MODEL_SIZES`] (those of the long additions),
with a character tokenizer over the ring's letters, the digits, the space and the colon.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import NamedTuple

from .addition import shuffled_pools

# The task's model sizes are the long additions' (its "small" one trains on a CPU in minutes).
from .long_addition import MODEL_SIZES


#: Letters of the ring (``a`` onwards), and the largest step (below half the ring, so that +k and −k differ; one
#: digit: with steps up to 12, written in one or two digits, the warm start had not learned the walk after 300 steps).
RING_SIZE = 26
MAX_STEP = 9
RING = string.ascii_lowercase[:RING_SIZE]
#: Letters of a walk (the completion), the end token not counted.
WALK_LENGTH = 64
#: Probability that a step of a warm-start walk is a slip (a random letter that neither +k nor −k gives).
SFT_SLIP_RATE = 0.22
#: Fraction of the warm-start walks that go on for 1 to [`MAX_OVERRUN`] valid letters after the last one.
SFT_OVERRUN_RATE = 0.1
MAX_OVERRUN = 8
#: Supervised steps (batch 32) of the warm start.
SFT_STEPS = 400
#: Held-out and RL problems by default; the rest of the 234 are the warm start's (74 by default).
NUM_EVAL = 100
NUM_RL = 60
#: Copies of each RL problem in the RL dataset ([`build_rl_dataset`]): TRL draws a generation batch of 128 prompts
#: (16 optimizer steps of 8 prompts) and drops an incomplete one, which 60 problems alone would be.
RL_REPEATS = 8
#: The tokenizer's characters: the ring's letters, the digits, what the prompt writes.
ALPHABET = RING + string.digits + " :walk"
#: Longest completion: the walk and the end-of-sequence token.
MAX_COMPLETION_LENGTH = WALK_LENGTH + 1
#: Longest prompt plus completion of the warm start's data, overruns included (its `max_length`).
MAX_LENGTH = len(f"walk a {MAX_STEP}:") + WALK_LENGTH + MAX_OVERRUN + 1


class WalkProblem(NamedTuple):
    """One problem: the start letter's index on the ring and the step."""

    start: int
    step: int

    @property
    def prompt(self) -> str:
        """``"walk s k:"``."""
        return f"walk {RING[self.start]} {self.step}:"

    @property
    def solution(self) -> str:
        """What the reward reads: ``"s k"``."""
        return f"{RING[self.start]} {self.step}"


@dataclass
class RingWalkSplits:
    """Disjoint sets of problems: supervised warm start, RL prompts, held-out evaluation."""

    sft: list[WalkProblem]
    rl: list[WalkProblem]
    eval: list[WalkProblem]


def all_problems() -> list[WalkProblem]:
    """The ``RING_SIZE · MAX_STEP`` problems, in order."""
    return [WalkProblem(start, step) for start in range(RING_SIZE) for step in range(1, MAX_STEP + 1)]


def make_splits(seed: int, num_eval: int = NUM_EVAL, num_rl: int = NUM_RL) -> RingWalkSplits:
    """Shuffle the problems with `seed` and split them into held-out, RL and supervised pools (the rest)."""
    problems = all_problems()
    for name, value in (("num_eval", num_eval), ("num_rl", num_rl)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
    held_out, rl, sft = shuffled_pools(problems, seed, num_eval, num_rl)
    return RingWalkSplits(eval=held_out, rl=rl, sft=sft)


def noisy_walk(
    problem: WalkProblem,
    rng: random.Random,
    slip_rate: float = SFT_SLIP_RATE,
    overrun_rate: float = SFT_OVERRUN_RATE,
) -> str:
    """A walk of `problem` drawn with `rng`: each step +k or −k, or with probability `slip_rate` a slip (a letter
    neither gives, uniformly); with probability `overrun_rate`, 1 to [`MAX_OVERRUN`] valid letters more after the
    [`WALK_LENGTH`]-th."""
    length = WALK_LENGTH + (rng.randint(1, MAX_OVERRUN) if rng.random() < overrun_rate else 0)
    position, letters = problem.start, [RING[problem.start]]
    for i in range(1, length):
        valid = {(position + problem.step) % RING_SIZE, (position - problem.step) % RING_SIZE}
        if i < WALK_LENGTH and rng.random() < slip_rate:
            position = rng.choice([p for p in range(RING_SIZE) if p not in valid])
        else:
            position = rng.choice(sorted(valid))
        letters.append(RING[position])
    return "".join(letters)


def build_sft_dataset(
    problems, seed: int, num_rows: int, slip_rate: float = SFT_SLIP_RATE, overrun_rate: float = SFT_OVERRUN_RATE
):
    """Prompt-completion dataset of the warm start: `num_rows` walks ([`noisy_walk`]) of problems drawn uniformly
    from `problems`, all drawn once with `seed`."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        problem = problems[rng.randrange(len(problems))]
        rows.append({"prompt": problem.prompt, "completion": noisy_walk(problem, rng, slip_rate, overrun_rate)})
    return Dataset.from_list(rows)


def build_rl_dataset(problems, repeats: int = RL_REPEATS):
    """Prompt-only dataset of the RL phase, with ``"s k"`` in the ``solution`` column read by the reward: the
    problems `repeats` times over ([`RL_REPEATS`]), so that a generation batch fills (the trainer shuffles them)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p.prompt, "solution": p.solution} for _ in range(repeats) for p in problems])


def valid_transitions(letters: str, solution: str) -> tuple[bool, int]:
    """Whether `letters` starts with the start letter of `solution` (``"s k"``), and how many of its consecutive
    pairs are a step of ±k around the ring (a character off the ring makes both pairs around it invalid)."""
    start, step = solution.split()
    step = int(step)
    count = 0
    for previous, letter in zip(letters, letters[1:]):
        if previous in RING and letter in RING:
            count += (RING.index(letter) - RING.index(previous)) % RING_SIZE in (step, RING_SIZE - step)
    return letters[:1] == start, count


def ring_walk_reward(completions: list[str], solution: list[str], **kwargs) -> list[float]:
    """
    The task's true reward: the fraction of the ``WALK_LENGTH − 1`` transitions of the completion that are a step of
    ±k ([`valid_transitions`]), and 0.0 when the completion is not exactly [`WALK_LENGTH`] characters or does not
    start with the start letter.

    The completion is the decoded text (the end token dropped). Its length is exactly [`WALK_LENGTH`] only if the
    model wrote the end token right after the last letter: at most ``WALK_LENGTH + 1`` tokens are sampled
    ([`MAX_COMPLETION_LENGTH`]), so a completion cut there is one character too long.
    """
    rewards = []
    for completion, answer in zip(completions, solution, strict=True):
        starts, count = valid_transitions(completion, answer)
        rewards.append(count / (WALK_LENGTH - 1) if starts and len(completion) == WALK_LENGTH else 0.0)
    return rewards


def build_model(seed: int, size: str = "small"):
    """The task's character tokenizer ([`ALPHABET`]) and randomly initialised Qwen3 of `size` ([`MODEL_SIZES`])."""
    from .models import build_sized_model

    return build_sized_model(seed, MODEL_SIZES, size, ALPHABET)


def warm_start(
    splits: RingWalkSplits, output_dir: str, *, steps: int, seed: int, size: str = "small", device: str = "cpu"
):
    """
    Build the task's model ([`build_model`]) and train it for `steps` steps of batch 32 on ``32 · steps`` walks of
    ``splits.sft`` ([`build_sft_dataset`]; [`rpg_research.toy.warm_start.supervised_warm_start`]), saved in
    `output_dir`. No readiness check.

    Returns:
        `(model, tokenizer, WarmStartReport)`.
    """
    from .warm_start import supervised_warm_start

    model, tokenizer = build_model(seed, size)
    return supervised_warm_start(
        model,
        tokenizer,
        lambda: build_sft_dataset(splits.sft, seed, num_rows=32 * steps),
        output_dir,
        steps=steps,
        seed=seed,
        max_length=MAX_LENGTH,
        device=device,
    )
