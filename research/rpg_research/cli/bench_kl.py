# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The KL table of ``rpg-trl bench-algos``: what each KL estimator does where the KL has something to prevent.

Every arm trains the warm start of a seed with `RPGTrainer` on the *proxy* reward of [`rpg_research.toy.proxy`] (a lenient
grader with a length bias) while the held-out score is the *true* reward (exact answers only), at 16 optimizer steps
per generation batch (the paper's regime, where the policy moves away from the one that sampled each batch), with the
KL to the warm start (`kl_anchor="reference"`) at one β for every regularised arm ([`KL_ARMS`]; β is chosen from
a grid on the selection seeds, [`run_kl_table`]):

* RPG's importance-weighted KL, reverse family (`divergence="urkl"`, the k3 of GRPO, corrected) and forward family
  (`"ufkl"`), each per token (`kl_level="token"`, the paper's code and every peer) and over whole completions
  (`"sequence"`, the paper's objective, Sec. 3), under each way RPG-Style Clip can weight the KL term outside the
  trust region (`kl_clip_mode`: `"exact"`, `"truncated"`, `"clipped"`, `"stopped"`; docs/design.md);
* TRL's `GRPOTrainer` with its importance-weighted k3 (`use_bias_correction_kl=True`);
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


#: The KL clip modes (how RPG-Style Clip weights the KL term outside the trust region), each crossed with the two
#: divergence families and the two KL levels in [`KL_ARMS`].
KL_MODE_NAMES = ("exact", "truncated", "clipped", "stopped")


def _mode_arms() -> dict[str, dict]:
    return {
        f"RPG-{divergence.upper()}, {level}, {mode}": {
            "divergence": divergence,
            "kl_level": level,
            "kl_clip_mode": mode,
        }
        for mode in KL_MODE_NAMES
        for divergence in ("urkl", "ufkl")
        for level in ("token", "sequence")
    }


#: The adaptive-β arm's KL target δ (`kl_target`), set with the protocol of 2026-11-25 (second KL table).
KL_TARGET = 0.1
#: Arm -> trainer configuration overrides (on top of the shared settings of [`kl_job`]); β = 0 for "no KL", else
#: the β of the table. An RPG arm without `kl_clip_mode` runs with the library's default
#: (`rpg_trl.losses.DEFAULT_KL_CLIP_MODE`), resolved into the run's specification.
KL_ARMS = {
    "no KL": {"divergence": "urkl", "kl_anchor": "sampling", "beta": 0.0},
    **_mode_arms(),
    "TRL k3 (corrected)": {"trainer": "grpo", "use_bias_correction_kl": True},
    "GRPO k3 (uncorrected)": {"divergence": "urkl", "use_bias_correction_kl": False},
}
#: Arms run apart (``--kl_arms``). "RPG-URKL, token, no clip": RPG's corrected KL without RPG-Style Clip (the exact
#: weight W on every token, the reward term unclipped too; the first KL table's follow-up). "... default": the
#: library's default KL clip mode, for the runs made after it was chosen; "..., adaptive β": with the KL target δ
#: [`KL_TARGET`] (`kl_target`), β starting from the table's; "RPG-FKL, ...": the normalised forward KL per mode.
KL_FOLLOW_UP_ARMS = {
    "RPG-URKL, token, no clip": {"divergence": "urkl", "kl_level": "token", "rpg_clip": False},
    "RPG-URKL, token, default": {"divergence": "urkl", "kl_level": "token"},
    # The KL between whole completions at the default mode (the fourth protocol's KL table, long completions).
    "RPG-URKL, sequence, default": {"divergence": "urkl", "kl_level": "sequence"},
    # The same with the KL-to-go's later log-ratios replaced by their k3 (`kl_to_go="k3"`, the fifth protocol).
    "RPG-URKL, sequence, default, k3": {"divergence": "urkl", "kl_level": "sequence", "kl_to_go": "k3"},
    # GRPO as TRL runs it, its k3 to the reference without importance weight (the fifth protocol's GRPO arm).
    "GRPO (TRL, k3 uncorrected)": {"trainer": "grpo", "use_bias_correction_kl": False},
    "RPG-URKL, token, default, adaptive β": {"divergence": "urkl", "kl_level": "token", "kl_target": KL_TARGET},
    # Each position's KL exactly over the vocabulary in place of the sampled token's (the sixth protocol).
    "RPG-URKL, token, vocabulary": {"divergence": "urkl", "kl_level": "token", "kl_estimate": "vocabulary"},
    # The normalised forward KL, whose weight K = −r does not grow with w (the third KL protocol measures whether
    # truncating it matters).
    **{
        f"RPG-FKL, {level}, {mode}": {"divergence": "fkl", "kl_level": level, "kl_clip_mode": mode}
        for level in ("token", "sequence")
        for mode in ("exact", "truncated")
    },
}
ALL_KL_ARMS = {**KL_ARMS, **KL_FOLLOW_UP_ARMS}
#: The arms of the robustness sweep (``--tables kl_sweep``): the default weighting, Algorithm 1's reading and TRL's
#: corrected k3, each over ``--sweep_betas`` × ``--sweep_learning_rates`` on the sweep seeds.
KL_SWEEP_ARMS = ("RPG-URKL, token, default", "RPG-URKL, token, clipped", "TRL k3 (corrected)")
#: The arm the others are compared with, seed by seed.
KL_BASELINE = "no KL"
#: Steps per generation batch of every run of the KL table (the paper's regime).
KL_REGIME = 16


def kl_arm_config(arm: str) -> dict:
    """The trainer (``"rpg"`` or ``"grpo"``) and configuration overrides of `arm`, with the library's default KL clip
    mode filled in for RPG arms that do not choose one (part of the run's specification)."""
    from rpg_trl.losses import DEFAULT_KL_CLIP_MODE

    overrides = dict(ALL_KL_ARMS[arm])
    trainer = overrides.pop("trainer", "rpg")
    if trainer == "rpg" and overrides.get("beta") != 0.0:
        overrides.setdefault("kl_clip_mode", DEFAULT_KL_CLIP_MODE)
    return {"trainer": trainer, **overrides}


def kl_job(spec: dict, run_dir: str) -> dict:
    """Train one arm of the KL table and return its held-out true and proxy rewards over training and at the end."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rpg_trl.config import RPGConfig
    from rpg_trl.trainer import RPGTrainer

    from ..toy.addition import evaluation_seed
    from ..toy.curves import metric_series
    from ..toy.evaluation import token_kl_to_reference
    from ..toy.training import rl_training_kwargs
    from .bench_tasks import bench_task
    from .runs import run_summary, train_quietly, warm_started

    seed = spec["seed"]
    task = bench_task(spec.get("task", "addition"))
    proxy_reward, strict_reward = task.proxy_reward, task.strict_reward
    max_length = task.proxy_max_completion_length
    splits, model, tokenizer, scores = warm_started(
        spec,
        reward_funcs={"accuracy": strict_reward, "proxy": proxy_reward},
        max_new_tokens=max_length,
    )
    kwargs = rl_training_kwargs(
        steps=spec["steps"],
        seed=seed,
        learning_rate=spec["learning_rate"],
        max_completion_length=max_length,
        device=spec.get("device", "cpu"),
    )
    kwargs.update(
        steps_per_generation=KL_REGIME, per_device_train_batch_size=task.completions_per_step, disable_tqdm=True
    )
    overrides = dict(spec["config"])
    # The proxy trains (weight 1); the true reward is only logged (weight 0) to draw it next to the proxy.
    kwargs.update(output_dir=run_dir, reward_weights=[1.0, 0.0], beta=spec["beta"])
    if overrides.pop("trainer") == "grpo":
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
        train_dataset=task.demo_task.build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[scores],
    )
    diagnostics = None
    if spec.get("diagnostics"):
        from .position_diagnostics import PositionDiagnostics

        diagnostics = PositionDiagnostics(task.position_groups).attach(trainer)
    seconds = train_quietly(trainer)
    history = trainer.state.log_history
    summary = run_summary(history, scores.curve, seconds, KL_REGIME)
    if diagnostics is not None:
        summary["positions"] = diagnostics.summary()
        if diagnostics.gradient_steps:
            summary["kl_gradient"] = diagnostics.gradient_summary()
            summary["kl_gradient_steps"] = diagnostics.gradient_steps  # per step, in order
    lengths = metric_series(history, "completions/mean_length")[1][-KL_REGIME:]
    kls = metric_series(history, "kl")[1][-KL_REGIME:]
    betas = metric_series(history, "beta")[1]
    # One comparable number for every arm: the token-level reverse KL from the trained policy to the warm start, on
    # the policy's own completions for the held-out problems (exact over the vocabulary at each position).
    warm_start = AutoModelForCausalLM.from_pretrained(spec["sft_dir"]).to(trainer.model.device)
    summary["kl_to_warm_start"] = token_kl_to_reference(
        trainer.model,
        warm_start,
        tokenizer,
        splits.eval,
        num_samples=spec["eval_samples"],
        seed=evaluation_seed(seed) + 1,
        max_new_tokens=max_length,
    )
    summary.update(
        beta_end=betas[-1] if betas else spec["beta"],
        proxy_initial=scores.curve[0]["heldout/proxy"],
        proxy_last=scores.curve[-1]["heldout/proxy"],
        proxy_curve=[{"step": e["step"], "proxy": e["heldout/proxy"]} for e in scores.curve],
        length_end=statistics.fmean(lengths),
        # The logged `kl` is the regulariser's own estimate (its divergence, its level's token estimate), 0 without one.
        kl_estimate_end=statistics.fmean(kls) if kls and spec["beta"] > 0 else None,
    )
    return summary


def _arm_folder(arm: str) -> str:
    return arm.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "").replace("β", "beta")


def _kl_jobs(args, sft_dirs, arms, betas, seeds, root: Path, learning_rates=None) -> list[tuple[dict, str]]:
    from .runs import run_spec

    jobs = []
    learning_rates = learning_rates or [args.kl_learning_rate]
    for arm in arms:
        config = kl_arm_config(arm)
        for learning_rate in learning_rates:
            for beta in [0.0] if ALL_KL_ARMS[arm].get("beta") == 0.0 else betas:
                for seed in seeds:
                    # With `--diagnostics` (always with the long task) the runs record them: part of the spec.
                    diagnostics = {"diagnostics": True} if getattr(args, "diagnostics", False) else {}
                    spec = run_spec(
                        args,
                        sft_dirs,
                        seed,
                        config=config,
                        arm=arm,
                        beta=beta,
                        learning_rate=learning_rate,
                        **diagnostics,
                    )
                    folder = root / _arm_folder(arm)
                    if len(learning_rates) > 1:
                        folder = folder / f"lr{learning_rate:g}"
                    jobs.append((spec, str(folder / f"beta{beta:g}" / f"seed{seed}")))
    return jobs


def run_kl_table(args, sft_dirs: dict[int, str], pool) -> dict:
    """
    The KL table: the regularised arms at every β of ``args.kl_betas`` on the selection seeds (none with a single
    β), the β with the highest mean true reward at the end ([`rpg_research.cli.protocol.select_best`]) over all of them
    (``args.kl_beta_selection="shared"``: one β for every arm, so that the arms differ by their estimator only) or over
    each arm's own runs (``"per_arm"``: each estimator at its own best β, the fifth protocol), then every arm of
    ``args.kl_arms`` at its β on the final seeds. Returns the selection, the chosen β (``chosen_beta``: the shared one,
    None per arm; ``chosen_betas``: each arm's), the final runs and the rows of [`summarize_kl`].
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
    per_arm = getattr(args, "kl_beta_selection", "shared") == "per_arm"
    scores: dict[tuple[str, float], list[float]] = {}
    for (spec, _), result in zip(selection_jobs, selection):
        scores.setdefault((spec["arm"] if per_arm else "", spec["beta"]), []).append(result["last"])
    # One β for every arm (the arms then differ by their estimator only), or each arm's own.
    chosen = {
        arm: select_best({b: v for (a, b), v in scores.items() if a == (arm if per_arm else "")})
        if scores
        else args.kl_betas[0]
        for arm in regularised
    }
    beta = chosen[regularised[0]] if regularised and not per_arm else (None if per_arm else args.kl_betas[0])
    final_jobs = [
        job
        for arm in args.kl_arms
        for job in _kl_jobs(args, sft_dirs, [arm], [chosen.get(arm, 0.0)], args.final_seeds, root)
    ]
    results = run_jobs(final_jobs, kl_job, desc="KL table: final runs", **common)
    runs = [{**spec, **result, "run_dir": run_dir} for (spec, run_dir), result in zip(final_jobs, results)]
    return {
        "selection": [
            {"arm": spec["arm"], "beta": spec["beta"], "seed": spec["seed"], "last": result["last"]}
            for (spec, _), result in zip(selection_jobs, selection)
        ],
        "chosen_beta": beta,
        "chosen_betas": chosen,
        "runs": runs,
        "table": summarize_kl(runs),
        "dynamics": kl_dynamics(runs),
    }


def summarize_kl(runs: list[dict], group_keys: tuple[str, ...] = ("arm",)) -> list[dict]:
    """One row per value of `group_keys` (the arm; the arm, β and learning rate for the sweep): true and proxy reward at
    the end with intervals, the paired difference of the true reward to [`KL_BASELINE`] (when it ran on the same
    seeds), the token-level reverse KL to the warm start and the completion length at the end with intervals, the
    regulariser's own KL estimate and β at the end (means), and the number of collapsed runs."""
    from .protocol import mean_interval, paired_difference

    def key_of(run):
        return tuple(run[k] for k in group_keys)

    keys = list(dict.fromkeys(key_of(run) for run in runs))
    by_key = {key: [run for run in runs if key_of(run) == key] for key in keys}
    baseline = {run["seed"]: run["last"] for run in runs if run["arm"] == KL_BASELINE}
    rows = []
    for key, group in by_key.items():
        row = {**dict(zip(group_keys, key)), "beta": group[0]["beta"], "seeds": [run["seed"] for run in group]}
        row["learning_rate"] = group[0]["learning_rate"]
        for name in ("last", "best", "proxy_last", "length_end", "kl_to_warm_start"):
            row[name], row[name + "_ci"] = mean_interval([run[name] for run in group])
        for name in ("kl_estimate_end", "beta_end"):
            values = [run[name] for run in group if run.get(name) is not None]
            row[name] = statistics.fmean(values) if values else None
        row["collapsed"] = sum(run["collapsed"] for run in group)
        if baseline and row["arm"] != KL_BASELINE:
            mine = {run["seed"]: run["last"] for run in group}
            row["last_vs_baseline"], row["last_vs_baseline_ci"], _ = paired_difference(mine, baseline)
        rows.append(row)
    return rows


def kl_reading(arm: str) -> str:
    """Which reading of the paper, or which code, an arm of the KL table follows."""
    from rpg_trl.losses import KL_CLIP_MODES

    config = kl_arm_config(arm)
    if config.get("beta") == 0.0:
        return "no regulariser"
    if config["trainer"] == "grpo":
        return "TRL GRPOTrainer: KL at the unclipped w, added after the PPO clip"
    if not config.get("use_bias_correction_kl", True):
        return "GRPO's k3 without importance weight (Sec. 2.2)"
    if not config.get("rpg_clip", True):
        return "no RPG-Style Clip"
    return KL_CLIP_MODES[config["kl_clip_mode"]].source


def format_kl_table(rows: list[dict], beta: float | None, args) -> str:
    """Markdown table of the rows of [`summarize_kl`] (`beta`: the table's β; None: each arm's own, in a column)."""
    from .protocol import format_interval
    from .warm_start_bench import markdown_table

    n = len(args.final_seeds)
    betas = "β = each arm's own (column β)" if beta is None else f"β = {beta:g} for every regularised arm"
    caption = (
        f"**KL table** ({KL_REGIME} steps per generation, proxy reward with a length bias, lr "
        f"{args.kl_learning_rate:.2g}, {betas}, {args.steps} steps). True reward "
        f"(exact answers) and proxy on {args.eval_problems} held-out problems at the end (sampled mean@"
        f"{args.eval_samples}); mean ± 95 % interval over {n} final seeds; Δ: paired difference to '{KL_BASELINE}' "
        "(points). KL to warm start: the token-level reverse KL(π_θ‖π_warm) at the end, exact over the vocabulary "
        "on the policy's own held-out completions, the same measurement for every arm; regulariser's estimate: the "
        "arm's own logged `kl` over the last generation batch (its divergence and level; not comparable across arms); "
        "length: mean over the last generation batch."
    )
    header = [
        "Arm",
        *(["β"] if beta is None else []),
        "True reward (end)",
        f"Δ true vs {KL_BASELINE}",
        "Best true",
        "Proxy (end)",
        "KL to warm start",
        "Regulariser's estimate",
        "Completion length (tokens)",
        "Collapsed",
    ]
    cells = []
    for row in rows:
        cells.append(
            [
                row["arm"],
                *([f"{row['beta']:g}"] if beta is None else []),
                format_interval(row["last"], row["last_ci"], digits=3),
                "–"
                if "last_vs_baseline" not in row
                else format_interval(row["last_vs_baseline"], row["last_vs_baseline_ci"], scale=100, sign=True),
                format_interval(row["best"], row["best_ci"], digits=3),
                format_interval(row["proxy_last"], row["proxy_last_ci"], digits=3),
                format_interval(row["kl_to_warm_start"], row["kl_to_warm_start_ci"], digits=3),
                "–" if row["kl_estimate_end"] is None else f"{row['kl_estimate_end']:.3g}",
                format_interval(row["length_end"], row["length_end_ci"], digits=2),
                f"{row['collapsed']}/{n}",
            ]
        )
    return markdown_table(caption, header, cells)


def format_kl_readings(arms: list[str]) -> str:
    """Markdown table: the reading of the paper (or the code) each arm follows ([`kl_reading`])."""
    from .warm_start_bench import markdown_table

    return markdown_table(
        '**Which reading each arm is** (`rpg_trl.losses.KL_CLIP_MODES`; in the repository, docs/design.md, "The KL '
        'term outside the trust region").',
        ["Arm", "Reading"],
        [[arm, kl_reading(arm)] for arm in arms],
    )


def run_kl_sweep(args, sft_dirs: dict[int, str], pool) -> dict:
    """The robustness sweep: every arm of ``args.sweep_arms`` (default [`KL_SWEEP_ARMS`]) at every β of ``args.sweep_betas`` and learning rate of
    ``args.sweep_learning_rates`` on the sweep seeds (fresh: neither selection nor final seeds). Nothing is selected;
    every cell is reported."""
    from .protocol import run_jobs
    from .runs import describe_run

    root = Path(args.output_dir) / "kl_sweep"
    jobs = _kl_jobs(
        args, sft_dirs, list(args.sweep_arms), args.sweep_betas, args.sweep_seeds, root, args.sweep_learning_rates
    )
    results = run_jobs(
        jobs, kl_job, pool=pool, num_threads=args.num_threads, describe=describe_run, desc="KL sweep: runs"
    )
    runs = [{**spec, **result, "run_dir": run_dir} for (spec, run_dir), result in zip(jobs, results)]
    return {"runs": runs, "table": summarize_kl(runs, ("arm", "beta", "learning_rate"))}


def format_kl_sweep(rows: list[dict], args) -> str:
    """Markdown table of the sweep's rows: one per (β, learning rate), one column pair per arm."""
    from .protocol import format_interval
    from .warm_start_bench import markdown_table

    arms = list(dict.fromkeys(row["arm"] for row in rows))
    by_cell = {(row["beta"], row["learning_rate"], row["arm"]): row for row in rows}
    cells = []
    for beta in args.sweep_betas:
        for learning_rate in args.sweep_learning_rates:
            line = [f"{beta:g}", f"{learning_rate:g}"]
            for arm in arms:
                row = by_cell.get((beta, learning_rate, arm))
                line += (
                    ["", ""]
                    if row is None
                    else [
                        f"{format_interval(row['last'], row['last_ci'], digits=3)} "
                        f"({row['collapsed']}/{len(row['seeds'])} collapsed)",
                        format_interval(row["kl_to_warm_start"], row["kl_to_warm_start_ci"], digits=3),
                    ]
                )
            cells.append(line)
    header = ["β", "lr"] + [f"{arm}: {what}" for arm in arms for what in ("true reward (end)", "KL to warm start")]
    seeds = args.sweep_seeds
    caption = (
        f"**KL robustness sweep** ({KL_REGIME} steps per generation, proxy reward, {args.steps} steps, fresh seeds "
        f"{seeds[0]}-{seeds[-1]}): true reward on the held-out problems at the end, mean ± 95 % interval over "
        f"{len(seeds)} seeds, and collapsed runs; KL to warm start as in the KL table."
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
        f"{len(args.final_seeds)} final seeds: the regulariser's own logged KL estimate (its divergence and level; "
        "to the sampling policy for 'no KL'), the token entropy and the largest importance weight π_θ/π_old of each "
        "step."
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
