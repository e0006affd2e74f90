# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl demo`` command: RPG end to end on a CPU in a few minutes, offline.

The demo reproduces, in miniature, the regime the paper's method is built for: reinforcement
learning with a verifiable reward *sharpens* what a supervised model can already produce.

1. **Task.** Two-digit additions ``a+b=`` (10 ≤ a, b ≤ 99). The completion is the bare sum (``"57"``); it is scored
   as the answer line ``Answer: 57`` by the project's math-verify reward ([`rpg_trl.rewards.accuracy_reward`]).
   The 8100 problems are split, once per seed, into a held-out evaluation set (never trained on), an RL prompt pool
   and a supervised pool.
2. **Warm start.** A ~0.45M-parameter Qwen3 with a character tokenizer, built locally ([`rpg_trl.tiny`]), is trained
   with TRL's [`~trl.SFTTrainer`] on the supervised pool, where half of the labels are wrong by ±1 or ±10, mixed with
   (equally noisy) additions with a one-digit operand, which make the phase transition of learning to add arrive
   earlier and more reliably; a readiness check on unseen problems extends the warm start for the rare seeds
   that have not learned to add yet ([`warm_start`]). The result usually ranks the right sum first (high greedy
   accuracy) but samples it only ~30-50% of the time at temperature 1: there is room to sharpen.
3. **RPG.** [`rpg_trl.RPGTrainer`] (RPG-REINFORCE-URKL by default) trains on the RL pool with the exact-match reward,
   the paper's advantage (reward − group mean, no std scaling), RPG-Style Clip, β = 1e-4 and the KL anchored to the
   sampling policy; four optimizer steps per generation batch make the importance weights, the clip and the KL act.
4. **Held-out accuracy** (the number the demo reports): on the held-out problems, the fraction of correct answers
   among ``eval_samples`` (default 4) completions per problem sampled at temperature 1.0 with no top-k/top-p
   filtering (mean@4), at most 4 new tokens, scored by the same reward. Greedy accuracy is reported too.

Outputs in ``--output_dir``: ``summary.json`` (accuracies before/after, timings, the configuration used, the
accuracy curve), ``curves.png`` (reward, held-out accuracy, entropy, KL, clip fractions, response length per step),
and the trainer states of both phases (``sft/`` and ``rpg/``, readable by ``rpg-trl plot``).

```bash
rpg-trl demo                          # default seed 0, output in rpg_demo/
rpg-trl demo --seed 1 --output_dir rpg_demo_seed1
```
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar


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
#: Readiness check of the warm start (see [`warm_start`]): problems checked, greedy accuracy required, extra rounds.
WARM_START_CHECK_PROBLEMS = 200
WARM_START_MIN_ACCURACY = 0.7
WARM_START_EXTRA_ROUNDS = 3
#: Keys of the warm-start configuration recorded in ``summary.json`` (the rest are TRL defaults).
SUMMARY_SFT_CONFIG_KEYS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "per_device_train_batch_size",
)
#: Keys of the RL configuration recorded in ``summary.json`` (the rest are TRL defaults).
SUMMARY_CONFIG_KEYS = (
    "max_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "per_device_train_batch_size",
    "num_generations",
    "steps_per_generation",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "loss_type",
    "scale_rewards",
    "beta",
    "epsilon",
    "epsilon_high",
    "divergence",
    "estimator",
    "rpg_clip",
    "clip_c",
    "kl_anchor",
    "aggregation",
    "seed",
)


