# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl bench-async`` command: asynchronous GRPO against asynchronous RPG at increasing policy lag.

Every run trains the warm start of ``rpg-trl demo`` (two-digit additions, see [`rpg_research.toy.warm_start`]; one supervised warm
start per seed, shared by all runs, as in ``rpg-trl bench-algos``) with TRL's asynchronous trainer on a CPU: a
[`~rpg_research.cpu_rollouts.LocalRolloutWorker`] thread samples the rollouts of optimizer step ``s`` from policy
version ``max(1, s - lag)``, so that every batch after the first ``lag`` ones is exactly ``lag`` versions stale.

==============================  =======================================================================================
method                          trainer and loss
==============================  =======================================================================================
AsyncGRPO                       TRL's `AsyncGRPOTrainer`: PPO clip ε = 0.2 on both sides, no KL term
RPG-REINFORCE-URKL              `AsyncRPGTrainer`, paper defaults: REINFORCE estimator, URKL to the sampling policy
                                (the stale sampler) with β = 1e-4, RPG-Style Clip ε = (0.2, 0.28), c = 10
RPG-REINFORCE-URKL-beta0.5      the same with β = 0.5: a KL to the sampler strong enough to act
uncorrected-k3-beta0.5          the same with GRPO's k3 penalty without the importance weight
                                (`kl_importance_weight=False`, the biased baseline of Sec. 2.2)
RPG-URKL (not in the default)   `AsyncRPGTrainer`, fully differentiable estimator, otherwise as RPG-REINFORCE-URKL: with
                                the clip both estimators give the same gradient on every token (`rpg_trl.losses`)
==============================  =======================================================================================

All runs share the rollouts' settings (16 prompts × 8 samples per optimizer step, temperature 1, at most 4 new tokens,
advantage = reward − group mean for every method, so that only the loss differs), the optimizer (AdamW, 10 warm-up
steps then constant, weight decay 0.1, gradient clipping 1.0) and the number of steps.

Reported per (lag, method), over seeds (mean ± sample standard deviation): **Last** held-out accuracy (sampled mean@4
at temperature 1 on problems never trained on, as in the demo), its **gain** over the warm start, **Best** held-out
accuracy during training, **Max reward drop** (stability: the largest fall of the training reward's moving average
below its running maximum, as in ``rpg-trl bench-algos``), and the mean fraction of **clipped** tokens.

Outputs in ``--output_dir``: ``table.md``, ``results.json``, ``bench_async.png`` and, per seed, the warm start
(``seed<k>/sft``) and each run's trainer state (``seed<k>/lag<L>/<method>``, readable by ``rpg-trl plot``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from .warm_start_bench import WarmStartBenchArguments, bench_presets, output_dir_field


#: Method name -> (trainer, configuration overrides). "grpo" runs TRL's AsyncGRPOTrainer, "rpg" AsyncRPGTrainer.
METHODS = {
    "AsyncGRPO": ("grpo", {"epsilon": 0.2, "epsilon_high": 0.2}),
    "RPG-REINFORCE-URKL": ("rpg", {"divergence": "urkl", "estimator": "reinforce"}),
    "RPG-REINFORCE-URKL-beta0.5": ("rpg", {"divergence": "urkl", "estimator": "reinforce", "beta": 0.5}),
    "uncorrected-k3-beta0.5": (
        "rpg",
        {"divergence": "urkl", "estimator": "reinforce", "beta": 0.5, "kl_importance_weight": False},
    ),
    "RPG-URKL": ("rpg", {"divergence": "urkl", "estimator": "differentiable"}),
}
#: Methods run when `--methods` is not given.
DEFAULT_METHODS = ["AsyncGRPO", "RPG-REINFORCE-URKL", "RPG-REINFORCE-URKL-beta0.5", "uncorrected-k3-beta0.5"]
#: Full and ``--quick`` presets of the options left unset on the command line (those of the warm start and the
#: held-out set: [`~rpg_research.cli.warm_start_bench.WARM_START_PRESETS`]).
PRESETS = bench_presets(
    full={"steps": 60, "eval_every": 20}, quick={"steps": 4, "sft_steps": 50, "eval_every": 2, "eval_problems": 32}
)


