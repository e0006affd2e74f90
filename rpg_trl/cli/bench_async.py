# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl bench-async`` command: asynchronous GRPO against asynchronous RPG at increasing policy lag.

Every run trains the warm start of ``rpg-trl demo`` (two-digit additions, see [`rpg_trl.toy.warm_start`]; one supervised warm
start per seed, shared by all runs, as in ``rpg-trl bench-algos``) with TRL's asynchronous trainer on a CPU: a
[`~rpg_trl.cpu_rollouts.LocalRolloutWorker`] thread samples the rollouts of optimizer step ``s`` from policy
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

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..toy.curves import mean_std
from . import machine


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
#: Full and ``--quick`` presets of the options left unset on the command line.
PRESETS = {
    "full": {
        "seeds": [0],
        "steps": 60,
        "sft_steps": 1500,
        "sft_extra_rounds": 3,
        "eval_every": 20,
        "eval_problems": 400,
    },
    "quick": {"seeds": [0], "steps": 4, "sft_steps": 50, "sft_extra_rounds": 0, "eval_every": 2, "eval_problems": 32},
}


@dataclass
class BenchAsyncArguments:
    """Arguments of ``rpg-trl bench-async``. Unset options take the full or the ``--quick`` preset ([`PRESETS`])."""

    output_dir: str = field(
        default="runs/bench_async", metadata={"help": "Where to write table.md, results.json, the plot and the runs."}
    )
    lags: list[int] = field(
        default_factory=lambda: [1, 2, 4],
        metadata={"help": "Policy lags to compare: the samples of step s come from policy version s - lag."},
    )
    methods: list[str] | None = field(
        default=None, metadata={"help": f"Methods to run, a subset of {list(METHODS)}. Default: {DEFAULT_METHODS}."}
    )
    seeds: list[int] | None = field(
        default=None, metadata={"help": "Seeds (each with its own warm start). Preset: 0 (--quick: 0)."}
    )
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps per run. Preset: 60 (--quick: 4)."})
    learning_rate: float = field(default=6e-4, metadata={"help": "Learning rate of every run (the demo's)."})
    sft_steps: int | None = field(
        default=None, metadata={"help": "Warm-start steps per seed. Preset: 1500 (--quick: 50)."}
    )
    sft_extra_rounds: int | None = field(
        default=None,
        metadata={"help": "Extra warm-start rounds while the model cannot add yet. Preset: 3 (--quick: 0)."},
    )
    eval_every: int | None = field(
        default=None, metadata={"help": "Held-out evaluation every this many steps. Preset: 20 (--quick: 2)."}
    )
    eval_problems: int | None = field(
        default=None, metadata={"help": "Number of held-out problems. Preset: 400 (--quick: 32)."}
    )
    eval_samples: int = field(default=4, metadata={"help": "Completions per held-out problem (mean@k)."})
    quick: bool = field(default=False, metadata={"help": "A few steps on a barely warm model: a smoke test."})
    num_threads: int = field(
        default=1, metadata={"help": "Torch CPU threads of the trainer (the rollout thread shares them)."}
    )

    def __post_init__(self):
        from . import apply_preset, check_arguments

        apply_preset(self, PRESETS, self.quick)
        if self.methods is None:
            self.methods = list(DEFAULT_METHODS)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"Unknown method(s) {unknown}; choose among {list(METHODS)}.")
        if not self.seeds:
            raise ValueError(f"`seeds` must list at least one seed; got {self.seeds!r}.")
        if not self.lags or any(isinstance(lag, bool) or not isinstance(lag, int) or lag < 1 for lag in self.lags):
            raise ValueError(f"`lags` must list integers >= 1 (policy versions of lag); got {self.lags!r}.")
        check_arguments(
            self,
            at_least_one=("steps", "eval_every", "eval_problems", "eval_samples", "num_threads"),
            at_least_zero=("sft_steps", "sft_extra_rounds"),
            positive=("learning_rate",),
        )


