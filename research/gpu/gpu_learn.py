# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The learning stage of `research/gpu/gpu_run.sh`: a model that learns on the GPU, RPG beside GRPO, from the same warm
starts. On the demo's task (two-digit additions, `rpg_research.toy`), each seed's supervised warm start (built here,
or carried: it is small) is trained by RPG's default (`RPGTrainer`, RPG-REINFORCE-URKL, beta 1e-4 anchored to the
sampling policy) and by TRL's `GRPOTrainer` (beta 1e-4, the KL to the warm start: bench-algos' GRPO), with full
fine-tuning and with LoRA, all the runs at once on the one GPU (one process each); held-out accuracy (mean@4 at
temperature 1 on 400 problems never trained on) at the start, every `--eval-every` steps and at the end.

    python research/gpu/gpu_learn.py warm-starts WARM [--seeds 0,1,2,3,4,5] [--device cpu] [--sft-steps 1500]
    python research/gpu/gpu_learn.py train WARM RESULTS [--seeds 0,1,2,3,4,5] [--device cuda] [--steps 400] [--modes lora,full]
        [--learning-rates lora=1e-3,full=6e-4] [--lora-rank 16] [--lora-learning-rates 1e-3,2e-3,...]
    python research/gpu/gpu_learn.py summary RESULTS
    python research/gpu/gpu_learn.py seeds SWEEP_RESULTS [--sweep-rate 1e-3]

`train` writes each run's result as it finishes (RESULTS/learn/<arm>-<mode>/seed<k>/result.json, with its trainer
state), so a stage cut short by its deadline keeps the runs it finished; `summary` writes learning.md, learning.json
and, where matplotlib is installed, learning_curves.png (else run `summary` again where it is). Each run's result
holds the greedy accuracy (one greedy completion per held-out problem, logged by the held-out callback beside mean@4)
at the start and the end, the largest KL over its steps (``kl``) and its largest importance weight
(``importance_weight/max``; GRPOTrainer does not log it); the table gives them beside mean@4, with the number of
seeds whose greedy accuracy fell.

`--learning-rates lora=2e-3,full=6e-4` replaces a mode's rate (a mode not named keeps `LEARNING_RATES`'), and
`--lora-rank R` LoRA's rank (lora_alpha = 2R). `--lora-learning-rates` is the sweep that chooses LoRA's rate (issue
60): LoRA only, each rate an arm of its own (RESULTS/learn/<arm>-lora-lr<rate>/seed<k>/, with -r<R> before -lr when
the rank is not 16), RPG and GRPO each, on seeds other than the GPU run's final ones (0-5, refused). On the CPU:

    python research/gpu/gpu_learn.py warm-starts WARM --seeds 10,11 && python research/gpu/gpu_learn.py train WARM \\
        RESULTS --seeds 10,11 --device cpu --modes lora --lora-learning-rates 1e-3,2e-3,4e-3,6e-3 --steps 400 \\
        --workers 2

(16 runs of 400 steps; a rank other than 16 with `--lora-rank 32` into the same RESULTS, its own rows). Then
learning.md has one row per (training, lr, rank, arm): mean@4 and greedy, before, after and gain, and each seed's
peak KL and importance weight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path


