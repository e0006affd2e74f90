# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The shape shared by ``rpg-trl bench-algos`` and ``rpg-trl bench-async``: several methods trained on the demo's task
(two-digit additions, [`rpg_research.toy`]) from one supervised warm start per seed, compared over seeds.

* [`WarmStartBenchArguments`]: the options both commands take (seeds, steps, warm start, held-out evaluation), with
  presets built by [`bench_presets`] (the warm start's are shared); [`add_bench_parser`] registers a command with its
  presets written into its ``--help``, [`run_command`] executes it.
* [`run_warm_start_bench`]: the loop. For each seed, the task's splits and the (cached) warm start in
  ``seed<k>/sft``, then every arm (a method, with its settings such as the policy lag) trained from it in
  ``seed<k>/<setting><value>/.../<method>``; then ``table.md``, ``<command>.png`` and ``results.json``, with where
  and when the numbers were measured ([`rpg_research.cli.machine`]).
* [`heldout_summary`], [`aggregate_over_seeds`], [`mean_gain_curve`] and [`mean_metric_curve`]: the numbers of a run,
  of a table row and of a plotted curve; [`markdown_table`], [`pyplot`] and [`save_figure`]: the table and the figure.

Each command gives what is its own: the arms, how one is trained, the table's columns and the plot's panels.
``rpg-trl bench-async`` runs this loop; ``rpg-trl bench-algos`` runs its own protocol (selection and final seeds,
jobs over worker processes: [`rpg_research.cli.protocol`]) with the presets, summaries, table and figure helpers here.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..toy.curves import mean_std
from . import apply_preset, check_arguments, dataclass_arguments, machine, print_report


#: The presets the commands share: one warm start per seed (the same settings, so that the cached warm start of a seed
#: serves both commands) and the held-out set. Each command adds its own with [`bench_presets`].
WARM_START_PRESETS = {
    "full": {"seeds": [0], "sft_steps": 1500, "sft_extra_rounds": 3, "eval_problems": 400},
    "quick": {"seeds": [0], "sft_extra_rounds": 0},
}


def bench_presets(*, full: dict, quick: dict) -> dict:
    """A command's full and ``--quick`` presets: [`WARM_START_PRESETS`] updated with its own values."""
    return {"full": {**WARM_START_PRESETS["full"], **full}, "quick": {**WARM_START_PRESETS["quick"], **quick}}


def output_dir_field(default: str):
    """The ``--output_dir`` option, writing to `default` unless told otherwise."""
    return field(default=default, metadata={"help": "Where to write table.md, results.json, the plot and the runs."})


@dataclass
class WarmStartBenchArguments:
    """
    Options of the commands that train several methods from one warm start per seed. A subclass sets `presets` (a plain
    class attribute, not a field, from [`bench_presets`]): the values of the options left unset (None),
    ``presets["full"]`` or, with ``--quick``, ``presets["quick"]`` (see [`rpg_research.cli.apply_preset`]).
    """

    presets = bench_presets(full={}, quick={})

    output_dir: str = output_dir_field("runs/bench")
    seeds: list[int] | None = field(default=None, metadata={"help": "Seeds (each with its own warm start)."})
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps per run."})
    learning_rate: float = field(default=6e-4, metadata={"help": "Learning rate of every run (the demo's)."})
    sft_steps: int | None = field(default=None, metadata={"help": "Warm-start steps per seed."})
    sft_extra_rounds: int | None = field(
        default=None,
        metadata={"help": "Extra warm-start rounds while the model cannot add yet (see `rpg-trl demo`)."},
    )
    eval_every: int | None = field(default=None, metadata={"help": "Held-out evaluation every this many steps."})
    eval_problems: int | None = field(default=None, metadata={"help": "Number of held-out problems."})
    eval_samples: int = field(default=4, metadata={"help": "Completions per held-out problem (mean@k)."})
    quick: bool = field(default=False, metadata={"help": "A smoke test: one seed, a short warm start, a few steps."})
    num_threads: int = field(default=1, metadata={"help": "Torch CPU threads (see `rpg-trl demo`)."})

    def arms(self) -> list[dict]:
        """The runs of one seed, in order (see [`run_warm_start_bench`]); each subclass says which."""
        raise NotImplementedError

    def __post_init__(self):
        apply_preset(self, self.presets, self.quick)
        if not self.seeds:
            raise ValueError(f"`seeds` must list at least one seed; got {self.seeds!r}.")
        check_arguments(
            self,
            at_least_one=("steps", "eval_every", "eval_problems", "eval_samples", "num_threads"),
            at_least_zero=("sft_steps", "sft_extra_rounds"),
            positive=("learning_rate",),
        )


def chosen(names: list[str] | None, choices: dict, default: list[str], what: str) -> list[str]:
    """`names` (`default` when None), after checking that each is a key of `choices` (`what`: the word for one)."""
    names = list(default) if names is None else names
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"Unknown {what}(s) {unknown}; choose among {list(choices)}.")
    return names