@dataclass
class DemoArguments:
    """Arguments of ``rpg-trl demo``. Defaults are the recipe measured in the project's README."""

    output_dir: str = field(
        default="rpg_demo",
        metadata={"help": "Where to write summary.json, curves.png and the trainer states."},
    )
    steps: int = field(default=400, metadata={"help": "Number of RPG optimizer steps."})
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the problem split, the model initialisation, training and evaluation."},
    )
    sft_steps: int = field(
        default=1500,
        metadata={
            "help": "Supervised warm-start steps (batch 32) of the first round; more rounds follow while the model "
            "cannot add yet (see `sft_extra_rounds`). Far fewer steps leave a model that cannot add (useful only for "
            "smoke tests)."
        },
    )
    sft_extra_rounds: int = field(
        default=WARM_START_EXTRA_ROUNDS,
        metadata={
            "help": "At most this many extra warm-start rounds (of 2/3 of `sft_steps` each) while the model cannot add "
            "yet; 0 disables the readiness check's extension."
        },
    )
    divergence: str = field(
        default="urkl",
        metadata={"help": "RPG divergence: 'fkl', 'ufkl', 'rkl' or 'urkl'."},
    )
    estimator: str = field(
        default="reinforce",
        metadata={"help": "RPG estimator: 'reinforce' or 'differentiable'."},
    )
    learning_rate: float = field(
        default=6e-4,
        metadata={
            "help": "RPG learning rate (AdamW, 10 warm-up steps, then constant), tuned for this tiny "
            "model with advantage = reward − group mean (no std scaling)."
        },
    )
    eval_problems: int = field(default=400, metadata={"help": "Number of held-out problems (never trained on)."})
    eval_samples: int = field(default=4, metadata={"help": "Completions sampled per held-out problem (mean@k)."})
    eval_every: int = field(default=50, metadata={"help": "Evaluate the held-out accuracy every this many RPG steps."})
    num_threads: int = field(
        default=1,
        metadata={
            "help": "Torch CPU threads. One by default: the model is so small that more threads barely help, and they "
            "slow down sharply when other processes compete for the cores."
        },
    )

    def __post_init__(self):
        for name in (
            "steps",
            "sft_steps",
            "sft_extra_rounds",
            "eval_problems",
            "eval_samples",
            "eval_every",
            "num_threads",
        ):
            value = getattr(self, name)
            minimum = 0 if name in ("sft_steps", "sft_extra_rounds") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}.")
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)) or (
            self.learning_rate <= 0
        ):
            raise ValueError(f"`learning_rate` must be a positive number; got {self.learning_rate!r}.")


# ----------------------------------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class AdditionSplits:
    """Disjoint sets of ``(a, b)`` problems: supervised warm start, RL prompts, held-out evaluation."""

    sft: list[tuple[int, int]]
    rl: list[tuple[int, int]]
    eval: list[tuple[int, int]]


def make_splits(seed: int, num_eval: int = 400, num_rl: int = 1600) -> AdditionSplits:
    """Shuffle the 8100 two-digit problems with `seed` and split them into held-out, RL and supervised pools."""
    pairs = [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE]
    if num_eval + num_rl >= len(pairs):
        raise ValueError(
            f"`num_eval + num_rl` must leave problems for the warm start (< {len(pairs)}); got {num_eval} + {num_rl}."
        )
    random.Random(seed).shuffle(pairs)
    return AdditionSplits(
        eval=pairs[:num_eval], rl=pairs[num_eval : num_eval + num_rl], sft=pairs[num_eval + num_rl :]
    )


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
    Exact-match reward of the demo: 1.0 when the completion is the right sum, else 0.0.

    The prompt ``"a+b="`` asks for the bare number, so the completion is scored as the answer line ``Answer: <c>``
    by [`rpg_trl.rewards.accuracy_reward`] (math-verify): ``"57"`` and ``"057"`` both match ``57``.
    """
    from .rewards import accuracy_reward

    return accuracy_reward([f"Answer: {completion}" for completion in completions], solution)


# ----------------------------------------------------------------------------------------------------------------------
# Model and evaluation
# ----------------------------------------------------------------------------------------------------------------------


def evaluation_seed(seed: int) -> int:
    """Seed of the held-out sampling of run `seed` (fixed, so that before/after and all methods see the same draws)."""
    return seed + 10_000


def build_model(seed: int):
    """The demo's tokenizer and randomly initialised ~0.45M-parameter Qwen3 ([`DEMO_MODEL_KWARGS`])."""
    from .tiny import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, seed=seed, **DEMO_MODEL_KWARGS)
    return model, tokenizer


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
def _callback_classes():
    """The demo's trainer callbacks, defined on first use (importing `transformers.trainer` takes seconds)."""
    from transformers import ProgressCallback, TrainerCallback

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

    class TerseProgressCallback(ProgressCallback):
        """TRL's progress bar, with the latest metrics shown after the bar instead of one printed line per log."""

        KEYS: ClassVar[dict[str, str]] = {
            "loss": "loss",
            "reward": "reward",
            "kl": "kl",
            "entropy": "entropy",
            "heldout/accuracy": "acc",
        }

        def __init__(self):
            super().__init__()
            self.postfix: dict[str, str] = {}

        def _show(self, logs):
            for key, short in self.KEYS.items():
                if isinstance(logs.get(key), float):
                    self.postfix[short] = f"{logs[key]:.3g}"
            if self.training_bar is not None and self.postfix:
                self.training_bar.set_postfix(self.postfix, refresh=False)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self._show(logs or {})

        def on_step_end(self, args, state, control, **kwargs):
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                self._show(state.log_history[-1])
            super().on_step_end(args, state, control, **kwargs)

    return HeldOutAccuracyCallback, TerseProgressCallback