def _config(kind: str, output_dir: str, args: BenchAsyncArguments, seed: int, lag: int, overrides: dict):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from ..async_rpg import AsyncRPGConfig
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

    from ..async_rpg import AsyncRPGTrainer
    from ..cpu_rollouts import LocalRolloutWorker, cpu_backend
    from ..toy.addition import addition_reward, build_rl_dataset, evaluation_seed
    from ..toy.curves import REWARD_WINDOW, max_drawdown, metric_series, moving_average
    from ..toy.evaluation import heldout_accuracy_callback
    from ..toy.training import use_terse_progress

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
    accuracies = [e["heldout/accuracy"] for e in accuracy.curve]
    return {
        "method": method,
        "lag": lag,
        "seed": seed,
        "initial": accuracies[0],
        "last": accuracies[-1],
        "gain": accuracies[-1] - accuracies[0],
        "best": max(accuracies[1:]) if len(accuracies) > 1 else accuracies[0],
        "max_reward_drop": max_drawdown(moving_average(rewards, REWARD_WINDOW)),
        "clipped": statistics.fmean(clipped) if clipped else math.nan,
        # The lag measured by AsyncRPGTrainer (trainer version − sampler version, per batch); the worker's by design.
        "staleness_measured": statistics.fmean(staleness[lag:]) if len(staleness) > lag else None,
        "sampled_versions": worker.sampled_versions[: args.steps],
        "seconds": seconds,
        "accuracy_curve": [{"step": e["step"], "accuracy": e["heldout/accuracy"]} for e in accuracy.curve],
    }


def aggregate(results: list[dict], args: BenchAsyncArguments) -> list[dict]:
    """Mean and standard deviation over seeds of each (lag, method)'s Last, gain, Best, reward drop, clip and time."""
    rows = []
    for lag in args.lags:
        for method in args.methods:
            runs = [r for r in results if r["method"] == method and r["lag"] == lag]
            if not runs:
                continue
            row = {"lag": lag, "method": method, "seeds": len(runs)}
            for key in ("last", "gain", "best", "max_reward_drop", "clipped", "seconds"):
                row[key], row[key + "_std"] = mean_std([r[key] for r in runs])
            rows.append(row)
    return rows