def add_bench_parser(subparsers, name: str, arguments_class: type[WarmStartBenchArguments], **kwargs):
    """Register the command `name` with the options of `arguments_class`; the help of each option with a preset says
    its full and ``--quick`` values (from `arguments_class.presets`). `kwargs`: `help` and `description`."""
    parser = subparsers.add_parser(name, dataclass_types=[arguments_class], **kwargs)
    full, quick = arguments_class.presets["full"], arguments_class.presets["quick"]

    def show(value):
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    for action in parser._actions:
        if action.dest in full:
            action.help += f" Preset: {show(full[action.dest])} (--quick: {show(quick[action.dest])})."
    return parser


def run_command(args, arguments_class: type[WarmStartBenchArguments], run_bench: Callable, name: str) -> int:
    """Execute the command `name` (its module's name) with the parsed command-line `args`, then print its table."""
    bench_args = dataclass_arguments(args, arguments_class)
    report = run_bench(bench_args)
    print_report(
        bench_args.output_dir, report["seconds"], f"{bench_args.output_dir}/table.md, results.json and {name}.png"
    )
    return 0


def heldout_summary(curve: list[dict], rewards: list[float], seconds: float, **extra) -> dict:
    """
    The numbers of one run, from the held-out accuracy `curve` of [`rpg_research.toy.evaluation.heldout_accuracy_callback`]
    (its first point is the warm start) and the training `rewards`: ``initial``, ``last``, ``gain`` (last − initial),
    ``best`` (over the evaluations during training), ``max_reward_drop`` (the largest fall of the reward's moving
    average below its running maximum), then `extra`, ``seconds`` and the ``accuracy_curve``.
    """
    from ..toy.curves import REWARD_WINDOW, max_drawdown, moving_average

    accuracies = [e["heldout/accuracy"] for e in curve]
    return {
        "initial": accuracies[0],
        "last": accuracies[-1],
        "gain": accuracies[-1] - accuracies[0],
        "best": max(accuracies[1:]) if len(accuracies) > 1 else accuracies[0],
        "max_reward_drop": max_drawdown(moving_average(rewards, REWARD_WINDOW)),
        **extra,
        "seconds": seconds,
        "accuracy_curve": [{"step": e["step"], "accuracy": e["heldout/accuracy"]} for e in curve],
    }


def runs_of(results: list[dict], arm: dict) -> list[dict]:
    """The runs (one per seed) of `arm` among `results`."""
    return [r for r in results if all(r[key] == value for key, value in arm.items())]


def aggregate_over_seeds(results: list[dict], arms: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One row per arm that ran: the arm, its number of seeds, and the mean and standard deviation over seeds of each
    of `keys` (``<key>`` and ``<key>_std``)."""
    rows = []
    for arm in arms:
        runs = runs_of(results, arm)
        if not runs:
            continue
        row = {**arm, "seeds": len(runs)}
        for key in keys:
            row[key], row[key + "_std"] = mean_std([r[key] for r in runs])
        rows.append(row)
    return rows


def mean_gain_curve(runs: list[dict]) -> tuple[list[int], list[float], list[float] | None]:
    """Steps, mean over `runs` of the held-out accuracy gain over each run's own warm start (points: the warm starts
    differ more between seeds than the methods do), and its standard deviation (None for a single run)."""
    steps = [p["step"] for p in runs[0]["accuracy_curve"]]
    gains = [[100.0 * (p["accuracy"] - r["initial"]) for p in r["accuracy_curve"]] for r in runs]
    mean = [statistics.fmean(g[i] for g in gains) for i in range(len(steps))]
    std = [statistics.stdev(g[i] for g in gains) for i in range(len(steps))] if len(gains) > 1 else None
    return steps, mean, std


def mean_metric_curve(run_dirs: list[str], key: str) -> tuple[list[int], list[float]]:
    """Steps and mean over the runs in `run_dirs` of the logged metric `key`, up to the shortest run's length."""
    from ..toy.curves import load_log_history, metric_series

    series = [metric_series(load_log_history(run_dir), key) for run_dir in run_dirs]
    length = min(len(values) for _, values in series)
    return series[0][0][:length], [statistics.fmean(values[i] for _, values in series) for i in range(length)]