def heldout_accuracy_callback(model, tokenizer, pairs, *, every: int, num_samples: int = 4, seed: int = 0):
    """A trainer callback that tracks [`heldout_accuracy`] of `model` on `pairs` every `every` steps (and at step 0)."""
    return _callback_classes()[0](model, tokenizer, pairs, every=every, num_samples=num_samples, seed=seed)


def use_terse_progress(trainer) -> None:
    """Replace the trainer's progress bar by one that shows the latest metrics after the bar (no printed log lines)."""
    from transformers import ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_callback_classes()[1]())


# ----------------------------------------------------------------------------------------------------------------------
# Training configurations
# ----------------------------------------------------------------------------------------------------------------------

#: Settings shared by every trainer of the demo and of ``rpg-trl bench-algos``: CPU, fp32, no checkpoints or trackers.
CPU_TRAINING_KWARGS = {
    "use_cpu": True,
    "bf16": False,
    "activation_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "dataloader_num_workers": 0,
    "disable_tqdm": False,
}


def sft_config(output_dir: str, *, steps: int, seed: int, prepared: bool = False):
    """
    [`~trl.SFTConfig`] of the warm start: batch 32, AdamW at 5e-3 with cosine decay, weight decay 0.1. `prepared=True`
    declares the dataset already tokenized by a previous `SFTTrainer` (TRL's `skip_prepare_dataset`).
    """
    from trl import SFTConfig

    return SFTConfig(
        dataset_kwargs={"skip_prepare_dataset": True} if prepared else None,
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        weight_decay=0.1,
        max_length=32,
        logging_steps=50,
        seed=seed,
        **CPU_TRAINING_KWARGS,
    )


def rl_training_kwargs(*, steps: int, seed: int, learning_rate: float) -> dict:
    """
    Arguments shared by the RL phase of the demo and every algorithm of ``rpg-trl bench-algos``.

    128 completions per optimizer step (16 prompts × 8 samples), 4 optimizer steps per generation batch (64
    prompts), temperature 1.0, at most 4 new tokens; AdamW with the paper's weight decay (0.1), gradient clipping
    (1.0) and 10 warm-up steps followed by a constant learning rate (Appendix H).
    """
    return {
        "max_steps": steps,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 10,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "per_device_train_batch_size": 128,
        "num_generations": 8,
        "steps_per_generation": 4,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "temperature": 1.0,
        "logging_steps": 1,
        "seed": seed,
        **CPU_TRAINING_KWARGS,
    }


def rpg_config(output_dir: str, *, steps: int, seed: int, learning_rate: float, **rpg_kwargs):
    """[`RPGConfig`] of the demo: [`rl_training_kwargs`] plus RPG's paper defaults, overridable by `rpg_kwargs`."""
    from .config import RPGConfig

    return RPGConfig(
        output_dir=output_dir, **rl_training_kwargs(steps=steps, seed=seed, learning_rate=learning_rate), **rpg_kwargs
    )


@dataclass
class WarmStartReport:
    """What [`warm_start`] did: supervised steps in total, rounds, and the greedy accuracy of the readiness check."""

    steps: int
    rounds: int
    check_accuracy: float | None