#: Arm -> its method in `rpg-trl bench-algos` (`rpg_research.cli.bench_algos.ALGORITHMS`): RPG's defaults, and GRPO
#: with beta 1e-4 (the k3 KL to the warm start, group-std-scaled advantages, clip 0.2).
ARMS = {"RPG": "RPG-REINFORCE-URKL", "GRPO": "GRPO"}
#: Learning rate per training mode: the demo's for full fine-tuning; LoRA's (r=16 on every linear layer) chosen by the
#: CPU sweep of 2026-11-27 on seeds 10 and 11 (research/docs/benchmarks.md, "Preflight on CPU for the third run"): 1e-3,
#: where greedy accuracy fell on no seed (6e-3, the second GPU run's, lowered it on every seed, on the CPU too).
LEARNING_RATES = {"full": 6e-4, "lora": 1e-3}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
#: The GPU run's seeds: the sweep that chooses LoRA's rate (`--lora-learning-rates`) runs on others.
FINAL_SEEDS = (0, 1, 2, 3, 4, 5)
#: Planning the seeds (`seeds`): the power asked of the 95 % interval of the greedy-accuracy change (the chance that it
#: excludes zero when the true change is the sweep's), and the factor on the sweep's between-seed spread: 1.4 is the
#: upper 60 % confidence bound of a standard deviation estimated with 2 degrees of freedom (sqrt(2 / (-2 ln 0.6))),
#: the sweep's (two seeds, two arms), which also leaves room for the spread of bf16 on the GPU.
SEEDS_POWER = 0.8
SEEDS_SPREAD_FACTOR = 1.4


def lora_config(rank: int = LORA["r"]) -> dict:
    """`LORA` at rank `rank` (lora_alpha twice the rank, as at the default 16)."""
    return {**LORA, "r": rank, "lora_alpha": 2 * rank}


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a learning rate (a positive number such as 2e-3)")
    return value


def parse_learning_rates(text: str) -> dict[str, float]:
    """``lora=2e-3`` -> {"lora": 0.002}: the rates replacing `LEARNING_RATES`' of the modes named (an argparse type)."""
    rates: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        mode, sep, value = item.partition("=")
        mode = mode.strip()
        if not sep or mode not in LEARNING_RATES:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected MODE=RATE with MODE one of {', '.join(LEARNING_RATES)} (e.g. lora=2e-3)"
            )
        if mode in rates:
            raise argparse.ArgumentTypeError(f"{mode!r} named twice")
        rates[mode] = _rate(value.strip())
    return rates


def parse_rate_list(text: str) -> list[float]:
    """``1e-3,2e-3`` -> [0.001, 0.002]: the sweep's rates, each positive, none twice (an argparse type)."""
    rates = [_rate(item.strip()) for item in text.split(",") if item.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("no learning rate given (e.g. 1e-3,2e-3,4e-3)")
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"a learning rate named twice in {text!r}")
    return rates


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def arm_folder(arm: str, mode: str, *, learning_rate: float | None = None, rank: int = LORA["r"]) -> str:
    """The folder of an arm under RESULTS/learn: ``<arm>-<mode>`` (the GPU run's), or, in the sweep (given its
    `learning_rate`), ``<arm>-lora-lr<rate>`` with ``-r<rank>`` before ``-lr`` when the rank is not 16."""
    if learning_rate is None:
        return f"{arm}-{mode}"
    return f"{arm}-{mode}{'' if rank == LORA['r'] else f'-r{rank}'}-lr{learning_rate:g}"


def _folders(warm: str, seeds: list[int]) -> dict[int, str]:
    return {seed: os.path.join(warm, f"seed{seed}") for seed in seeds}


def warm_start_job(spec: dict, run_dir: str) -> dict:
    """The warm start of `spec["seed"]` in `run_dir`, reused when one of the same settings is there."""
    from rpg_research.toy.addition import make_splits
    from rpg_research.toy.warm_start import cached_warm_start

    splits = make_splits(spec["seed"], num_eval=spec["eval_problems"])
    return cached_warm_start(
        splits,
        run_dir,
        steps=spec["sft_steps"],
        seed=spec["seed"],
        extra_rounds=spec["extra_rounds"],
        device=spec["device"],
    )