@dataclass
class BenchAsyncArguments(WarmStartBenchArguments):
    """Arguments of ``rpg-trl bench-async``: the warm-start benchmarks' and the lags and methods to compare. Unset
    options take the full or the ``--quick`` preset ([`PRESETS`])."""

    output_dir: str = output_dir_field("runs/bench_async")
    lags: list[int] = field(
        default_factory=lambda: [1, 2, 4],
        metadata={"help": "Policy lags to compare: the samples of step s come from policy version s - lag."},
    )
    methods: list[str] | None = field(
        default=None, metadata={"help": f"Methods to run, a subset of {list(METHODS)}. Default: {DEFAULT_METHODS}."}
    )
    quick: bool = field(default=False, metadata={"help": "A few steps on a barely warm model: a smoke test."})
    num_threads: int = field(
        default=1, metadata={"help": "Torch CPU threads of the trainer (the rollout thread shares them)."}
    )
    presets = PRESETS

    def __post_init__(self):
        from .warm_start_bench import chosen

        super().__post_init__()
        self.methods = chosen(self.methods, METHODS, DEFAULT_METHODS, "method")
        if not self.lags or any(isinstance(lag, bool) or not isinstance(lag, int) or lag < 1 for lag in self.lags):
            raise ValueError(f"`lags` must list integers >= 1 (policy versions of lag); got {self.lags!r}.")

    def arms(self) -> list[dict]:
        return [{"lag": lag, "method": method} for lag in self.lags for method in self.methods]


def _config(kind: str, output_dir: str, args: BenchAsyncArguments, seed: int, lag: int, overrides: dict):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from rpg_trl.async_rpg import AsyncRPGConfig

    from ..toy.training import rl_training_kwargs

    kwargs = rl_training_kwargs(steps=args.steps, seed=seed, learning_rate=args.learning_rate)
    kwargs.pop("steps_per_generation")  # synchronous GRPO only: here every optimizer step gets fresh rollouts
    config_class = AsyncRPGConfig if kind == "rpg" else AsyncGRPOConfig
    # One micro-batch of 128 samples per optimizer step (token_budget=0: a fixed sample count per micro-batch).
    return config_class(
        output_dir=output_dir, token_budget=0, max_staleness=lag, dtype="float32", **kwargs, **overrides
    )


