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

import time
from dataclasses import dataclass, field
from pathlib import Path

from .warm_start_bench import WarmStartBenchArguments, bench_presets, output_dir_field


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
#: Full and ``--quick`` presets of the options left unset on the command line (those of the warm start and the
#: held-out set: [`~rpg_trl.cli.warm_start_bench.WARM_START_PRESETS`]).
PRESETS = bench_presets(
    full={"seeds": [0, 1, 2], "steps": 150, "eval_every": 50},
    quick={"steps": 8, "sft_steps": 100, "eval_every": 4, "eval_problems": 64},
)


@dataclass
class BenchAlgosArguments(WarmStartBenchArguments):
    """Arguments of ``rpg-trl bench-algos``: the warm-start benchmarks' and the algorithms to run. Unset options take
    the full or the ``--quick`` preset ([`PRESETS`])."""

    output_dir: str = output_dir_field("runs/bench_algos")
    algorithms: list[str] | None = field(
        default=None, metadata={"help": f"Methods to run, a subset of {list(ALGORITHMS)}. Default: all."}
    )
    quick: bool = field(
        default=False, metadata={"help": "One seed, a short warm start and a few steps: a smoke test (~1 minute)."}
    )
    presets = PRESETS

    def __post_init__(self):
        from .warm_start_bench import chosen

        super().__post_init__()
        self.algorithms = chosen(self.algorithms, ALGORITHMS, list(ALGORITHMS), "algorithm")

    def arms(self) -> list[dict]:
        return [{"algorithm": algorithm} for algorithm in self.algorithms]


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
    from ..toy.curves import metric_series
    from ..toy.evaluation import heldout_accuracy_callback
    from ..toy.training import use_terse_progress
    from ..trainer import RPGTrainer
    from .warm_start_bench import heldout_summary

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
    return {"algorithm": algorithm, "seed": seed, **heldout_summary(accuracy.curve, rewards, seconds)}


#: Columns of the table: mean and standard deviation over seeds of each algorithm's Last, gain, Best, max reward drop
#: and time.
TABLE_KEYS = ("last", "gain", "best", "max_reward_drop", "seconds")


def format_table(rows: list[dict], initial: float, args: BenchAlgosArguments) -> str:
    """Markdown table of the rows of [`aggregate_over_seeds`] (over [`TABLE_KEYS`]), best Last/Best in bold."""
    from .warm_start_bench import markdown_table

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
    header = [
        "Method",
        "Last",
        "Gain over warm start (points)",
        "Best",
        "Max reward drop (points)",
        "Time per run (s)",
    ]
    cells = [
        [
            row["algorithm"],
            cell(row, "last", bold_at=best_last),
            cell(row, "gain", scale=100.0, digits=1),
            cell(row, "best", bold_at=best_best),
            cell(row, "max_reward_drop", scale=100.0, digits=1),
            f"{row['seconds']:.0f}",
        ]
        for row in rows
    ]
    return markdown_table(caption, header, cells)


def plot_results(results: list[dict], run_dirs: dict, output: str, args: BenchAlgosArguments) -> str:
    """
    Held-out accuracy gain over the warm start (mean over seeds, band ± one standard deviation), training reward and
    entropy (means over seeds, moving averages) of each method.
    """
    from ..toy.curves import REWARD_WINDOW, moving_average
    from .warm_start_bench import mean_gain_curve, mean_metric_curve, pyplot, runs_of, save_figure

    plt = pyplot()
    fig, (ax_acc, ax_reward, ax_entropy) = plt.subplots(1, 3, figsize=(15, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, algorithm in enumerate(args.algorithms):
        runs = runs_of(results, {"algorithm": algorithm})
        if not runs:
            continue
        color = colors[index % len(colors)]
        steps, mean, std = mean_gain_curve(runs)
        ax_acc.plot(steps, mean, marker="o", markersize=3, color=color, label=algorithm)
        if std is not None:
            ax_acc.fill_between(
                steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], color=color, alpha=0.07
            )
        for ax, key, window in ((ax_reward, "reward", REWARD_WINDOW), (ax_entropy, "entropy", 4 * REWARD_WINDOW)):
            steps, values = mean_metric_curve([run_dirs[(algorithm, r["seed"])] for r in runs], key)
            if values:
                ax.plot(steps, moving_average(values, window), color=color, label=algorithm)
    for ax, title in (
        (ax_acc, "(a) Held-out accuracy gain over the warm start (points)"),
        (ax_reward, "(b) Training reward (moving avg.)"),
        (ax_entropy, "(c) Entropy (moving avg.)"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_figure(fig, ax_acc, output, bottom=0.08, dpi=120, max_columns=6)


def run_bench(args: BenchAlgosArguments) -> dict:
    """Run every (seed, algorithm) pair, then write ``table.md``, ``results.json`` and ``bench_algos.png``."""
    from .warm_start_bench import run_warm_start_bench

    algorithms = {name: {"trainer": kind, **overrides} for name, (kind, overrides) in ALGORITHMS.items()}
    report = {"algorithms": algorithms}
    return run_warm_start_bench("bench_algos", args, run_one, format_table, plot_results, TABLE_KEYS, report)


def add_parser(subparsers):
    """Register ``rpg-trl bench-algos`` (see [`rpg_trl.cli`])."""
    from .warm_start_bench import add_bench_parser

    return add_bench_parser(
        subparsers,
        "bench-algos",
        BenchAlgosArguments,
        help="The paper's Table 3 in miniature: GRPO, DAPO, REINFORCE++(-Baseline) and four RPG variants from the same "
        "warm start.",
        description="Train GRPO, DAPO (TRL's GRPOTrainer), REINFORCE++, REINFORCE++-Baseline "
        "(rpg_trl.reinforce_plus_plus.ReinforcePlusPlusTrainer) and RPG-UFKL, RPG-URKL, RPG-REINFORCE-UFKL, "
        "RPG-REINFORCE-URKL (RPGTrainer) from the same supervised warm start of the demo's task, with the same "
        "budget, over several seeds; print the Last/Best held-out accuracy and a stability measure as a markdown "
        "table, and write table.md, results.json and bench_algos.png.",
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-algos`` with the parsed command-line `args`."""
    from .warm_start_bench import run_command

    return run_command(args, BenchAlgosArguments, run_bench, "bench_algos")