def warm_start(
    splits: AdditionSplits, output_dir: str, *, steps: int, seed: int, extra_rounds: int = WARM_START_EXTRA_ROUNDS
):
    """
    Build the demo model, train it with [`~trl.SFTTrainer`] until it can add, and save it with its trainer state.

    A first round of `steps` supervised steps (cosine schedule) is followed by a readiness check: the greedy accuracy
    on [`WARM_START_CHECK_PROBLEMS`] problems the warm start never sees (the first ones of the RL pool; RL only trains
    on them afterwards). Learning to add is a phase transition whose time varies with the seed; while the accuracy is
    below [`WARM_START_MIN_ACCURACY`], up to `extra_rounds` (default [`WARM_START_EXTRA_ROUNDS`]) more rounds of
    ``2/3 · steps`` steps (a warm restart of the schedule, new data order) follow. Most seeds stop after the first
    round.

    Returns:
        `(model, tokenizer, WarmStartReport)`.
    """
    from trl import SFTTrainer

    model, tokenizer = build_model(seed)
    if steps == 0:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        return model, tokenizer, WarmStartReport(steps=0, rounds=0, check_accuracy=None)
    dataset = build_sft_dataset(splits.sft, seed)
    check = splits.rl[:WARM_START_CHECK_PROBLEMS]
    total, round_steps = 0, steps
    for round_index in range(1 + extra_rounds):
        trainer = SFTTrainer(
            model=model,
            args=sft_config(output_dir, steps=round_steps, seed=seed + round_index, prepared=round_index > 0),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        use_terse_progress(trainer)
        trainer.train()
        dataset = trainer.train_dataset  # tokenized, with labels: the next rounds skip the preparation
        total += round_steps
        accuracy = heldout_accuracy(model, tokenizer, check, greedy=True)
        if accuracy >= WARM_START_MIN_ACCURACY or round_index == extra_rounds:
            break
        round_steps = max(1, (2 * steps) // 3)
        print(
            f"      The model cannot add yet (greedy accuracy {accuracy:.2f} on {len(check)} unseen problems < "
            f"{WARM_START_MIN_ACCURACY}): {round_steps} more supervised steps."
        )
    trainer.save_model(output_dir)
    trainer.save_state()
    return model, tokenizer, WarmStartReport(steps=total, rounds=round_index + 1, check_accuracy=accuracy)


# ----------------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------------


@contextmanager
def cpu_session(num_threads: int):
    """
    Run the block with `num_threads` torch threads, without dataset-map progress bars, with transformers logging at
    error level (training progress bars stay) and without a deprecation warning raised inside TRL on every run;
    restore all of it afterwards.
    """
    import datasets
    import torch
    import transformers

    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    progress_bars = datasets.is_progress_bar_enabled()
    torch.set_num_threads(num_threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            # Raised inside TRL/transformers on every run, about a renamed attribute; nothing the user can act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        if progress_bars:
            datasets.enable_progress_bars()


def run_demo(args: DemoArguments) -> dict:
    """Run the demo described in the module docstring and return the summary written to ``summary.json``."""
    with cpu_session(args.num_threads):
        return _run_demo(args)


def _run_demo(args: DemoArguments) -> dict:
    start = time.perf_counter()
    from .losses import PAPER_NAMES
    from .plotting import plot_runs
    from .trainer import RPGTrainer

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    splits = make_splits(args.seed, num_eval=args.eval_problems)
    eval_seed = evaluation_seed(args.seed)

    print(f"[1/3] Supervised warm start: {args.sft_steps} steps on {len(splits.sft)} noisy additions (+ easy ones)")
    sft_start = time.perf_counter()
    model, tokenizer, warm = warm_start(
        splits, str(output_dir / "sft"), steps=args.sft_steps, seed=args.seed, extra_rounds=args.sft_extra_rounds
    )
    sft_seconds = time.perf_counter() - sft_start

    accuracy = heldout_accuracy_callback(
        model, tokenizer, splits.eval, every=args.eval_every, num_samples=args.eval_samples, seed=eval_seed
    )
    config = rpg_config(
        str(output_dir / "rpg"),
        steps=args.steps,
        seed=args.seed,
        learning_rate=args.learning_rate,
        divergence=args.divergence,
        estimator=args.estimator,
    )
    algorithm = PAPER_NAMES[(config.divergence, config.estimator)]
    print(f"[2/3] {algorithm}: {args.steps} steps on {len(splits.rl)} new problems, exact-match reward")
    trainer = RPGTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[accuracy],
    )
    use_terse_progress(trainer)
    rl_start = time.perf_counter()
    trainer.train()
    rl_seconds = time.perf_counter() - rl_start
    trainer.save_state()

    print("[3/3] Held-out evaluation and plots")
    before, after = accuracy.curve[0], accuracy.curve[-1]
    curves_path = output_dir / "curves.png"
    plot_runs(
        [str(output_dir / "rpg")],
        str(curves_path),
        names=[algorithm],
        title="rpg-trl demo: " + algorithm,
        smoothing=0.8,
    )
    seconds = time.perf_counter() - start
    sft = sft_config(str(output_dir / "sft"), steps=max(args.sft_steps, 1), seed=args.seed)  # for the record
    summary = {
        "accuracy_before": before["heldout/accuracy"],
        "accuracy_after": after["heldout/accuracy"],
        "greedy_accuracy_before": before["heldout/greedy_accuracy"],
        "greedy_accuracy_after": after["heldout/greedy_accuracy"],
        "accuracy_gain_points": 100.0 * (after["heldout/accuracy"] - before["heldout/accuracy"]),
        "accuracy_definition": (
            f"mean@{args.eval_samples}: fraction of correct answers among {args.eval_samples} completions per "
            f"problem, sampled at temperature 1.0 without top-k/top-p, on {len(splits.eval)} held-out two-digit "
            "additions never seen in training; correct = math-verify match of the completion with a+b"
        ),
        "accuracy_curve": [
            {"step": e["step"], "accuracy": e["heldout/accuracy"], "greedy_accuracy": e["heldout/greedy_accuracy"]}
            for e in accuracy.curve
        ],
        "algorithm": algorithm,
        "steps": args.steps,
        "sft_steps": args.sft_steps,
        "sft_steps_total": warm.steps,
        "sft_rounds": warm.rounds,
        "sft_check_greedy_accuracy": warm.check_accuracy,
        "seed": args.seed,
        "seconds": seconds,
        "seconds_sft": sft_seconds,
        "seconds_rl": rl_seconds,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "config": {
            "demo": asdict(args),
            "model": DEMO_MODEL_KWARGS,
            "warm_start": {
                "label_noise": SFT_LABEL_NOISE,
                "easy_fraction": SFT_EASY_FRACTION,
                "min_check_accuracy": WARM_START_MIN_ACCURACY,
                **{key: getattr(sft, key) for key in SUMMARY_SFT_CONFIG_KEYS},
            },
            "rl": {key: getattr(config, key) for key in SUMMARY_CONFIG_KEYS},
        },
        "versions": _versions(),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": sys.version.split()[0]}
    for package in ("rpg_trl", "trl", "transformers", "torch"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def format_summary(summary: dict, output_dir: str) -> str:
    """The lines printed at the end of ``rpg-trl demo``."""
    demo_args, algorithm = summary["config"]["demo"], summary["algorithm"]
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    accuracy = (
        f"Held-out accuracy (mean@{demo_args['eval_samples']}, T=1.0, {demo_args['eval_problems']} unseen problems): "
        f"{before:.3f} before {algorithm} -> {after:.3f} after ({summary['accuracy_gain_points']:+.1f} points)"
    )
    greedy = f"Greedy accuracy: {summary['greedy_accuracy_before']:.3f} -> {summary['greedy_accuracy_after']:.3f}"
    timing = (
        f"Time: {summary['seconds']:.0f} s (warm start {summary['seconds_sft']:.0f} s, {algorithm} "
        f"{summary['seconds_rl']:.0f} s for {summary['steps']} steps)"
    )
    files = f"Wrote {os.path.join(output_dir, 'summary.json')} and {os.path.join(output_dir, 'curves.png')}"
    return f"{accuracy}\n{greedy}\n{timing}\n{files}"


def add_parser(subparsers):
    """Register ``rpg-trl demo`` (see [`rpg_trl.cli`])."""
    return subparsers.add_parser(
        "demo",
        help="Train a tiny model with RPG on CPU in a few minutes and report held-out accuracy before/after.",
        description="RPG end to end on CPU, offline: a supervised warm start of a ~0.45M-parameter Qwen3 on noisy "
        "two-digit additions, then RPGTrainer with an exact-match (math-verify) reward; prints the held-out accuracy "
        "(mean@4 at temperature 1.0) before and after, and writes summary.json and curves.png.",
        dataclass_types=[DemoArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl demo`` with the parsed command-line `args`."""
    from .cli import CommandError

    try:
        demo_args = DemoArguments(**{name: getattr(args, name) for name in DemoArguments.__dataclass_fields__})
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    summary = run_demo(demo_args)
    print(format_summary(summary, demo_args.output_dir))
    return 0