def _eval_copy_callback(eval_model):
    """A callback that copies the trainer's parameters into `eval_model` (SDPA attention, usable by `generate`) at the
    start of training and after every optimizer step, before the held-out evaluation callback that follows it."""
    import torch
    from transformers import TrainerCallback

    class CopyPolicy(TrainerCallback):
        def _copy(self, model):
            source = dict(model.named_parameters())
            with torch.no_grad():
                for name, parameter in eval_model.named_parameters():
                    parameter.copy_(source[name])

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._copy(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self._copy(model)

    return CopyPolicy()


def run_one(args: BenchAsyncArguments, method: str, lag: int, seed: int, splits, sft_dir: str, run_dir: Path) -> dict:
    """Train `method` at policy lag `lag` from the warm start in `sft_dir`; return its accuracy curve and metrics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from rpg_trl.async_rpg import AsyncRPGTrainer

    from ..cpu_rollouts import LocalRolloutWorker, cpu_backend
    from ..toy.addition import addition_reward, build_rl_dataset, evaluation_seed
    from ..toy.curves import metric_series
    from ..toy.evaluation import heldout_accuracy_callback
    from ..toy.training import use_terse_progress
    from .warm_start_bench import heldout_summary

    kind, overrides = METHODS[method]
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    eval_model = AutoModelForCausalLM.from_pretrained(sft_dir, attn_implementation="sdpa")
    accuracy = heldout_accuracy_callback(
        eval_model,
        tokenizer,
        splits.eval,
        every=args.eval_every,
        num_samples=args.eval_samples,
        seed=evaluation_seed(seed),
    )
    config = _config(kind, str(run_dir), args, seed, lag, overrides)
    dataset = build_rl_dataset(splits.rl)
    worker = LocalRolloutWorker(
        sft_dir,
        tokenizer,
        dataset,
        addition_reward,
        num_generations=config.num_generations,
        samples_per_step=config.per_device_train_batch_size,
        max_completion_length=config.max_completion_length,
        lag=lag,
        temperature=config.temperature,
        seed=seed,
    )
    trainer_class = AsyncRPGTrainer if kind == "rpg" else AsyncGRPOTrainer
    with cpu_backend():
        trainer = trainer_class(
            sft_dir,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[_eval_copy_callback(eval_model), accuracy],
            rollout_worker=worker,
            weight_transfer=worker.weight_transfer,
        )
        use_terse_progress(trainer)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    trainer.save_state()
    history = trainer.state.log_history
    _, rewards = metric_series(history, "reward")
    _, clipped = metric_series(history, "clip_ratio/region_mean")
    _, staleness = metric_series(history, "staleness/mean")
    summary = heldout_summary(
        accuracy.curve,
        rewards,
        seconds,
        clipped=statistics.fmean(clipped) if clipped else math.nan,
        # The lag measured by AsyncRPGTrainer (trainer version − sampler version, per batch); the worker's by design.
        staleness_measured=statistics.fmean(staleness[lag:]) if len(staleness) > lag else None,
        sampled_versions=worker.sampled_versions[: args.steps],
    )
    return {"method": method, "lag": lag, "seed": seed, **summary}


#: Columns of the table: mean and standard deviation over seeds of each (lag, method)'s Last, gain, Best, reward drop,
#: clipped tokens and time.
TABLE_KEYS = ("last", "gain", "best", "max_reward_drop", "clipped", "seconds")


def format_table(rows: list[dict], initial: float, args: BenchAsyncArguments) -> str:
    """Markdown table of the rows of [`aggregate_over_seeds`] (over [`TABLE_KEYS`])."""
    from .warm_start_bench import markdown_table

    n = len(args.seeds)

    def cell(row, key, scale=1.0, digits=3):
        text = f"{row[key] * scale:.{digits}f}"
        return text + (f" ± {row[key + '_std'] * scale:.{digits}f}" if n > 1 else "")

    caption = (
        f"Held-out accuracy (sampled mean@{args.eval_samples} at temperature 1.0, {args.eval_problems} unseen "
        f"two-digit additions) after {args.steps} asynchronous steps (16 prompts × 8 samples each, learning rate "
        f"{args.learning_rate:g}) from the same warm start, the samples of step s drawn from policy version s − lag; "
        f"{'mean ± std over ' if n > 1 else ''}{n} seed{'s' if n > 1 else ''} ({', '.join(map(str, args.seeds))}). "
        f"Warm start (before RL): {initial:.3f}."
    )
    header = [
        "Lag",
        "Method",
        "Last",
        "Gain (points)",
        "Best",
        "Max reward drop (points)",
        "Clipped tokens (%)",
        "Time (s)",
    ]
    cells = [
        [
            str(row["lag"]),
            row["method"],
            cell(row, "last"),
            cell(row, "gain", 100.0, 1),
            cell(row, "best"),
            cell(row, "max_reward_drop", 100.0, 1),
            cell(row, "clipped", 100.0, 1),
            f"{row['seconds']:.0f}",
        ]
        for row in rows
    ]
    return markdown_table(caption, header, cells)


def plot_results(results: list[dict], run_dirs: dict, output: str, args: BenchAsyncArguments) -> str:
    """Top row: held-out accuracy gain over the warm start per lag; bottom row: training reward (moving average)."""
    from ..toy.curves import REWARD_WINDOW, moving_average
    from .warm_start_bench import mean_gain_curve, mean_metric_curve, pyplot, runs_of, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(2, len(args.lags), figsize=(5 * len(args.lags), 7), squeeze=False, sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, lag in enumerate(args.lags):
        ax_acc, ax_reward = axes[0][column], axes[1][column]
        for index, method in enumerate(args.methods):
            runs = runs_of(results, {"lag": lag, "method": method})
            if not runs:
                continue
            color = colors[index % len(colors)]
            steps, mean, _ = mean_gain_curve(runs)
            ax_acc.plot(steps, mean, marker="o", markersize=3, color=color, label=method)
            steps, values = mean_metric_curve([run_dirs[(lag, method, r["seed"])] for r in runs], "reward")
            if values:
                ax_reward.plot(steps, moving_average(values, REWARD_WINDOW), color=color, label=method)
        ax_acc.set_title(f"lag {lag}: held-out accuracy gain (points)", fontsize=10)
        ax_reward.set_title(f"lag {lag}: training reward (moving avg.)", fontsize=10)
        for ax in (ax_acc, ax_reward):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    return save_figure(fig, axes[0][0], output, bottom=0.05, dpi=110)


def run_bench(args: BenchAsyncArguments) -> dict:
    """Run every (seed, lag, method) under a progress bar, then write ``table.md``, ``results.json`` and
    ``bench_async.png``."""
    from .warm_start_bench import run_warm_start_bench

    report = {"methods": {name: {"trainer": kind, **overrides} for name, (kind, overrides) in METHODS.items()}}
    return run_warm_start_bench(
        "bench_async", args, run_one, format_table, plot_results, TABLE_KEYS, report, progress=True
    )


def add_parser(subparsers):
    """Register ``rpg-trl bench-async`` (see [`rpg_research.cli`])."""
    from .warm_start_bench import add_bench_parser

    return add_bench_parser(
        subparsers,
        "bench-async",
        BenchAsyncArguments,
        help="Asynchronous GRPO vs asynchronous RPG at policy lags 1, 2, 4 on the demo's task (CPU, no vLLM).",
        description="Train TRL's AsyncGRPOTrainer and AsyncRPGTrainer (RPG-REINFORCE-URKL with β = 1e-4 and 0.5, and "
        "with GRPO's uncorrected k3) from the same supervised warm start of the demo's task, with rollouts sampled by "
        "a local worker a fixed number of policy versions behind the trainer; print held-out accuracy and stability "
        "per lag and method as a markdown table, and write table.md, results.json and bench_async.png.",
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-async`` with the parsed command-line `args`."""
    from .warm_start_bench import run_command

    return run_command(args, BenchAsyncArguments, run_bench, "bench_async")
