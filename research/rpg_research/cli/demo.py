# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl demo`` command: RPG end to end on a CPU in a few minutes, offline.

The demo reproduces, in miniature, the regime the paper's method is built for: reinforcement
learning with a verifiable reward *sharpens* what a supervised model can already produce.

1. **Task.** Two-digit additions ``a+b=`` (10 ≤ a, b ≤ 99). The completion is the bare sum (``"57"``); it is scored
   as the answer line ``Answer: 57`` by the project's math-verify reward
   ([`rpg_trl.math_task.rewards.accuracy_reward`]). The 8100 problems are split, once per seed, into a held-out
   evaluation set (never trained on), an RL prompt pool and a supervised pool.
2. **Warm start.** A ~0.45M-parameter Qwen3 with a character tokenizer, built locally ([`rpg_research.toy.models`]), is trained
   with TRL's [`~trl.SFTTrainer`] on the supervised pool, where half of the labels are wrong by ±1 or ±10, mixed with
   (equally noisy) additions with a one-digit operand, which make the phase transition of learning to add arrive
   earlier and more reliably; a readiness check on unseen problems extends the warm start for the rare seeds
   that have not learned to add yet ([`rpg_research.toy.warm_start`]). The result usually ranks the right sum first (high greedy
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
rpg-trl demo --device cuda            # the same on the first GPU, with bf16 autocast
rpg-trl demo --task long_addition     # four-digit additions worked out in rows: completions of ~110 tokens
rpg-trl demo --task ring_walk         # walks of 64 letters, two right letters at each step: 65 uncertain tokens
```

``--task long_addition`` runs the same pipeline on the task of [`rpg_research.toy.long_addition`], whose completions
are 109-110 tokens long, so that RPG's importance weights and its sequence-level KL act over many tokens; ``--task
ring_walk`` on the walks of [`rpg_research.toy.ring_walk`], 65 tokens each of which stays uncertain; the tasks and
their defaults are listed in [`rpg_research.toy.tasks`].
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..toy.tasks import DEMO_TASKS, check_model_size_and_device


#: Keys of the warm-start configuration recorded in ``summary.json`` (the rest are TRL defaults).
SUMMARY_SFT_CONFIG_KEYS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "per_device_train_batch_size",
)
#: Keys of TRL's configuration recorded in ``summary.json`` (the rest are TRL defaults), besides every field that
#: `RPGConfig` adds to it (`_rpg_fields`).
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
    task: str = field(
        default="addition",
        metadata={
            "help": "The task: 'addition' (two-digit additions, the bare sum: 3-4 tokens), 'long_addition' (four-digit "
            "additions worked out in rows: 109-110 tokens, where RPG's weights act over long completions) or "
            "'ring_walk' (walks of 64 letters, each step +k or -k around a ring: 65 tokens, all uncertain; "
            "research/docs/demo.md). It sets the defaults of the arguments below that say so."
        },
    )
    model_size: str = field(
        default="small",
        metadata={
            "help": "Size of the task's model: 'small' (CPU); 'long_addition' and 'ring_walk' also have 'large' (a GPU "
            "run, same code)."
        },
    )
    steps: int | None = field(
        default=None,
        metadata={
            "help": "Number of RPG optimizer steps (default: 400 for addition, 40 for long_addition, 32 for ring_walk)."
        },
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the problem split, the model initialisation, training and evaluation."},
    )
    sft_steps: int | None = field(
        default=None,
        metadata={
            "help": "Supervised warm-start steps (batch 32) of the first round (default: 1500 for addition, 400 for "
            "long_addition and ring_walk); with addition, more rounds follow while the model cannot add yet (see "
            "`sft_extra_rounds`). Far fewer steps leave a model that cannot add (useful only for smoke tests)."
        },
    )
    sft_extra_rounds: int | None = field(
        default=None,
        metadata={
            "help": "At most this many extra warm-start rounds (of 2/3 of `sft_steps` each) while the model cannot add "
            "yet; 0 disables the readiness check's extension (default: 3 for addition; long_addition and ring_walk have "
            "no readiness check: 0)."
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
    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "RPG learning rate (AdamW, 10 warm-up steps, then constant; default: 6e-4 for addition, tuned for "
            "its tiny model with advantage = reward − group mean (no std scaling); 1e-4 for long_addition, not tuned; "
            "3e-4 for ring_walk, GRPO's pilot rate: research/docs/demo.md)."
        },
    )
    eval_problems: int | None = field(
        default=None,
        metadata={
            "help": "Number of held-out problems, never trained on (default: 400; 100 for ring_walk, whose 234 "
            "problems are split three ways)."
        },
    )
    eval_samples: int = field(default=4, metadata={"help": "Completions sampled per held-out problem (mean@k)."})
    eval_every: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate the held-out accuracy every this many RPG steps (default: 50 for addition, 40 for "
            "long_addition, 32 for ring_walk)."
        },
    )
    device: str = field(
        default="cpu",
        metadata={
            "help": "Where to train and evaluate: 'cpu' (float32, the recipe measured in the README) or 'cuda' (the "
            "first GPU, bf16 autocast: float32 weights, forward passes in bfloat16)."
        },
    )
    num_threads: int = field(
        default=1,
        metadata={
            "help": "Torch CPU threads. One by default: the model is so small that more threads barely help, and they "
            "slow down sharply when other processes compete for the cores."
        },
    )

    def __post_init__(self):
        from . import check_arguments

        if self.task not in DEMO_TASKS:
            raise ValueError(f"`task` must be one of {sorted(DEMO_TASKS)}; got {self.task!r}.")
        task = DEMO_TASKS[self.task]
        check_model_size_and_device(self.task, self.model_size, self.device)
        for name, value in task.defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.sft_extra_rounds and not task.readiness_check:
            raise ValueError(
                f"`sft_extra_rounds` must be 0 with `task={self.task!r}`: its warm start has no readiness check to "
                f"extend; got {self.sft_extra_rounds}."
            )
        check_arguments(
            self,
            at_least_one=("steps", "eval_problems", "eval_samples", "eval_every", "num_threads"),
            at_least_zero=("sft_steps", "sft_extra_rounds"),
            positive=("learning_rate",),
        )


def run_demo(args: DemoArguments) -> dict:
    """Run the demo described in the module docstring and return the summary written to ``summary.json``."""
    from ..toy.training import cpu_session

    with cpu_session(args.num_threads):
        return _run_demo(args)


def _run_demo(args: DemoArguments) -> dict:
    start = time.perf_counter()
    from rpg_trl.losses import PAPER_NAMES
    from rpg_trl.trainer import RPGTrainer

    from ..toy.addition import evaluation_seed
    from ..toy.evaluation import heldout_accuracy_callback
    from ..toy.training import rpg_config, sft_config, use_terse_progress
    from .plot import plot_runs

    task = DEMO_TASKS[args.task]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    splits = task.make_splits(args.seed, args.eval_problems, args.sft_steps)
    eval_seed = evaluation_seed(args.seed)

    print(f"[1/3] Supervised warm start: {args.sft_steps} steps on {len(splits.sft)} {task.warm_start_data}")
    sft_start = time.perf_counter()
    model, tokenizer, warm = task.warm_start(
        splits,
        str(output_dir / "sft"),
        steps=args.sft_steps,
        seed=args.seed,
        extra_rounds=args.sft_extra_rounds,
        device=args.device,
        model_size=args.model_size,
    )
    sft_seconds = time.perf_counter() - sft_start

    accuracy = heldout_accuracy_callback(
        model,
        tokenizer,
        splits.eval,
        every=args.eval_every,
        num_samples=args.eval_samples,
        seed=eval_seed,
        reward_funcs={"accuracy": task.reward},
        max_new_tokens=task.max_completion_length,
    )
    config = rpg_config(
        str(output_dir / "rpg"),
        steps=args.steps,
        seed=args.seed,
        learning_rate=args.learning_rate,
        max_completion_length=task.max_completion_length,
        divergence=args.divergence,
        estimator=args.estimator,
        device=args.device,
    )
    algorithm = PAPER_NAMES[(config.divergence, config.estimator)]
    print(f"[2/3] {algorithm}: {args.steps} steps on {len(splits.rl)} new problems, exact-match reward")
    trainer = RPGTrainer(
        model=model,
        reward_funcs=task.reward,
        args=config,
        train_dataset=task.build_rl_dataset(splits.rl),
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
    sft = sft_config(str(output_dir / "sft"), steps=max(args.sft_steps, 1), seed=args.seed, device=args.device)
    summary = {
        "accuracy_before": before["heldout/accuracy"],
        "accuracy_after": after["heldout/accuracy"],
        "greedy_accuracy_before": before["heldout/greedy_accuracy"],
        "greedy_accuracy_after": after["heldout/greedy_accuracy"],
        "accuracy_gain_points": 100.0 * (after["heldout/accuracy"] - before["heldout/accuracy"]),
        "accuracy_definition": (
            f"mean@{args.eval_samples}: mean score (the fraction of correct answers) of {args.eval_samples} completions per "
            f"problem, sampled at temperature 1.0 without top-k/top-p, on {len(splits.eval)} held-out "
            f"{task.problems} never seen in training; {task.scored_by}"
        ),
        "accuracy_curve": [
            {"step": e["step"], "accuracy": e["heldout/accuracy"], "greedy_accuracy": e["heldout/greedy_accuracy"]}
            for e in accuracy.curve
        ],
        "completion_length_mean": _mean_completion_length(trainer.state.log_history),
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
            "model": task.model_sizes[args.model_size],
            "warm_start": {
                **task.warm_start_settings,
                **{key: getattr(sft, key) for key in SUMMARY_SFT_CONFIG_KEYS},
            },
            "rl": {key: getattr(config, key) for key in (*SUMMARY_CONFIG_KEYS, *_rpg_fields())},
        },
        "versions": _versions(),
        "machine": _machine(),
        "device": _device_name(args.device),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _mean_completion_length(log_history: list[dict]) -> float | None:
    """Mean, over the RL steps, of the mean length in tokens of the step's sampled completions (TRL's
    ``completions/mean_length``); `None` when no step logged it."""
    lengths = [entry["completions/mean_length"] for entry in log_history if "completions/mean_length" in entry]
    return sum(lengths) / len(lengths) if lengths else None


def _rpg_fields() -> tuple[str, ...]:
    """Every field that `RPGConfig` adds to TRL's `GRPOConfig` (the loss, `kl_clip_mode` and `kl_level` included, the KL
    control, dynamic sampling, the reference sync, the warnings): all of them shape the result or its log."""
    from dataclasses import fields

    from trl import GRPOConfig

    from rpg_trl.config import RPGConfig

    trl_fields = {f.name for f in fields(GRPOConfig)}
    return tuple(sorted(f.name for f in fields(RPGConfig) if f.name not in trl_fields))


def _device_name(device: str) -> str:
    """What trained: the GPU's name on "cuda", "cpu" otherwise."""
    import torch

    return f"cuda ({torch.cuda.get_device_name()}, bf16 autocast)" if device == "cuda" else "cpu (float32)"


def _machine() -> dict:
    from . import machine

    return machine()


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
    where = summary.get("machine", {})
    measured = f"Measured on {where.get('cpu', '?')} (ATen CPU capability {where.get('cpu_capability', '?')})"
    if summary.get("device", "cpu").startswith("cuda"):
        measured = f"Measured on {summary['device']}, host {where.get('cpu', '?')}"
    files = f"Wrote {os.path.join(output_dir, 'summary.json')} and {os.path.join(output_dir, 'curves.png')}"
    return f"{accuracy}\n{greedy}\n{timing}\n{measured}\n{files}"


def add_parser(subparsers):
    """Register ``rpg-trl demo`` (see [`rpg_research.cli`])."""
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
    from . import dataclass_arguments

    demo_args = dataclass_arguments(args, DemoArguments)
    summary = run_demo(demo_args)
    print(format_summary(summary, demo_args.output_dir))
    return 0