def markdown_table(caption: str, header: list[str], rows: list[list[str]]) -> str:
    """`caption`, a blank line, then a markdown table: the `header`'s column names and one line of cells per row."""
    lines = [caption, "", f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    lines += [f"| {' | '.join(cells)} |" for cells in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """`matplotlib.pyplot` with the file-only backend (Agg): the commands write figures, they never show them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, legend_ax, output: str, *, bottom: float, dpi: int, max_columns: int | None = None) -> str:
    """Write `fig` to `output` with the legend of `legend_ax` centred below the axes (in `bottom`, a fraction of the
    figure's height; one row of at most `max_columns` entries) and close it."""
    handles, labels = legend_ax.get_legend_handles_labels()
    ncol = len(labels) if max_columns is None else min(max_columns, len(labels))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(output, dpi=dpi)
    pyplot().close(fig)
    return output


def run_warm_start_bench(
    name: str,
    args: WarmStartBenchArguments,
    train: Callable,
    format_table: Callable,
    plot: Callable,
    table_keys: tuple[str, ...],
    report: dict,
    *,
    progress: bool = False,
) -> dict:
    """
    Train every arm of `args` from the warm start of every seed, then write ``table.md``, ``<name>.png`` and
    ``results.json`` in `args.output_dir`.

    Args:
        name: the command's module name (``bench_algos``), which names the plot.
        args: the command's arguments; `args.arms()` are the runs of one seed, in order, each a dict whose last item
            names the method and whose earlier items set it up (`{"algorithm": "GRPO"}`, `{"lag": 2, "method":
            "AsyncGRPO"}`). A run is written to ``seed<k>/<key><value>/.../<method>``.
        train: `train(args, seed=, splits=, sft_dir=, run_dir=, **arm)` trains one run and returns its results, a dict
            holding the arm's items and [`heldout_summary`]'s.
        format_table: `format_table(rows, initial, args)`, the markdown of the rows of [`aggregate_over_seeds`] (over
            `table_keys`) given the mean warm-start accuracy.
        plot: `plot(results, run_dirs, path, args)` draws the figure to `path`; `run_dirs` maps `(*arm values, seed)`
            to the run's folder.
        report: the command's own entries of ``results.json`` (e.g. the methods' configurations), after the shared
            ones: the table, the runs, the warm starts' accuracy and reports, the time, the arguments and the machine.
        progress: a progress bar over all runs; without one, each run is announced by a line.

    Returns:
        The report written to ``results.json``.
    """
    from tqdm.auto import tqdm

    from ..toy.addition import make_splits
    from ..toy.training import cpu_session
    from ..toy.warm_start import cached_warm_start

    with cpu_session(args.num_threads):
        start = time.perf_counter()
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        results, run_dirs, warm_starts = [], {}, {}
        arms = args.arms()
        bar = None
        if progress:
            bar = tqdm(
                total=len(args.seeds) * len(arms), desc=f"{name.replace('_', '-')} runs", position=1, leave=True
            )
        write = tqdm.write if bar else print
        for seed in args.seeds:
            splits = make_splits(seed, num_eval=args.eval_problems)
            sft_dir = output_dir / f"seed{seed}" / "sft"
            warm_starts[seed] = cached_warm_start(
                splits, sft_dir, steps=args.sft_steps, seed=seed, extra_rounds=args.sft_extra_rounds
            )
            for arm in arms:
                *setting, (_, method) = arm.items()
                where = ", ".join([f"seed {seed}", *(f"{key} {value}" for key, value in setting)])
                run_dir = output_dir.joinpath(f"seed{seed}", *(f"{key}{value}" for key, value in setting), method)
                if bar:
                    bar.set_postfix_str(f"{where}, {method}")
                else:
                    print(f"[{where}] {method}: {args.steps} steps")
                result = train(args, seed=seed, splits=splits, sft_dir=str(sft_dir), run_dir=run_dir, **arm)
                run_dirs[(*arm.values(), seed)] = str(run_dir)
                results.append(result)
                if bar:
                    bar.update()
                write(
                    f"[{where}] {method}: held-out accuracy {result['initial']:.3f} -> {result['last']:.3f} "
                    f"(best {result['best']:.3f}) in {result['seconds']:.0f} s"
                )
        if bar:
            bar.close()
        rows = aggregate_over_seeds(results, arms, table_keys)
        initial = statistics.fmean(r["initial"] for r in results)
        (output_dir / "table.md").write_text(format_table(rows, initial, args))
        plot(results, run_dirs, str(output_dir / f"{name}.png"), args)
        report = {
            "table": rows,
            "runs": results,
            "initial_accuracy": initial,
            "warm_starts": warm_starts,
            "seconds": time.perf_counter() - start,
            "arguments": asdict(args),
            "machine": machine(),
            **report,
        }
        (output_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
