# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl plot`` command: training curves of RPGTrainer / GRPOTrainer runs.

Any [`~transformers.Trainer`] run that saved its state has its logged metrics in ``trainer_state.json`` (key
``log_history``): in the run's ``output_dir`` (written by ``trainer.save_state()``) or in each ``checkpoint-*/``
folder ([`rpg_research.toy.curves.load_log_history`]). [`plot_runs`] overlays several runs on a grid of panels against the optimizer step, one colour per run, in
the style of Figure 4 of the paper (reward, entropy, response length, ...). The metric names are TRL's
(``reward``, ``entropy``, ``kl``, ``clip_ratio/*``, ``completions/mean_length``); RPGTrainer logs the same names, so
RPG and GRPO/DAPO runs compare directly (``kl`` is measured against each trainer's anchor: GRPO's reference model, or
RPG's sampling policy with ``kl_anchor="sampling"``). ``heldout/accuracy`` is the held-out accuracy logged by
``rpg-trl demo`` and ``rpg-trl bench-algos``.

```bash
rpg-trl plot runs/grpo runs/rpg-reinforce-urkl -o curves.png
```
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..toy.curves import load_log_history, metric_series, smooth


@dataclass(frozen=True)
class Panel:
    """One panel of the figure: its title and the logged metric(s) it draws (solid, dashed, dotted)."""

    title: str
    keys: tuple[str, ...]
    labels: tuple[str, ...] = ()
    ylim: tuple[float, float] | None = None


#: The default panels, in order. Panels with no logged value in any run are left out.
PANELS = (
    Panel("Reward (mean over the batch)", ("reward",)),
    Panel(
        "Held-out accuracy (sampled mean@k; dashed: greedy)",
        ("heldout/accuracy", "heldout/greedy_accuracy"),
        ylim=(0.0, 1.0),
    ),
    Panel("Entropy (nats / token)", ("entropy",)),
    Panel("KL estimate (to each trainer's KL anchor)", ("kl",)),
    Panel(
        "Clip fraction (solid: any; dashed: low; dotted: high)",
        ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"),
    ),
    Panel("Response length (tokens)", ("completions/mean_length",)),
)
_LINESTYLES = ("-", "--", ":")


def run_names(run_dirs: list[str]) -> list[str]:
    """Legend names: the last path component of each run directory, with parents added until they are unique."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


def plot_runs(
    run_dirs: list[str],
    output: str,
    *,
    names: list[str] | None = None,
    panels: tuple[Panel, ...] = PANELS,
    smoothing: float = 0.6,
    title: str | None = None,
) -> str:
    """
    Overlay the training curves of the runs in `run_dirs` and save the figure to `output` (format from its suffix).

    Args:
        run_dirs (`list[str]`):
            Output directories of RPGTrainer / GRPOTrainer (or any Trainer) runs, see [`find_trainer_state`].
        output (`str`):
            Image path, e.g. ``curves.png`` (or ``.pdf``, ``.svg``).
        names (`list[str]`, *optional*):
            Legend name of each run; defaults to [`run_names`].
        panels (`tuple[Panel, ...]`, *optional*, defaults to [`PANELS`]):
            Panels to draw; those without data in any run are left out.
        smoothing (`float`, *optional*, defaults to `0.6`):
            EMA weight of the bold curve (the raw values are drawn faintly behind it); `0` disables smoothing.
            Held-out accuracy is never smoothed.
        title (`str`, *optional*):
            Figure title.

    Returns:
        `str`: `output`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("`run_dirs` is empty: pass at least one run directory.")
    if names is None:
        names = run_names(run_dirs)
    elif len(names) != len(run_dirs):
        raise ValueError(f"`names` must have one entry per run: got {len(names)} names for {len(run_dirs)} runs.")
    smooth([], smoothing)  # validates the weight before any work
    histories = [load_log_history(d) for d in run_dirs]
    drawn = [p for p in panels if any(metric_series(h, k)[0] for h in histories for k in p.keys)]
    if not drawn:
        known = sorted({k for h in histories for e in h for k in e if k != "step"})
        raise ValueError(f"None of the runs logged a metric of the requested panels. Logged metrics: {known}.")

    ncols = min(3, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (ax, panel) in enumerate(zip(axes.flat, drawn)):
        for run, (name, history) in enumerate(zip(names, histories)):
            color = colors[run % len(colors)]
            for key, style in zip(panel.keys, _LINESTYLES):
                steps, values = metric_series(history, key)
                if not steps:
                    continue
                weight = 0.0 if key.startswith("heldout/") else smoothing
                if weight > 0 and len(values) > 1:
                    ax.plot(steps, values, color=color, alpha=0.2, linewidth=0.8, linestyle=style)
                ax.plot(
                    steps,
                    smooth(values, weight),
                    color=color,
                    linestyle=style,
                    linewidth=1.6,
                    marker="o" if key.startswith("heldout/") and len(values) < 40 else None,
                    markersize=3,
                    label=name if key == panel.keys[0] else None,
                )
        ax.set_title(f"({chr(ord('a') + index)}) {panel.title}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False, bbox_to_anchor=(0.5, 0.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07 if nrows == 1 else 0.045, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def add_parser(subparsers):
    """Register ``rpg-trl plot`` (see [`rpg_research.cli`])."""
    parser = subparsers.add_parser(
        "plot",
        help="Overlay the training curves of RPGTrainer/GRPOTrainer runs (reward, entropy, KL, clipping, length).",
        description="Overlay the training curves of Trainer runs, read from trainer_state.json in each RUN_DIR or "
        "in its latest checkpoint-*/ folder, on a grid of panels against the step (the paper's Figure 4 style).",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Output directory of a training run.")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="Image to write, e.g. curves.png.")
    parser.add_argument(
        "--names",
        nargs="+",
        metavar="NAME",
        default=None,
        help="Legend name of each run (default: the directory names).",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        default=0.6,
        help="EMA weight in [0, 1) of the bold curves; raw values are drawn faintly behind them. Default 0.6.",
    )
    parser.add_argument("--title", default=None, help="Figure title.")
    return parser


def run(args) -> int:
    """Execute ``rpg-trl plot`` with the parsed command-line `args`."""
    output = plot_runs(args.run_dirs, args.output, names=args.names, smoothing=args.smoothing, title=args.title)
    print(f"Wrote {output} ({len(args.run_dirs)} run{'s' if len(args.run_dirs) > 1 else ''})")
    return 0
