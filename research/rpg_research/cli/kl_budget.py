# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl kl-budget`` command: the adaptive KL coefficient (`kl_target`) holding RPG's KL near a target.

A tiny Qwen3 (built locally, [`rpg_research.toy.save_tiny_model`]) is trained by [`~rpg_trl.RPGTrainer`] on the prompts
"a+b=" (a, b = 0..9) with a reward that the initial policy rarely earns: the fraction of '7' characters in an 8-token
completion. Without a KL budget the policy runs away from its reference to print sevens; with `kl_target=δ` the
controller of [`rpg_trl.kl_control`] raises β while the importance-weighted KL to the reference (RPG-REINFORCE-URKL,
`kl_anchor="reference"`) is above δ and lowers it while below. One run per target, the same seed and model:

- 16 completions per optimizer step (4 prompts × 4 samples), completions of at most 8 tokens, temperature 1;
- SGD with learning rate 1 and TRL's gradient clipping at 1 (so that β scales the update);
- β starts at 0.1 with horizon 64 samples (β moves by at most ±5% per step), no floor or ceiling.

Outputs in ``--output_dir``: ``kl_budget.png`` (the KL of every step with its target, and β, over the steps),
``results.json`` (per target: the per-step KL, β and reward, the median and quartiles of the KL over the second half
of the run; the arguments and the machine) and each run's trainer state (``target_<δ>/``).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


#: "a+b=" for a, b = 0..9.
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]
COMPLETION_LENGTH = 8


def sevens_reward(completions, **kwargs):
    """The fraction of '7' characters in a completion of at most 8 characters."""
    return [c.count("7") / COMPLETION_LENGTH for c in completions]


@dataclass
class KLBudgetArguments:
    """Arguments of ``rpg-trl kl-budget``."""

    targets: list[float] = field(
        default_factory=lambda: [0.05, 0.2], metadata={"help": "KL targets δ (`kl_target`), one run each."}
    )
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps per run."})
    beta: float = field(default=0.1, metadata={"help": "Initial β."})
    kl_horizon: float = field(default=64.0, metadata={"help": "Horizon H of the controller, in samples."})
    learning_rate: float = field(default=1.0, metadata={"help": "SGD learning rate."})
    seed: int = field(default=0, metadata={"help": "Seed of the model and of the run."})
    num_threads: int = field(default=1, metadata={"help": "torch threads."})
    output_dir: str = field(default="runs/kl_budget", metadata={"help": "Where the figure and results go."})

    def __post_init__(self):
        from . import check_arguments

        if not self.targets or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in self.targets
        ):
            raise ValueError(f"`targets` must be one or more numbers > 0; got {self.targets!r}.")
        check_arguments(
            self, at_least_one=("max_steps", "num_threads"), positive=("beta", "kl_horizon", "learning_rate")
        )


def train_with_budget(model_dir: str, output_dir: str, target: float, args: KLBudgetArguments) -> dict:
    """Train one run with `kl_target=target`; return its per-step `kl` (the divergence the controller saw), `beta`
    (the coefficient each step's loss used) and `reward`."""
    from datasets import Dataset
    from transformers import PrinterCallback

    from rpg_trl.config import RPGConfig
    from rpg_trl.trainer import RPGTrainer

    from ..toy.models import build_char_tokenizer
    from ..toy.training import no_activation_checkpointing

    config = RPGConfig(
        output_dir=output_dir,
        kl_anchor="reference",
        kl_target=target,
        kl_horizon=args.kl_horizon,
        beta=args.beta,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=COMPLETION_LENGTH,
        max_steps=args.max_steps,
        optim="sgd",
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        **no_activation_checkpointing(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = RPGTrainer(
        model_dir,
        sevens_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_char_tokenizer(),
    )
    trainer.remove_callback(PrinterCallback)  # the figure and results.json report the run, not a dict per step
    trainer.train()
    trainer.save_state()
    history = [h for h in trainer.state.log_history if "kl_control/kl" in h]
    kl = [h["kl_control/kl"] for h in history]
    return {
        "target": target,
        "step": [h["step"] for h in history],
        "kl": kl,
        "beta": [h["beta"] for h in history],
        "reward": [h["reward"] for h in history],
        "median_kl_second_half": statistics.median(kl[len(kl) // 2 :]),
        "quartiles_kl_second_half": statistics.quantiles(kl[len(kl) // 2 :], n=4),
    }


def plot_runs(runs: list[dict], path: str) -> str:
    """KL per step with its target (top) and β (bottom, log scale), one colour per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for i, run in enumerate(runs):
        color = f"C{i}"
        label = f"kl_target = {run['target']:g}"
        top.plot(run["step"], run["kl"], color=color, lw=1, label=label)
        top.axhline(run["target"], color=color, ls="--", lw=1)
        bottom.plot(run["step"], run["beta"], color=color, lw=1.5, label=label)
    top.set_yscale("log")
    top.set_ylabel("KL to π_ref (RPG estimate)")
    top.set_title("RPG's KL estimate per step (dashed: the targets)")
    top.legend()
    bottom.set_yscale("log")
    bottom.set_ylabel("β")
    bottom.set_xlabel("optimizer step")
    bottom.set_title("β set by the adaptive controller")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_kl_budget(args: KLBudgetArguments) -> dict:
    """Build the tiny model, train one run per target, write ``results.json`` and ``kl_budget.png``."""
    from transformers.utils import logging as hf_logging

    from ..toy.models import save_tiny_model
    from ..toy.training import cpu_session
    from . import machine

    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with cpu_session(args.num_threads):
            model_dir = save_tiny_model(output_dir / "model", seed=args.seed)
            runs = [
                train_with_budget(model_dir, str(output_dir / f"target_{target:g}"), target, args)
                for target in args.targets
            ]
            measured_on = machine()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    figure = plot_runs(runs, str(output_dir / "kl_budget.png"))
    report = {
        "runs": runs,
        "arguments": asdict(args),
        "machine": measured_on,
        "seconds": round(time.perf_counter() - start, 1),
        "figure": figure,
    }
    (output_dir / "results.json").write_text(json.dumps(report, indent=1))
    return report


def add_parser(subparsers):
    """Register ``rpg-trl kl-budget`` (see [`rpg_research.cli`])."""
    return subparsers.add_parser(
        "kl-budget",
        help="The adaptive KL coefficient (kl_target) holding RPG's KL near two targets on a tiny model.",
        description="Train a tiny Qwen3 with RPGTrainer and kl_target set to each target; write kl_budget.png (KL and "
        "β over the steps) and results.json.",
        dataclass_types=[KLBudgetArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl kl-budget`` with the parsed command-line `args`."""
    from . import dataclass_arguments

    budget_args = dataclass_arguments(args, KLBudgetArguments)
    report = run_kl_budget(budget_args)
    for r in report["runs"]:
        q1, median, q3 = r["quartiles_kl_second_half"]
        print(
            f"kl_target = {r['target']:g}: KL of steps {r['step'][len(r['step']) // 2]}-{r['step'][-1]}: median "
            f"{median:.4f}, quartiles {q1:.4f}-{q3:.4f}; β there {min(r['beta'][len(r['beta']) // 2 :]):.4g}-"
            f"{max(r['beta'][len(r['beta']) // 2 :]):.4g}, final {r['beta'][-1]:.4g}"
        )
    print(f"Total time {report['seconds']:.0f} s. Wrote {report['figure']} and {budget_args.output_dir}/results.json")
    return 0
