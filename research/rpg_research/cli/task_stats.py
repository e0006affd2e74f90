# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl task-stats`` command: how uncertain a task's warm start is on its own completions.

For a task of ``rpg-trl bench-algos --task`` ([`rpg_research.cli.bench_tasks`]) and a seed, it trains the seed's warm
start (or reuses the one cached in ``--output_dir``, as ``bench-algos`` caches them:
[`rpg_research.cli.bench_tasks.cached_task_warm_start`]), samples ``--eval_samples`` completions per held-out problem
at temperature 1 (the draws of the held-out evaluation, [`rpg_research.toy.addition.evaluation_seed`]) and prints
([`rpg_research.toy.evaluation.completion_statistics`]):

* the fraction of the completion tokens (the end token included) at which the model's next-token entropy is at least
  ``--threshold`` nats: the tokens where importance weights can move, which a long completion compounds;
* the mean entropy per token, the tokens and characters per completion;
* the held-out score (the task's reward, sampled mean@``eval_samples``: the number the demo and the benchmarks
  start from).

```bash
rpg-trl task-stats --task ring_walk                     # seed 0's warm start, in runs/task_stats/ring_walk/seed0
rpg-trl task-stats --task long_addition --seed 1
```

``stats.json`` in the warm start's folder records the numbers, the settings and the machine.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TaskStatsArguments:
    """Arguments of ``rpg-trl task-stats``."""

    task: str = field(
        default="ring_walk",
        metadata={"help": "The task (one of rpg_research.cli.bench_tasks.BENCH_TASK_NAMES)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the split and of the warm start."})
    output_dir: str = field(
        default="runs/task_stats",
        metadata={"help": "The warm start is trained, or reused, in <output_dir>/<task>/seed<seed>."},
    )
    sft_steps: int | None = field(
        default=None, metadata={"help": "Supervised steps of the warm start (default: the demo's for the task)."}
    )
    eval_problems: int | None = field(
        default=None, metadata={"help": "Held-out problems (default: the demo's for the task)."}
    )
    eval_samples: int = field(default=4, metadata={"help": "Completions sampled per held-out problem."})
    threshold: float = field(
        default=0.3, metadata={"help": "Entropy (nats) from which a completion token counts as uncertain."}
    )
    num_threads: int = field(default=1, metadata={"help": "Torch CPU threads."})

    def __post_init__(self):
        from ..toy.tasks import DEMO_TASKS
        from . import check_arguments
        from .bench_tasks import BENCH_TASK_NAMES

        if self.task not in BENCH_TASK_NAMES:
            raise ValueError(f"`task` must be one of {list(BENCH_TASK_NAMES)}; got {self.task!r}.")
        defaults = DEMO_TASKS[self.task].defaults
        self.sft_steps = defaults["sft_steps"] if self.sft_steps is None else self.sft_steps
        self.eval_problems = defaults["eval_problems"] if self.eval_problems is None else self.eval_problems
        check_arguments(
            self,
            at_least_one=("eval_problems", "eval_samples", "num_threads"),
            at_least_zero=("sft_steps",),
            positive=("threshold",),
        )


def task_stats(args: TaskStatsArguments) -> dict:
    """The numbers of the module docstring for `args`, also written to ``stats.json`` in the warm start's folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..toy.addition import evaluation_seed
    from ..toy.evaluation import completion_statistics
    from ..toy.training import cpu_session
    from . import machine
    from .bench_tasks import bench_task, cached_task_warm_start, task_splits

    directory = Path(args.output_dir) / args.task / f"seed{args.seed}"
    task = bench_task(args.task).demo_task
    extra_rounds = task.defaults["sft_extra_rounds"]
    with cpu_session(args.num_threads):
        splits = task_splits(args.task, args.seed, args.eval_problems, args.sft_steps)
        start = time.perf_counter()
        report = cached_task_warm_start(
            args.task, splits, directory, steps=args.sft_steps, seed=args.seed, extra_rounds=extra_rounds
        )
        warm_start_seconds = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        start = time.perf_counter()
        stats = completion_statistics(
            model,
            tokenizer,
            splits.eval,
            task.reward,
            num_samples=args.eval_samples,
            seed=evaluation_seed(args.seed),
            max_new_tokens=task.max_completion_length,
            threshold=args.threshold,
        )
        stats_seconds = time.perf_counter() - start
        result = {
            **stats,
            "warm_start": report,
            "seconds_warm_start": warm_start_seconds,
            "seconds_stats": stats_seconds,
            "arguments": asdict(args),
            "machine": machine(),
        }
    (directory / "stats.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_stats(result: dict) -> str:
    """The lines printed by ``rpg-trl task-stats``."""
    args = result["arguments"]
    return "\n".join(
        [
            f"Task {args['task']}, seed {args['seed']}: warm start of {args['sft_steps']} supervised steps "
            f"({result['seconds_warm_start']:.0f} s), {result['num_completions']} completions sampled at T=1 "
            f"({args['eval_samples']} per held-out problem, {args['eval_problems']} problems)",
            f"Uncertain tokens (entropy >= {result['threshold']:g} nats): {100 * result['uncertain_fraction']:.1f} %"
            f" of the completion tokens; mean entropy {result['entropy_mean']:.3f} nats per token",
            f"Per completion: {result['tokens_mean']:.1f} tokens (end token included), "
            f"{result['characters_mean']:.1f} characters",
            f"Held-out score (the task's reward, sampled mean@{args['eval_samples']}): {result['reward_mean']:.3f}",
            f"Measured on {result['machine']['cpu']} ({result['machine']['date_utc']})",
        ]
    )


def add_parser(subparsers):
    """Register ``rpg-trl task-stats`` (see [`rpg_research.cli`])."""
    return subparsers.add_parser(
        "task-stats",
        help="How uncertain a task's warm start is: the fraction of its completion tokens with high entropy.",
        description="Train (or reuse) a task's warm start and print, on its own completions of held-out problems "
        "sampled at temperature 1, the fraction of tokens whose entropy is above a threshold, the tokens and "
        "characters per completion and the held-out score.",
        dataclass_types=[TaskStatsArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl task-stats`` with the parsed command-line `args`."""
    from . import dataclass_arguments

    stats_args = dataclass_arguments(args, TaskStatsArguments)
    print(format_stats(task_stats(stats_args)))
    return 0