def train_job(spec: dict, run_dir: str) -> dict:
    """One run: `spec["arm"]` from the warm start `spec["sft_dir"]`, full or LoRA; its held-out summary and curve."""
    from trl import GRPOConfig, GRPOTrainer

    from rpg_research.cli.bench_algos import algorithm_config
    from rpg_research.cli.runs import run_summary, train_quietly, warm_started
    from rpg_research.toy.addition import addition_reward, build_rl_dataset
    from rpg_research.toy.training import rl_training_kwargs
    from rpg_trl import RPGConfig, RPGTrainer

    overrides = algorithm_config(ARMS[spec["arm"]])
    kind = overrides.pop("trainer")
    splits, model, tokenizer, accuracy = warm_started(spec)
    kwargs = rl_training_kwargs(
        steps=spec["steps"], seed=spec["seed"], learning_rate=spec["learning_rate"], device=spec["device"]
    )
    kwargs["disable_tqdm"] = True
    config_class, trainer_class = (RPGConfig, RPGTrainer) if kind == "rpg" else (GRPOConfig, GRPOTrainer)
    peft_config = None
    if spec["mode"] == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(**lora_config(spec.get("lora_rank", LORA["r"])))
    trainer = trainer_class(
        model=model,
        reward_funcs=addition_reward,
        args=config_class(output_dir=run_dir, **kwargs, **overrides),
        train_dataset=build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[accuracy],
        peft_config=peft_config,
    )
    seconds = train_quietly(trainer)
    result = run_summary(trainer.state.log_history, accuracy.curve, seconds, trainer.args.steps_per_generation)
    result.update(run_extremes(trainer.state.log_history))
    for point, entry in zip(result["accuracy_curve"], accuracy.curve):
        point["greedy_accuracy"] = entry.get("heldout/greedy_accuracy")
    result["device"] = str(trainer.accelerator.device)
    result["bf16"] = trainer.args.bf16
    return result


def run_extremes(history: list[dict]) -> dict:
    """From a run's `log_history`: its greedy held-out accuracy at the first and the last evaluation
    (``heldout/greedy_accuracy``, the held-out callback's) and their difference, and the largest ``kl`` and
    ``importance_weight/max`` over its steps (finite values; None where not logged)."""
    from rpg_research.toy.curves import metric_series

    _, greedy = metric_series(history, "heldout/greedy_accuracy")
    out = {
        "greedy_initial": greedy[0] if greedy else None,
        "greedy_last": greedy[-1] if greedy else None,
        "greedy_gain": greedy[-1] - greedy[0] if greedy else None,
    }
    for key, name in (("kl", "kl_peak"), ("importance_weight/max", "importance_weight_peak")):
        values = metric_series(history, key)[1]
        out[name] = max(values) if values else None
    return out


def _specs(args) -> list[tuple[dict, str]]:
    """The runs (spec, folder); the versions are env.json's (rpg_trl runs from the tree, with no package metadata). Each
    run's `sft_steps` is its warm start's, as recorded in its ``warm_start.json`` (the warm start may be carried, built
    with other settings than this command's defaults). The rate of each mode is `args.learning_rates`' (default
    `LEARNING_RATES`); with `args.lora_learning_rates` (the sweep), LoRA at each of those rates, each its own arm."""
    folders = _folders(args.warm, args.seeds)
    sft_steps = {
        seed: json.loads(Path(sft_dir, "warm_start.json").read_text())["settings"]["sft_steps"]
        for seed, sft_dir in folders.items()
    }
    rank = getattr(args, "lora_rank", LORA["r"])
    rates = {**LEARNING_RATES, **(getattr(args, "learning_rates", None) or {})}
    sweep = getattr(args, "lora_learning_rates", None)
    if sweep:
        configs = [("lora", rate, {"learning_rate": rate, "rank": rank}) for rate in sweep]
    else:
        configs = [(mode, rates[mode], {}) for mode in args.modes]
    jobs = []
    for mode, learning_rate, folder_of in configs:
        for arm in ARMS:
            for seed, sft_dir in folders.items():
                spec = {
                    "arm": arm,
                    "mode": mode,
                    "seed": seed,
                    "sft_dir": sft_dir,
                    "sft_steps": sft_steps[seed],
                    "device": args.device,
                    "steps": args.steps,
                    "learning_rate": learning_rate,
                    "eval_every": args.eval_every,
                    "eval_problems": args.eval_problems,
                    "eval_samples": 4,
                }
                if mode == "lora":
                    spec["lora_rank"] = rank
                folder = arm_folder(arm, mode, **folder_of)
                jobs.append((spec, os.path.join(args.results, "learn", folder, f"seed{seed}")))
    return jobs