def format_table(rows: list[dict], initial: float, args: BenchAsyncArguments) -> str:
    """Markdown table of [`aggregate`]'s rows."""
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
    lines = [
        caption,
        "",
        "| Lag | Method | Last | Gain (points) | Best | Max reward drop (points) | Clipped tokens (%) | Time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['lag']} | {row['method']} | {cell(row, 'last')} | {cell(row, 'gain', 100.0, 1)} "
            f"| {cell(row, 'best')} | {cell(row, 'max_reward_drop', 100.0, 1)} | {cell(row, 'clipped', 100.0, 1)} "
            f"| {row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_results(results: list[dict], run_dirs: dict, output: str, args: BenchAsyncArguments) -> str:
    """Top row: held-out accuracy gain over the warm start per lag; bottom row: training reward (moving average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..toy.curves import REWARD_WINDOW, load_log_history, metric_series, moving_average

    fig, axes = plt.subplots(2, len(args.lags), figsize=(5 * len(args.lags), 7), squeeze=False, sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, lag in enumerate(args.lags):
        ax_acc, ax_reward = axes[0][column], axes[1][column]
        for index, method in enumerate(args.methods):
            runs = [r for r in results if r["method"] == method and r["lag"] == lag]
            if not runs:
                continue
            color = colors[index % len(colors)]
            steps = [p["step"] for p in runs[0]["accuracy_curve"]]
            gains = [[100.0 * (p["accuracy"] - r["initial"]) for p in r["accuracy_curve"]] for r in runs]
            mean = [statistics.fmean(g[i] for g in gains) for i in range(len(steps))]
            ax_acc.plot(steps, mean, marker="o", markersize=3, color=color, label=method)
            series = [metric_series(load_log_history(run_dirs[(method, lag, r["seed"])]), "reward") for r in runs]
            length = min(len(s[1]) for s in series)
            if length:
                values = [statistics.fmean(s[1][i] for s in series) for i in range(length)]
                ax_reward.plot(series[0][0][:length], moving_average(values, REWARD_WINDOW), color=color, label=method)
        ax_acc.set_title(f"lag {lag}: held-out accuracy gain (points)", fontsize=10)
        ax_reward.set_title(f"lag {lag}: training reward (moving avg.)", fontsize=10)
        for ax in (ax_acc, ax_reward):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def run_bench(args: BenchAsyncArguments) -> dict:
    """Run every (seed, lag, method), then write ``table.md``, ``results.json`` and ``bench_async.png``."""
    from ..toy.training import cpu_session

    with cpu_session(args.num_threads):
        return _run_bench(args)


def _run_bench(args: BenchAsyncArguments) -> dict:
    start = time.perf_counter()
    from tqdm.auto import tqdm

    from ..toy.addition import make_splits
    from ..toy.warm_start import cached_warm_start

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results, run_dirs, warm_starts = [], {}, {}
    runs = [(seed, lag, method) for seed in args.seeds for lag in args.lags for method in args.methods]
    progress = tqdm(total=len(runs), desc="bench-async runs", position=1, leave=True)
    for seed in args.seeds:
        splits = make_splits(seed, num_eval=args.eval_problems)
        sft_dir = output_dir / f"seed{seed}" / "sft"
        warm_starts[seed] = cached_warm_start(
            splits, sft_dir, steps=args.sft_steps, seed=seed, extra_rounds=args.sft_extra_rounds
        )
        for lag in args.lags:
            for method in args.methods:
                run_dir = output_dir / f"seed{seed}" / f"lag{lag}" / method
                progress.set_postfix_str(f"seed {seed}, lag {lag}, {method}")
                result = run_one(args, method, lag, seed, splits, str(sft_dir), run_dir)
                run_dirs[(method, lag, seed)] = str(run_dir)
                results.append(result)
                progress.update()
                tqdm.write(
                    f"[seed {seed}, lag {lag}] {method}: held-out accuracy {result['initial']:.3f} -> "
                    f"{result['last']:.3f} (best {result['best']:.3f}) in {result['seconds']:.0f} s"
                )
    progress.close()
    rows = aggregate(results, args)
    initial = statistics.fmean(r["initial"] for r in results)
    table = format_table(rows, initial, args)
    (output_dir / "table.md").write_text(table)
    plot_results(results, run_dirs, str(output_dir / "bench_async.png"), args)
    report = {
        "table": rows,
        "runs": results,
        "initial_accuracy": initial,
        "warm_starts": warm_starts,
        "seconds": time.perf_counter() - start,
        "arguments": asdict(args),
        "machine": machine(),
        "methods": {name: {"trainer": kind, **overrides} for name, (kind, overrides) in METHODS.items()},
    }
    (output_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_parser(subparsers):
    """Register ``rpg-trl bench-async`` (see [`rpg_trl.cli`])."""
    return subparsers.add_parser(
        "bench-async",
        help="Asynchronous GRPO vs asynchronous RPG at policy lags 1, 2, 4 on the demo's task (CPU, no vLLM).",
        description="Train TRL's AsyncGRPOTrainer and AsyncRPGTrainer (RPG-REINFORCE-URKL with β = 1e-4 and 0.5, and "
        "with GRPO's uncorrected k3) from the same supervised warm start of the demo's task, with rollouts sampled by "
        "a local worker a fixed number of policy versions behind the trainer; print held-out accuracy and stability "
        "per lag and method as a markdown table, and write table.md, results.json and bench_async.png.",
        dataclass_types=[BenchAsyncArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-async`` with the parsed command-line `args`."""
    from . import dataclass_arguments, print_report

    bench_args = dataclass_arguments(args, BenchAsyncArguments)
    report = run_bench(bench_args)
    print_report(
        bench_args.output_dir, report["seconds"], f"{bench_args.output_dir}/table.md, results.json and bench_async.png"
    )
    return 0
