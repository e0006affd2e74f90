# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl bench-algos`` command: the paper's Table 3 in miniature, on the demo's task.

Eight algorithms train the same warm-started model (one supervised warm start per seed, shared by all of them, see
[`rpg_trl.toy.warm_start`]) with the same budget: the same prompts, batch (16 prompts × 8 samples per optimizer step, four
optimizer steps per generation batch), optimizer, learning rate and number of steps.

============================  ==========================================================================================
method                        configuration
============================  ==========================================================================================
GRPO                          TRL `GRPOTrainer`, `loss_type="grpo"`, clip ε = 0.2 (both sides), std-scaled group
                              advantages, k3 KL to the initial policy with β = 1e-4 without the importance weight
                              (`use_bias_correction_kl=False`: GRPO as the paper ran it, verl's k3 KL loss)
DAPO                          TRL `GRPOTrainer`, `loss_type="dapo"` (token-mean), clip-higher ε = (0.2, 0.28),
                              std-scaled group advantages, no KL
RPG-UFKL / RPG-URKL           `RPGTrainer`, `estimator="differentiable"`, `divergence="ufkl"` / `"urkl"`
RPG-REINFORCE-UFKL / -URKL    `RPGTrainer`, `estimator="reinforce"`, `divergence="ufkl"` / `"urkl"`
REINFORCE++ / -Baseline       [`~rpg_trl.reinforce_plus_plus.ReinforcePlusPlusTrainer`] (Hu, 2025; the paper's Tables 5 and 6):
                              TRL's token-mean loss, clip ε = 0.2 (both sides), β·k1 to the initial policy in the token
                              rewards with β = 1e-4, the return (minus the group mean for -Baseline) whitened over the
                              batch's tokens
============================  ==========================================================================================

RPG runs use [`RPGConfig`]'s paper defaults: advantage = reward − group mean, β = 1e-4, RPG-Style Clip with
ε = (0.2, 0.28) and c = 10, KL anchored to the sampling policy. (The paper's GRPO uses ε = 0.2 in Sec. 5 and
ε = 0.1 in Appendix H; this benchmark follows Sec. 5 and TRL's default. Dynamic sampling and overlong shaping, which
the paper applies to every method, do not apply to this task.)

Reported per method, over seeds (mean ± sample standard deviation):

- **Last**: held-out accuracy (sampled mean@4 at temperature 1, as in the demo) after the last step;
- **Gain**: Last minus the warm start's accuracy, in points (the seeds' warm starts differ, so the spread of the
  gain is smaller than that of Last);
- **Best**: the best held-out accuracy among the evaluations during training (every ``eval_every`` steps);
- **Max reward drop**: stability, the largest fall of the training reward curve (moving average over 5 generation
  batches) below its running maximum, in accuracy points; 0 for a reward that never decreases.

Outputs in ``--output_dir``: ``table.md``, ``results.json``, ``bench_algos.png`` and, per seed, the warm start
(``seed<k>/sft``) and each run's trainer state (``seed<k>/<method>``, readable by ``rpg-trl plot``).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..toy.curves import mean_std
from . import machine


#: Algorithm name -> (trainer, configuration overrides). "grpo" runs TRL's GRPOTrainer, "rpg" runs RPGTrainer, "rfpp"
#: runs `rpg_trl.reinforce_plus_plus.ReinforcePlusPlusTrainer`.
ALGORITHMS = {
    "GRPO": (
        "grpo",
        {
            "loss_type": "grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "scale_rewards": "group",
            "beta": 1e-4,
            "use_bias_correction_kl": False,
        },
    ),
    "DAPO": (
        "grpo",
        {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group", "beta": 0.0},
    ),
    "RPG-UFKL": ("rpg", {"divergence": "ufkl", "estimator": "differentiable"}),
    "RPG-URKL": ("rpg", {"divergence": "urkl", "estimator": "differentiable"}),
    "RPG-REINFORCE-UFKL": ("rpg", {"divergence": "ufkl", "estimator": "reinforce"}),
    "RPG-REINFORCE-URKL": ("rpg", {"divergence": "urkl", "estimator": "reinforce"}),
    "REINFORCE++": (
        "rfpp",
        {"advantage_estimator": "reinforce_plus_plus", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 1e-4},
    ),
    "REINFORCE++-Baseline": (
        "rfpp",
        {"advantage_estimator": "reinforce_plus_plus_baseline", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 1e-4},
    ),
}
#: Full and ``--quick`` presets of the options left unset on the command line.
PRESETS = {
    "full": {
        "seeds": [0, 1, 2],
        "steps": 150,
        "sft_steps": 1500,
        "sft_extra_rounds": 3,
        "eval_every": 50,
        "eval_problems": 400,
    },
    "quick": {"seeds": [0], "steps": 8, "sft_steps": 100, "sft_extra_rounds": 0, "eval_every": 4, "eval_problems": 64},
}


@dataclass
class BenchAlgosArguments:
    """Arguments of ``rpg-trl bench-algos``. Unset options take the full or the ``--quick`` preset ([`PRESETS`])."""

    output_dir: str = field(
        default="runs/bench_algos", metadata={"help": "Where to write table.md, results.json, the plot and the runs."}
    )
    seeds: list[int] | None = field(
        default=None, metadata={"help": "Seeds (each with its own warm start). Preset: 0 1 2 (--quick: 0)."}
    )
    steps: int | None = field(default=None, metadata={"help": "RL steps per run. Preset: 150 (--quick: 8)."})
    sft_steps: int | None = field(
        default=None, metadata={"help": "Warm-start steps per seed. Preset: 1500 (--quick: 100)."}
    )
    sft_extra_rounds: int | None = field(
        default=None,
        metadata={
            "help": "Extra warm-start rounds while the model cannot add yet (see `rpg-trl demo`). Preset: 3 "
            "(--quick: 0)."
        },
    )
    algorithms: list[str] | None = field(
        default=None, metadata={"help": f"Methods to run, a subset of {list(ALGORITHMS)}. Default: all."}
    )
    learning_rate: float = field(default=6e-4, metadata={"help": "Learning rate of every method (the demo's)."})
    eval_every: int | None = field(
        default=None, metadata={"help": "Held-out evaluation every this many steps. Preset: 50 (--quick: 4)."}
    )
    eval_problems: int | None = field(
        default=None, metadata={"help": "Number of held-out problems. Preset: 400 (--quick: 64)."}
    )
    eval_samples: int = field(default=4, metadata={"help": "Completions per held-out problem (mean@k)."})
    quick: bool = field(
        default=False, metadata={"help": "One seed, a short warm start and a few steps: a smoke test (~1 minute)."}
    )
    num_threads: int = field(default=1, metadata={"help": "Torch CPU threads (see `rpg-trl demo`)."})

    def __post_init__(self):
        from . import apply_preset, check_arguments

        apply_preset(self, PRESETS, self.quick)
        if self.algorithms is None:
            self.algorithms = list(ALGORITHMS)
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown:
            raise ValueError(f"Unknown algorithm(s) {unknown}; choose among {list(ALGORITHMS)}.")
        if not self.seeds:
            raise ValueError(f"`seeds` must list at least one seed; got {self.seeds!r}.")
        check_arguments(
            self,
            at_least_one=("steps", "eval_every", "eval_problems", "eval_samples", "num_threads"),
            at_least_zero=("sft_steps", "sft_extra_rounds"),
            positive=("learning_rate",),
        )


def _config(kind: str, output_dir: str, args: BenchAlgosArguments, seed: int, overrides: dict):
    from trl import GRPOConfig

    from ..config import RPGConfig
    from ..reinforce_plus_plus import ReinforcePlusPlusConfig
    from ..toy.training import rl_training_kwargs

    kwargs = rl_training_kwargs(steps=args.steps, seed=seed, learning_rate=args.learning_rate)
    config_class = {"rpg": RPGConfig, "grpo": GRPOConfig, "rfpp": ReinforcePlusPlusConfig}[kind]
    return config_class(output_dir=output_dir, **kwargs, **overrides)


def run_one(args: BenchAlgosArguments, algorithm: str, seed: int, splits, sft_dir: str, run_dir: Path) -> dict:
    """Train `algorithm` from the warm start in `sft_dir` and return its held-out accuracy curve and reward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from ..reinforce_plus_plus import ReinforcePlusPlusTrainer
    from ..toy.addition import addition_reward, build_rl_dataset, evaluation_seed
    from ..toy.curves import REWARD_WINDOW, max_drawdown, metric_series, moving_average
    from ..toy.evaluation import heldout_accuracy_callback
    from ..toy.training import use_terse_progress
    from ..trainer import RPGTrainer

    kind, overrides = ALGORITHMS[algorithm]
    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    accuracy = heldout_accuracy_callback(
        model, tokenizer, splits.eval, every=args.eval_every, num_samples=args.eval_samples, seed=evaluation_seed(seed)
    )
    trainer_class = {"rpg": RPGTrainer, "grpo": GRPOTrainer, "rfpp": ReinforcePlusPlusTrainer}[kind]
    trainer = trainer_class(
        model=model,
        reward_funcs=addition_reward,
        args=_config(kind, str(run_dir), args, seed, overrides),
        train_dataset=build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[accuracy],
    )
    use_terse_progress(trainer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    _, rewards = metric_series(trainer.state.log_history, "reward")
    accuracies = [e["heldout/accuracy"] for e in accuracy.curve]
    return {
        "algorithm": algorithm,
        "seed": seed,
        "initial": accuracies[0],
        "last": accuracies[-1],
        "gain": accuracies[-1] - accuracies[0],
        "best": max(accuracies[1:]) if len(accuracies) > 1 else accuracies[0],
        "max_reward_drop": max_drawdown(moving_average(rewards, REWARD_WINDOW)),
        "seconds": seconds,
        "accuracy_curve": [{"step": e["step"], "accuracy": e["heldout/accuracy"]} for e in accuracy.curve],
    }


def aggregate(results: list[dict], algorithms: list[str]) -> list[dict]:
    """Mean and standard deviation over seeds of each algorithm's Last, gain, Best, max reward drop and time."""
    rows = []
    for algorithm in algorithms:
        runs = [r for r in results if r["algorithm"] == algorithm]
        if not runs:
            continue
        row = {"algorithm": algorithm, "seeds": len(runs)}
        for key in ("last", "gain", "best", "max_reward_drop", "seconds"):
            row[key], row[key + "_std"] = mean_std([r[key] for r in runs])
        rows.append(row)
    return rows


def format_table(rows: list[dict], initial: float, args: BenchAlgosArguments) -> str:
    """Markdown table of [`aggregate`]'s rows, best Last/Best in bold."""
    n = len(args.seeds)
    best_last = max(r["last"] for r in rows)
    best_best = max(r["best"] for r in rows)

    def cell(row, key, scale=1.0, digits=3, bold_at=None):
        text = f"{row[key] * scale:.{digits}f} ± {row[key + '_std'] * scale:.{digits}f}"
        return f"**{text}**" if bold_at is not None and row[key] == bold_at else text

    caption = (
        f"Held-out accuracy (sampled mean@{args.eval_samples} at temperature 1.0, {args.eval_problems} unseen "
        f"two-digit additions) after {args.steps} RL steps from the same warm start; mean ± std over {n} "
        f"seed{'s' if n > 1 else ''} ({', '.join(map(str, args.seeds))}). Warm start (before RL): {initial:.3f}."
    )
    lines = [
        caption,
        "",
        "| Method | Last | Gain over warm start (points) | Best | Max reward drop (points) | Time per run (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['algorithm']} | {cell(row, 'last', bold_at=best_last)} "
            f"| {cell(row, 'gain', scale=100.0, digits=1)} | {cell(row, 'best', bold_at=best_best)} "
            f"| {cell(row, 'max_reward_drop', scale=100.0, digits=1)} | {row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_results(results: list[dict], run_dirs: dict, output: str, algorithms: list[str]) -> str:
    """
    Held-out accuracy gain over the warm start (mean over seeds, band ± one standard deviation), training reward and
    entropy (means over seeds, moving averages) of each method.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..toy.curves import REWARD_WINDOW, load_log_history, metric_series, moving_average

    fig, (ax_acc, ax_reward, ax_entropy) = plt.subplots(1, 3, figsize=(15, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, algorithm in enumerate(algorithms):
        runs = [r for r in results if r["algorithm"] == algorithm]
        if not runs:
            continue
        color = colors[index % len(colors)]
        steps = [p["step"] for p in runs[0]["accuracy_curve"]]
        # Gains over each seed's own warm start: the warm starts differ more between seeds than the methods do.
        gains = [[100.0 * (p["accuracy"] - r["initial"]) for p in r["accuracy_curve"]] for r in runs]
        mean = [statistics.fmean(g[i] for g in gains) for i in range(len(steps))]
        ax_acc.plot(steps, mean, marker="o", markersize=3, color=color, label=algorithm)
        if len(gains) > 1:
            std = [statistics.stdev(g[i] for g in gains) for i in range(len(steps))]
            ax_acc.fill_between(
                steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], color=color, alpha=0.07
            )
        for ax, key, window in ((ax_reward, "reward", REWARD_WINDOW), (ax_entropy, "entropy", 4 * REWARD_WINDOW)):
            series = [metric_series(load_log_history(run_dirs[(algorithm, r["seed"])]), key) for r in runs]
            length = min(len(s[1]) for s in series)
            if length == 0:
                continue
            values = [statistics.fmean(s[1][i] for s in series) for i in range(length)]
            ax.plot(series[0][0][:length], moving_average(values, window), color=color, label=algorithm)
    for ax, title in (
        (ax_acc, "(a) Held-out accuracy gain over the warm start (points)"),
        (ax_reward, "(b) Training reward (moving avg.)"),
        (ax_entropy, "(c) Entropy (moving avg.)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = ax_acc.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def run_bench(args: BenchAlgosArguments) -> dict:
    """Run every (seed, algorithm) pair, then write ``table.md``, ``results.json`` and ``bench_algos.png``."""
    from ..toy.training import cpu_session

    with cpu_session(args.num_threads):
        return _run_bench(args)


def _run_bench(args: BenchAlgosArguments) -> dict:
    start = time.perf_counter()
    from ..toy.addition import make_splits
    from ..toy.warm_start import cached_warm_start

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results, run_dirs, warm_starts = [], {}, {}
    for seed in args.seeds:
        splits = make_splits(seed, num_eval=args.eval_problems)
        sft_dir = output_dir / f"seed{seed}" / "sft"
        warm_starts[seed] = cached_warm_start(
            splits, sft_dir, steps=args.sft_steps, seed=seed, extra_rounds=args.sft_extra_rounds
        )
        for algorithm in args.algorithms:
            run_dir = output_dir / f"seed{seed}" / algorithm
            print(f"[seed {seed}] {algorithm}: {args.steps} steps")
            result = run_one(args, algorithm, seed, splits, str(sft_dir), run_dir)
            run_dirs[(algorithm, seed)] = str(run_dir)
            results.append(result)
            print(
                f"[seed {seed}] {algorithm}: held-out accuracy {result['initial']:.3f} -> {result['last']:.3f} "
                f"(best {result['best']:.3f}) in {result['seconds']:.0f} s"
            )
    rows = aggregate(results, args.algorithms)
    initial = statistics.fmean(r["initial"] for r in results)
    table = format_table(rows, initial, args)
    (output_dir / "table.md").write_text(table)
    plot_results(results, run_dirs, str(output_dir / "bench_algos.png"), args.algorithms)
    report = {
        "table": rows,
        "runs": results,
        "initial_accuracy": initial,
        "warm_starts": warm_starts,
        "seconds": time.perf_counter() - start,
        "arguments": asdict(args),
        "machine": machine(),
        "algorithms": {name: {"trainer": kind, **overrides} for name, (kind, overrides) in ALGORITHMS.items()},
    }
    (output_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_parser(subparsers):
    """Register ``rpg-trl bench-algos`` (see [`rpg_trl.cli`])."""
    return subparsers.add_parser(
        "bench-algos",
        help="The paper's Table 3 in miniature: GRPO, DAPO, REINFORCE++(-Baseline) and four RPG variants from the same "
        "warm start.",
        description="Train GRPO, DAPO (TRL's GRPOTrainer), REINFORCE++, REINFORCE++-Baseline "
        "(rpg_trl.reinforce_plus_plus.ReinforcePlusPlusTrainer) and RPG-UFKL, RPG-URKL, RPG-REINFORCE-UFKL, "
        "RPG-REINFORCE-URKL (RPGTrainer) from the same supervised warm start of the demo's task, with the same "
        "budget, over several seeds; print the Last/Best held-out accuracy and a stability measure as a markdown "
        "table, and write table.md, results.json and bench_algos.png.",
        dataclass_types=[BenchAlgosArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-algos`` with the parsed command-line `args`."""
    from . import dataclass_arguments, print_report

    bench_args = dataclass_arguments(args, BenchAlgosArguments)
    report = run_bench(bench_args)
    print_report(
        bench_args.output_dir, report["seconds"], f"{bench_args.output_dir}/table.md, results.json and bench_algos.png"
    )
    return 0