def run_warm_starts(args) -> None:
    from rpg_research.cli.protocol import job_pool, run_jobs

    specs = {"sft_steps": args.sft_steps, "extra_rounds": args.sft_extra_rounds, "device": args.device}
    specs["eval_problems"] = args.eval_problems
    jobs = [({**specs, "seed": seed}, folder) for seed, folder in _folders(args.warm, args.seeds).items()]
    with job_pool(min(args.workers, len(jobs))) as pool:
        run_jobs(jobs, warm_start_job, pool=pool, desc="warm starts")


def run_training(args) -> None:
    from rpg_research.cli.protocol import job_pool, run_jobs

    for seed, folder in _folders(args.warm, args.seeds).items():
        if not os.path.isfile(os.path.join(folder, "warm_start.json")):
            sys.exit(f"gpu_learn.py: no warm start of seed {seed} in {folder}: run `warm-starts` first")
    jobs = _specs(args)
    try:
        with job_pool(min(args.workers, len(jobs))) as pool:
            run_jobs(jobs, train_job, pool=pool, desc="learning runs", describe=_describe)
    finally:  # the runs that finished, even if one failed
        summary(args.results)


def _describe(spec: dict, result: dict) -> str:
    greedy = ""
    if result.get("greedy_initial") is not None:
        greedy = f", greedy {result['greedy_initial']:.3f} -> {result['greedy_last']:.3f}"
    return (
        f"{spec['arm']} {spec['mode']} lr {spec['learning_rate']:g} seed {spec['seed']}: held-out "
        f"{result['initial']:.3f} -> {result['last']:.3f}{greedy} in {result['seconds']:.0f} s"
    )


def _results(results: str) -> list[tuple[dict, dict]]:
    """The finished runs (spec, result). A result written before the greedy accuracy and the peaks were (an earlier
    GPU run's) gains them from the run's ``trainer_state.json`` where it is kept."""
    found = []
    for path in sorted(Path(results, "learn").glob("*/seed*/result.json")):
        stored = json.loads(path.read_text())
        result = stored["result"]
        state = path.parent / "trainer_state.json"
        if "greedy_initial" not in result and state.is_file():
            result.update(run_extremes(json.loads(state.read_text()).get("log_history", [])))
        found.append((stored["spec"], result))
    return found


def _group_key(spec: dict) -> tuple:
    """(mode, learning rate, LoRA rank or None, arm): one row of the table. LoRA's rank is `LORA`'s where the spec
    predates the option."""
    rank = spec.get("lora_rank", LORA["r"]) if spec["mode"] == "lora" else None
    return spec["mode"], spec["learning_rate"], rank, spec["arm"]


def _per_seed(by_seed: dict[int, dict], key: str) -> str:
    """Each seed's `key` (in seed order), " / " between them; "–" where a run has none."""
    return " / ".join("–" if by_seed[s].get(key) is None else f"{by_seed[s][key]:.3g}" for s in sorted(by_seed))


