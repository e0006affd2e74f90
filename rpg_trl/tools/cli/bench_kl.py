# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The KL table of ``rpg-trl bench-algos``: what each KL estimator does where the KL has something to prevent.

Every arm trains the warm start of a seed with `RPGTrainer` on the *proxy* reward of [`rpg_trl.tools.toy.proxy`] (a lenient
grader with a length bias) while the held-out score is the *true* reward (exact answers only), at 16 optimizer steps
per generation batch (the paper's regime, where the policy moves away from the one that sampled each batch), with the
KL to the warm start (`kl_anchor="reference"`) at one β for every regularised arm ([`KL_ARMS`]; β is chosen from
a grid on the selection seeds, [`run_kl_table`]):

* RPG's importance-weighted KL, reverse family (`divergence="urkl"`, the k3 of GRPO, corrected) and forward family
  (`"ufkl"`), each per token (`kl_level="token"`, the paper's code and every peer) and over whole completions
  (`"sequence"`, the paper's objective, Sec. 3);
* GRPO's uncorrected k3 (`use_bias_correction_kl=False`: the KL term evaluated on the stale samples as if they came
  from the current policy, Sec. 2.2);
* no KL (β = 0).

Everything else is fixed: the differentiable estimator, RPG-Style Clip, advantage = reward − group mean, the learning
rate, the steps. Reported: the true and the proxy reward on the held-out problems at the end (mean and 95 % interval
over the final seeds), the paired difference of the true reward to the arm without KL, the KL to the warm start and
the completion length at the end; the figure draws the proxy against the true reward over training (the
over-optimisation curves of Gao et al., 2022).
"""

from __future__ import annotations

import statistics
from pathlib import Path


#: Arm -> RPGConfig overrides (on top of the shared settings of [`kl_job`]); β = 0 for "no KL", else the β chosen
#: from ``--kl_betas``.
KL_ARMS = {
    "no KL": {"divergence": "urkl", "kl_anchor": "sampling", "beta": 0.0},
    "RPG-URKL, token": {"divergence": "urkl", "kl_level": "token"},
    "RPG-URKL, sequence": {"divergence": "urkl", "kl_level": "sequence"},
    "RPG-UFKL, token": {"divergence": "ufkl", "kl_level": "token"},
    "RPG-UFKL, sequence": {"divergence": "ufkl", "kl_level": "sequence"},
    "GRPO k3 (uncorrected)": {"divergence": "urkl", "use_bias_correction_kl": False},
}
#: Arms added after the first run of the table (2026-11-25), to find where its collapse comes from; run with
#: ``--kl_arms`` and reported apart. "RPG-URKL, token, no clip": RPG's corrected KL without RPG-Style Clip (the exact
#: weight W on every token, the reward term unclipped too). "TRL k3 (corrected)": TRL's own `GRPOTrainer` with its
#: importance-weighted k3 (`use_bias_correction_kl=True`), the reward term PPO-clipped with the same ε and the KL term
#: at the unclipped weight w, advantages and aggregation as RPG's.
KL_FOLLOW_UP_ARMS = {
    "RPG-URKL, token, no clip": {"divergence": "urkl", "kl_level": "token", "rpg_clip": False},
    "TRL k3 (corrected)": {"trainer": "grpo", "use_bias_correction_kl": True},
}
ALL_KL_ARMS = {**KL_ARMS, **KL_FOLLOW_UP_ARMS}
#: The arm the others are compared with, seed by seed.
KL_BASELINE = "no KL"
#: Steps per generation batch of every run of the KL table (the paper's regime).
KL_REGIME = 16


def kl_job(spec: dict, run_dir: str) -> dict:
    """Train one arm of the KL table and return its held-out true and proxy rewards over training and at the end."""
    from trl import GRPOConfig, GRPOTrainer

    from rpg_trl.config import RPGConfig
    from rpg_trl.trainer import RPGTrainer

    from ..toy.addition import build_rl_dataset
    from ..toy.curves import metric_series
    from ..toy.proxy import PROXY_MAX_COMPLETION_LENGTH, proxy_reward, strict_reward
    from ..toy.training import rl_training_kwargs
    from .runs import run_summary, train_quietly, warm_started

    seed = spec["seed"]
    splits, model, tokenizer, scores = warm_started(
        spec,
        reward_funcs={"accuracy": strict_reward, "proxy": proxy_reward},
        max_new_tokens=PROXY_MAX_COMPLETION_LENGTH,
    )
    kwargs = rl_training_kwargs(steps=spec["steps"], seed=seed, learning_rate=spec["learning_rate"])
    kwargs.update(steps_per_generation=KL_REGIME, max_completion_length=PROXY_MAX_COMPLETION_LENGTH, disable_tqdm=True)
    overrides = dict(ALL_KL_ARMS[spec["arm"]])
    # The proxy trains (weight 1); the true reward is only logged (weight 0) to draw it next to the proxy.
    kwargs.update(output_dir=run_dir, reward_weights=[1.0, 0.0], beta=spec["beta"])
    if overrides.pop("trainer", "rpg") == "grpo":
        # RPGConfig's defaults that are not GRPOConfig's: advantage = reward − group mean, clip-higher, token mean.
        shared = {"scale_rewards": "none", "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo"}
        trainer_class, config = GRPOTrainer, GRPOConfig(**shared, **kwargs, **overrides)
    else:
        shared = {"estimator": "differentiable", "kl_anchor": "reference"}
        trainer_class, config = RPGTrainer, RPGConfig(**{**shared, **kwargs, **overrides})
    trainer = trainer_class(
        model=model,
        reward_funcs=[proxy_reward, strict_reward],
        args=config,
        train_dataset=build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[scores],
    )
    seconds = train_quietly(trainer)
    history = trainer.state.log_history
    summary = run_summary(history, scores.curve, seconds, KL_REGIME)
    lengths = metric_series(history, "completions/mean_length")[1][-KL_REGIME:]
    kls = metric_series(history, "kl")[1][-KL_REGIME:]
    summary.update(
        proxy_initial=scores.curve[0]["heldout/proxy"],
        proxy_last=scores.curve[-1]["heldout/proxy"],
        proxy_curve=[{"step": e["step"], "proxy": e["heldout/proxy"]} for e in scores.curve],
        length_end=statistics.fmean(lengths),
        # The logged `kl` is the regulariser's estimate, 0 without one (β = 0 loads no reference).
        kl_end=statistics.fmean(kls) if kls and spec["beta"] > 0 else None,
    )
    return summary


def _kl_jobs(args, sft_dirs, arms, betas, seeds, root: Path) -> list[tuple[dict, str]]:
    from .runs import run_spec

    jobs = []
    for arm in arms:
        for beta in [0.0] if ALL_KL_ARMS[arm].get("beta") == 0.0 else betas:
            for seed in seeds:
                spec = run_spec(args, sft_dirs, seed, arm=arm, beta=beta, learning_rate=args.kl_learning_rate)
                name = arm.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "")
                jobs.append((spec, str(root / name / f"beta{beta:g}" / f"seed{seed}")))
    return jobs


def run_kl_table(args, sft_dirs: dict[int, str], pool) -> dict:
    """
    The KL table: the regularised arms at every β of ``args.kl_betas`` on the selection seeds (none with a single
    β), the β with the highest mean true reward at the end over all of them ([`rpg_trl.tools.cli.protocol.select_best`]; one β for every arm, so that
    the arms differ by their estimator only), then every arm of ``args.kl_arms`` at that β on the final seeds.
    Returns the selection, the chosen β, the final runs and the rows of [`summarize_kl`].
    """
    from .protocol import run_jobs, select_best
    from .runs import describe_run

    root = Path(args.output_dir) / "kl"
    common = {"pool": pool, "num_threads": args.num_threads, "describe": describe_run}
    regularised = [arm for arm in args.kl_arms if ALL_KL_ARMS[arm].get("beta") != 0.0]
    # A grid of one β selects nothing: no selection runs then.
    betas = args.kl_betas if len(args.kl_betas) > 1 else []
    selection_jobs = _kl_jobs(args, sft_dirs, regularised, betas, args.selection_seeds, root)
    selection = run_jobs(selection_jobs, kl_job, desc="KL table: selection runs", **common)
    scores: dict[float, list[float]] = {}
    for (spec, _), result in zip(selection_jobs, selection):
        scores.setdefault(spec["beta"], []).append(result["last"])
    beta = select_best(scores) if scores else args.kl_betas[0]
    final_jobs = _kl_jobs(args, sft_dirs, args.kl_arms, [beta], args.final_seeds, root)
    results = run_jobs(final_jobs, kl_job, desc="KL table: final runs", **common)
    runs = [{**spec, **result, "run_dir": run_dir} for (spec, run_dir), result in zip(final_jobs, results)]
    return {
        "selection": [
            {"arm": spec["arm"], "beta": spec["beta"], "seed": spec["seed"], "last": result["last"]}
            for (spec, _), result in zip(selection_jobs, selection)
        ],
        "chosen_beta": beta,
        "runs": runs,
        "table": summarize_kl(runs),
        "dynamics": kl_dynamics(runs),
    }


def summarize_kl(runs: list[dict]) -> list[dict]:
    """One row per arm: true and proxy reward at the end with intervals, the paired difference of the true reward to
    [`KL_BASELINE`], and the means of the KL and the completion length at the end."""
    from .protocol import mean_interval, paired_difference

    arms = list(dict.fromkeys(run["arm"] for run in runs))
    by_arm = {arm: [run for run in runs if run["arm"] == arm] for arm in arms}
    rows = []
    for arm, group in by_arm.items():
        row = {"arm": arm, "beta": group[0]["beta"], "seeds": [run["seed"] for run in group]}
        for key in ("last", "best", "proxy_last", "length_end"):
            row[key], row[key + "_ci"] = mean_interval([run[key] for run in group])
        kls = [run["kl_end"] for run in group if run.get("kl_end") is not None]
        row["kl_end"] = statistics.fmean(kls) if kls else None
        row["collapsed"] = sum(run["collapsed"] for run in group)
        if KL_BASELINE in by_arm:
            mine = {run["seed"]: run["last"] for run in group}
            theirs = {run["seed"]: run["last"] for run in by_arm[KL_BASELINE]}
            row["last_vs_baseline"], row["last_vs_baseline_ci"], _ = paired_difference(mine, theirs)
        rows.append(row)
    return rows


def format_kl_table(rows: list[dict], beta: float, args) -> str:
    """Markdown table of the rows of [`summarize_kl`] (`beta`: the chosen β)."""
    from .protocol import format_interval
    from .warm_start_bench import markdown_table

    n = len(args.final_seeds)
    caption = (
        f"**KL table** ({KL_REGIME} steps per generation, proxy reward with a length bias, lr "
        f"{args.kl_learning_rate:.2g}, β = {beta:g} for every regularised arm, {args.steps} steps). True reward "
        f"(exact answers) and proxy on {args.eval_problems} held-out problems at the end (sampled mean@"
        f"{args.eval_samples}); mean ± 95 % interval over {n} final seeds; Δ: paired difference to '{KL_BASELINE}' "
        "(points); KL and length: means over the last generation batch."
    )
    header = [
        "Arm",
        "True reward (end)",
        f"Δ true vs {KL_BASELINE}",
        "Best true",
        "Proxy (end)",
        "KL to warm start",
        "Completion length (tokens)",
        "Collapsed",
    ]
    cells = []
    for row in rows:
        cells.append(
            [
                row["arm"],
                format_interval(row["last"], row["last_ci"], digits=3),
                "–"
                if row["arm"] == KL_BASELINE or "last_vs_baseline" not in row
                else format_interval(row["last_vs_baseline"], row["last_vs_baseline_ci"], scale=100, sign=True),
                format_interval(row["best"], row["best_ci"], digits=3),
                format_interval(row["proxy_last"], row["proxy_last_ci"], digits=3),
                "–" if row["kl_end"] is None else f"{row['kl_end']:.3g}",
                format_interval(row["length_end"], row["length_end_ci"], digits=2),
                f"{row['collapsed']}/{n}",
            ]
        )
    return markdown_table(caption, header, cells)


#: The logged metrics of [`format_kl_dynamics`]: metric -> its name in the table.
DYNAMICS_METRICS = {"kl": "KL estimate", "entropy": "entropy", "importance_weight/max": "largest importance weight"}


def kl_dynamics(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per arm and metric of [`DYNAMICS_METRICS`], the mean over the arm's runs and over the optimizer steps of each
    generation batch ([`KL_REGIME`] steps), read from the runs' trainer states."""
    from ..toy.curves import load_log_history, metric_series

    dynamics = {}
    for arm in dict.fromkeys(run["arm"] for run in runs):
        histories = [load_log_history(run["run_dir"]) for run in runs if run["arm"] == arm]
        dynamics[arm] = {}
        for key in DYNAMICS_METRICS:
            by_generation: dict[int, list[float]] = {}
            for history in histories:
                for step, value in zip(*metric_series(history, key)):
                    by_generation.setdefault((step - 1) // KL_REGIME, []).append(value)
            dynamics[arm][key] = [statistics.fmean(by_generation[g]) for g in sorted(by_generation)]
    return dynamics


def format_kl_dynamics(dynamics: dict, args) -> str:
    """Markdown table of [`kl_dynamics`]: one row per arm and metric, one column per generation batch."""
    from .warm_start_bench import markdown_table

    generations = max(len(v) for metrics in dynamics.values() for v in metrics.values())
    header = ["Arm", "Logged metric", *(f"gen. {g + 1}" for g in range(generations))]
    cells = []
    for arm, metrics in dynamics.items():
        for key, name in DYNAMICS_METRICS.items():
            values = metrics[key]
            if key == "kl" and not any(values):
                continue  # no regulariser, no estimate
            cells.append([arm, name, *(f"{v:.3g}" for v in values), *([""] * (generations - len(values)))])
    caption = (
        f"**KL table, logged metrics** per generation batch ({KL_REGIME} optimizer steps each), mean over the "
        f"{len(args.final_seeds)} final seeds: the regulariser's KL estimate to the warm start, the token entropy and "
        "the largest importance weight π_θ/π_old of each step."
    )
    return markdown_table(caption, header, cells)


def plot_kl(runs: list[dict], output: str, args) -> str:
    """(a) Held-out true and proxy reward over training per arm (means over seeds); (b) true against proxy."""
    from .warm_start_bench import pyplot, save_figure

    plt = pyplot()
    fig, (ax_steps, ax_pair) = plt.subplots(1, 2, figsize=(13, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, arm in enumerate(args.kl_arms):
        group = [run for run in runs if run["arm"] == arm]
        if not group:
            continue
        color = colors[index % len(colors)]
        steps = [p["step"] for p in group[0]["accuracy_curve"]]
        true = [statistics.fmean(run["accuracy_curve"][i]["accuracy"] for run in group) for i in range(len(steps))]
        proxy = [statistics.fmean(run["proxy_curve"][i]["proxy"] for run in group) for i in range(len(steps))]
        ax_steps.plot(steps, true, "-", marker="o", markersize=3, color=color, label=arm)
        ax_steps.plot(steps, proxy, ":", color=color)
        ax_pair.plot(proxy, true, "-", marker="o", markersize=3, color=color)
    ax_steps.set_title("(a) Held-out true reward (solid) and proxy (dotted) over training", fontsize=10)
    ax_steps.set_xlabel("step")
    ax_pair.set_title("(b) True reward against proxy (each point an evaluation)", fontsize=10)
    ax_pair.set_xlabel("proxy reward (held-out)")
    ax_pair.set_ylabel("true reward (held-out)")
    for ax in (ax_steps, ax_pair):
        ax.grid(alpha=0.3)
    return save_figure(fig, ax_steps, output, bottom=0.12, dpi=110, max_columns=3)