def summary(results: str) -> dict:
    """learning.md and learning.json from the finished runs under RESULTS/learn, and the curves where matplotlib is:
    one row per (mode, learning rate, LoRA rank, arm)."""
    from rpg_research.cli.protocol import format_interval, mean_interval, paired_difference

    runs = _results(results)
    groups: dict[tuple, dict[int, dict]] = {}
    for spec, result in runs:
        groups.setdefault(_group_key(spec), {})[spec["seed"]] = {**result, "spec": spec}
    rows = []
    for key, by_seed in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1], item[0][2] or 0, item[0][3])):
        mode, learning_rate, rank, arm = key
        spec = next(iter(by_seed.values()))["spec"]
        row = {"mode": mode, "arm": arm, "seeds": sorted(by_seed), "learning_rate": learning_rate, "lora_rank": rank}
        row["steps"], row["device"] = spec["steps"], next(iter(by_seed.values())).get("device")
        for name in ("initial", "last", "gain", "seconds"):
            row[name], row[f"{name}_half"] = mean_interval([r[name] for r in by_seed.values()])
        if all(r.get("greedy_initial") is not None for r in by_seed.values()):
            for name in ("greedy_initial", "greedy_last", "greedy_gain"):
                row[name], row[f"{name}_half"] = mean_interval([r[name] for r in by_seed.values()])
            row["greedy_fell"] = sum(r["greedy_last"] < r["greedy_initial"] for r in by_seed.values())
        for name in ("kl_peak", "importance_weight_peak"):
            row[name] = {seed: by_seed[seed].get(name) for seed in sorted(by_seed)}
        baseline = groups.get((mode, learning_rate, rank, "GRPO"))
        if arm != "GRPO" and baseline:
            last = {s: r["last"] for s, r in by_seed.items()}
            row["vs_grpo"], row["vs_grpo_half"], _ = paired_difference(
                last, {s: r["last"] for s, r in baseline.items()}
            )
        row["_per_seed"] = {name: _per_seed(by_seed, name) for name in ("kl_peak", "importance_weight_peak")}
        rows.append(row)
    first = runs[0][0] if runs else {"eval_problems": "?", "device": "?"}
    lines = [
        f"Learning on {first['device']}: held-out accuracy (mean@4, temperature 1, {first['eval_problems']} two-digit "
        "additions never trained on; greedy: one greedy completion per problem) from the same supervised warm start "
        "per seed; mean ± 95 % interval over the seeds; greedy fell: the seeds whose greedy accuracy fell; Δ vs GRPO "
        "(mean@4 after) paired by seed (points); peak KL and peak importance weight: each seed's largest logged `kl` "
        "and `importance_weight/max` over the steps (– where not logged); trained weights (the warm start), the runs "
        "at once (one process each), generation by transformers (no vLLM).",
        "",
        "| training | arm | seeds | lr | rank | steps | before | after | gain (points) | greedy before | greedy after | "
        "greedy gain (points) | greedy fell | Δ after vs GRPO (points) | peak KL | peak importance weight | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = format_interval(r["vs_grpo"], r["vs_grpo_half"], scale=100, sign=True) if "vs_grpo" in r else "–"
        if "greedy_initial" in r:
            greedy = (
                f"{format_interval(r['greedy_initial'], r['greedy_initial_half'], digits=3)} | "
                f"{format_interval(r['greedy_last'], r['greedy_last_half'], digits=3)} | "
                f"{format_interval(r['greedy_gain'], r['greedy_gain_half'], scale=100, sign=True)} | "
                f"{r['greedy_fell']}/{len(r['seeds'])}"
            )
        else:
            greedy = "– | – | – | –"
        per_seed = r.pop("_per_seed")
        lines.append(
            f"| {r['mode']} | {r['arm']} | {len(r['seeds'])} | {r['learning_rate']:g} | "
            f"{'–' if r['lora_rank'] is None else r['lora_rank']} | {r['steps']} | "
            f"{format_interval(r['initial'], r['initial_half'], digits=3)} | "
            f"{format_interval(r['last'], r['last_half'], digits=3)} | "
            f"{format_interval(r['gain'], r['gain_half'], scale=100, sign=True)} | {greedy} | {vs} | "
            f"{per_seed['kl_peak']} | {per_seed['importance_weight_peak']} | {r['seconds']:.0f} |"
        )
    out = {"rows": rows, "runs": [{"spec": spec, "result": result} for spec, result in runs]}
    Path(results, "learning.json").write_text(json.dumps(out, indent=2, default=_json_nan) + "\n")
    plot = _plot(groups, os.path.join(results, "learning_curves.png"))
    lines += [
        "",
        f"curves: {plot}" if plot else "curves: not drawn here (no matplotlib): `gpu_learn.py summary` again",
    ]
    text = "\n".join(lines) + "\n"
    Path(results, "learning.md").write_text(text)
    return out


def _json_nan(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def _panel_title(mode: str, learning_rate: float, rank: int | None) -> str:
    return f"full fine-tuning, lr {learning_rate:g}" if mode == "full" else f"LoRA r={rank}, lr {learning_rate:g}"


def _plot(groups: dict, path: str) -> str | None:
    """Held-out accuracy against the step: each run thin, each arm's mean over its seeds thick (mean@4 solid, greedy
    dashed); one panel per (mode, learning rate, rank)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({key[:3] for key in groups}, key=lambda k: (k[0], k[1], k[2] or 0))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        for color, arm in zip(("tab:blue", "tab:orange"), ARMS):
            by_seed = groups.get((*panel, arm), {})
            curves = [r["accuracy_curve"] for r in by_seed.values()]
            for curve in curves:
                ax.plot([e["step"] for e in curve], [e["accuracy"] for e in curve], color=color, alpha=0.3, lw=0.8)
            if curves and all(len(c) == len(curves[0]) for c in curves):
                steps = [e["step"] for e in curves[0]]
                mean = [statistics.fmean(c[i]["accuracy"] for c in curves) for i in range(len(steps))]
                ax.plot(steps, mean, color=color, lw=2, label=f"{arm} ({len(curves)} seeds)")
                if all(e.get("greedy_accuracy") is not None for c in curves for e in c):
                    greedy = [statistics.fmean(c[i]["greedy_accuracy"] for c in curves) for i in range(len(steps))]
                    ax.plot(steps, greedy, color=color, lw=1.5, ls="--", label=f"{arm} greedy")
        ax.set_title(_panel_title(*panel))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("held-out accuracy (mean@4; greedy dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_greedy_changes(results: str, learning_rate: float, mode: str = "lora") -> dict[str, dict[int, float]]:
    """Each seed's greedy-accuracy change (last minus first evaluation, in points) per arm, of the runs under
    RESULTS/learn at `learning_rate` in `mode`, or of RESULTS/learning.json's runs where the runs' folders were not kept
    (a sweep's, e.g. research/docs/results/lora_sweep_cpu_2026-11-27)."""
    runs = _results(results)
    if not runs and Path(results, "learning.json").is_file():
        runs = [(run["spec"], run["result"]) for run in json.loads(Path(results, "learning.json").read_text())["runs"]]
    changes: dict[str, dict[int, float]] = {}
    for spec, result in runs:
        if spec["mode"] == mode and math.isclose(spec["learning_rate"], learning_rate, rel_tol=1e-9):
            if result.get("greedy_gain") is not None:
                changes.setdefault(spec["arm"], {})[spec["seed"]] = 100 * result["greedy_gain"]
    if not changes:
        raise ValueError(f"no {mode} run at learning rate {learning_rate:g} with its greedy accuracy in {results}")
    return changes


def pooled_spread(changes: dict[str, dict[int, float]]) -> tuple[float, float, int]:
    """(mean change over every run, the between-seed standard deviation pooled over the arms, its degrees of freedom):
    each arm's spread about its own mean, as the interval of one arm's change over its seeds will see it."""
    values = [v for by_seed in changes.values() for v in by_seed.values()]
    squares, df = 0.0, 0
    for by_seed in changes.values():
        if len(by_seed) > 1:
            squares += statistics.variance(by_seed.values()) * (len(by_seed) - 1)
            df += len(by_seed) - 1
    if not df:
        raise ValueError("the spread between seeds needs two seeds of one arm at least")
    return statistics.fmean(values), math.sqrt(squares / df), df


def interval_power(effect: float, spread: float, seeds: int, *, points: int = 4000) -> float:
    """The chance that the 95 % Student-t interval of the mean over `seeds` seeds excludes zero, when each seed's change
    is drawn from a normal of mean `effect` and standard deviation `spread`: the power of the two-sided one-sample t
    test, P(|T| > t_{0.975, n-1}) for T noncentral t with n-1 degrees of freedom and noncentrality effect sqrt(n) /
    spread, integrated over the chi law of the sample standard deviation (Simpson's rule on `points` intervals; no scipy
    needed, equal to scipy.stats.nct's to 1e-4)."""
    from rpg_research.cli.protocol import t_quantile_975

    if seeds < 2 or spread <= 0:
        raise ValueError(f"an interval needs 2 seeds or more and a positive spread; got {seeds} and {spread}")
    df = seeds - 1
    shift = effect * math.sqrt(seeds) / spread
    critical = t_quantile_975(df)

    def normal_cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    def integrand(u: float) -> float:  # over u = sqrt(v), v chi-square: finite at 0 for df = 1 too
        if u <= 0:
            return 0.0 if df > 1 else math.sqrt(2 / math.pi) * 2 * normal_cdf(-shift)
        log_density = (df - 1) * math.log(u) - u * u / 2 - (df / 2 - 1) * math.log(2) - math.lgamma(df / 2)
        bound = critical * u / math.sqrt(df)
        return math.exp(log_density) * (normal_cdf(shift - bound) + normal_cdf(-shift - bound))

    top = math.sqrt(df + 60 * math.sqrt(2 * df) + 60)  # the chi-square's mass beyond is far below 1e-9
    step = top / points
    total = integrand(0.0) + integrand(top)
    for i in range(1, points):
        total += (4 if i % 2 else 2) * integrand(i * step)
    return total * step / 3


def seeds_needed(effect: float, spread: float, *, power: float = SEEDS_POWER, most: int = 20) -> int:
    """The fewest seeds (2 or more) whose 95 % interval of the mean change excludes zero with chance `power` at least
    (`interval_power`); ValueError past `most`."""
    for seeds in range(2, most + 1):
        if interval_power(effect, spread, seeds) >= power:
            return seeds
    raise ValueError(f"more than {most} seeds for power {power} at effect {effect:g} and spread {spread:g}")


def seeds_report(results: str, learning_rate: float) -> str:
    """How many seeds the GPU run needs, from a sweep's per-seed greedy-accuracy changes at `learning_rate`: the
    effect (their mean), the pooled spread, the planning spread (`SEEDS_SPREAD_FACTOR` x), the power of 2-8 seeds at
    both, and the seeds needed for `SEEDS_POWER` at the planning spread."""
    changes = sweep_greedy_changes(results, learning_rate)
    effect, spread, df = pooled_spread(changes)
    planning = SEEDS_SPREAD_FACTOR * spread
    per_seed = "; ".join(
        f"{arm} " + ", ".join(f"seed {s}: {v:+.2f}" for s, v in sorted(by_seed.items()))
        for arm, by_seed in sorted(changes.items())
    )
    lines = [
        f"greedy-accuracy change at lr {learning_rate:g} (points): {per_seed}",
        f"effect {effect:+.2f}, spread between seeds {spread:.2f} ({df} df), planning spread {planning:.2f}",
        "| seeds | t (95 %) | power at the spread | power at the planning spread |",
        "|---|---|---|---|",
    ]
    from rpg_research.cli.protocol import t_quantile_975

    for seeds in range(2, 9):
        lines.append(
            f"| {seeds} | {t_quantile_975(seeds - 1):.3f} | {interval_power(effect, spread, seeds):.2f} | "
            f"{interval_power(effect, planning, seeds):.2f} |"
        )
    lines.append(f"seeds needed for power {SEEDS_POWER:g} at the planning spread: {seeds_needed(effect, planning)}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: the seeds, the modes (of `LEARNING_RATES`), the rates and the sweep (LoRA only,
    on seeds other than `FINAL_SEEDS`, its rates not also given by `--learning-rates lora=`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["warm-starts", "train", "summary", "seeds"])
    parser.add_argument(
        "folders",
        nargs="+",
        help="WARM (warm-starts), WARM RESULTS (train), RESULTS (summary) or SWEEP_RESULTS (seeds)",
    )
    parser.add_argument("--seeds", default=",".join(map(str, FINAL_SEEDS)))
    parser.add_argument("--sweep-rate", type=_rate, default=None, help="seeds: the sweep's rate (default LoRA's)")
    parser.add_argument("--device", default=None, help="default: cpu for the warm starts, cuda for the runs")
    parser.add_argument("--sft-steps", type=int, default=1500)
    parser.add_argument("--sft-extra-rounds", type=int, default=3, help="rounds added while the model cannot add")
    parser.add_argument("--steps", type=int, default=400, help="RL optimizer steps (the demo's 400)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-problems", type=int, default=400)
    parser.add_argument("--modes", default=None, help=f"of {','.join(LEARNING_RATES)} (default: all; the sweep: lora)")
    parser.add_argument(
        "--learning-rates",
        type=parse_learning_rates,
        default={},
        help="MODE=RATE,... replacing a mode's learning rate (default "
        + ",".join(f"{mode}={rate:g}" for mode, rate in LEARNING_RATES.items())
        + ")",
    )
    parser.add_argument("--lora-rank", type=_positive_int, default=LORA["r"], help="LoRA's rank (lora_alpha: twice)")
    parser.add_argument(
        "--lora-learning-rates",
        type=parse_rate_list,
        default=None,
        help="the sweep: LoRA only, at each of these rates (e.g. 1e-3,2e-3,4e-3), each its own arm",
    )
    parser.add_argument("--workers", type=int, default=12, help="runs at once (processes of one torch thread)")
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"argument --seeds: {args.seeds!r} is not a list of integers (e.g. 10,11)")
    given_modes = args.modes is not None
    args.modes = [m.strip() for m in (args.modes or ",".join(LEARNING_RATES)).split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in LEARNING_RATES]
    if unknown or not args.modes:
        parser.error(
            f"argument --modes: {','.join(unknown) or 'none'} unknown; the modes are {', '.join(LEARNING_RATES)}"
        )
    if args.lora_learning_rates is not None:
        if given_modes and args.modes != ["lora"]:
            parser.error("argument --lora-learning-rates: the sweep trains LoRA only (--modes lora or no --modes)")
        if "lora" in args.learning_rates:
            parser.error("argument --lora-learning-rates: not with --learning-rates lora=... (the sweep sets them)")
        final = sorted(set(args.seeds) & set(FINAL_SEEDS))
        if final and args.command == "train":
            parser.error(
                f"argument --lora-learning-rates: seed(s) {final} are the GPU run's final seeds "
                f"({','.join(map(str, FINAL_SEEDS))}); the sweep chooses the rate on others (e.g. --seeds 10,11)"
            )
        args.modes = ["lora"]
    args.learning_rates = {**LEARNING_RATES, **args.learning_rates}
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "summary":
        print(Path(args.folders[0], "learning.md").read_text() if summary(args.folders[0]) else "")
        return
    if args.command == "seeds":
        print(seeds_report(args.folders[0], args.sweep_rate or LEARNING_RATES["lora"]))
        return
    args.warm = args.folders[0]
    if args.command == "warm-starts":
        args.device = args.device or "cpu"
        run_warm_starts(args)
    else:
        args.device, args.results = args.device or "cuda", args.folders[1]
        run_training(args)
        print(Path(args.results, "learning.md").read_text())


if __name__ == "__main__":
    main()
