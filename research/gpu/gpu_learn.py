# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The learning stage of `research/gpu/gpu_run.sh`: a model that learns on the GPU, RPG beside GRPO, from the same warm
starts. On the demo's task (two-digit additions, `rpg_research.toy`), each seed's supervised warm start (built here,
or carried: it is small) is trained by RPG's default (`RPGTrainer`, RPG-REINFORCE-URKL, beta 1e-4 anchored to the
sampling policy) and by TRL's `GRPOTrainer` (beta 1e-4, the KL to the warm start: bench-algos' GRPO), with full
fine-tuning and with LoRA, all the runs at once on the one GPU (one process each); held-out accuracy (mean@4 at
temperature 1 on 400 problems never trained on) at the start, every `--eval-every` steps and at the end.

    python research/gpu/gpu_learn.py warm-starts WARM [--seeds 0,1,2] [--device cpu] [--sft-steps 1500]
    python research/gpu/gpu_learn.py train WARM RESULTS [--seeds 0,1,2] [--device cuda] [--steps 400] [--modes full,lora]
    python research/gpu/gpu_learn.py summary RESULTS

`train` writes each run's result as it finishes (RESULTS/learn/<arm>-<mode>/seed<k>/result.json, with its trainer
state), so a stage cut short by its deadline keeps the runs it finished; `summary` writes learning.md, learning.json
and, where matplotlib is installed, learning_curves.png (else run `summary` again where it is).
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
#: Learning rate per training mode: the demo's for full fine-tuning; LoRA (r=16 on every linear layer) trains fewer
#: weights, with a larger rate.
LEARNING_RATES = {"full": 6e-4, "lora": 6e-3}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


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

        peft_config = LoraConfig(**LORA)
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
    result["device"] = str(trainer.accelerator.device)
    result["bf16"] = trainer.args.bf16
    return result


def _specs(args) -> list[tuple[dict, str]]:
    """The runs (spec, folder); the versions are env.json's (rpg_trl runs from the tree, with no package metadata). Each
    run's `sft_steps` is its warm start's, as recorded in its ``warm_start.json`` (the warm start may be carried, built
    with other settings than this command's defaults)."""
    folders = _folders(args.warm, args.seeds)
    sft_steps = {
        seed: json.loads(Path(sft_dir, "warm_start.json").read_text())["settings"]["sft_steps"]
        for seed, sft_dir in folders.items()
    }
    jobs = []
    for mode in args.modes:
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
                    "learning_rate": LEARNING_RATES[mode],
                    "eval_every": args.eval_every,
                    "eval_problems": args.eval_problems,
                    "eval_samples": 4,
                }
                jobs.append((spec, os.path.join(args.results, "learn", f"{arm}-{mode}", f"seed{seed}")))
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
    return (
        f"{spec['arm']} {spec['mode']} seed {spec['seed']}: held-out {result['initial']:.3f} -> {result['last']:.3f} "
        f"in {result['seconds']:.0f} s"
    )


def _results(results: str) -> list[tuple[dict, dict]]:
    found = []
    for path in sorted(Path(results, "learn").glob("*/seed*/result.json")):
        stored = json.loads(path.read_text())
        found.append((stored["spec"], stored["result"]))
    return found


def summary(results: str) -> dict:
    """learning.md and learning.json from the finished runs under RESULTS/learn, and the curves where matplotlib is."""
    from rpg_research.cli.protocol import format_interval, mean_interval, paired_difference

    runs = _results(results)
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for spec, result in runs:
        groups.setdefault((spec["mode"], spec["arm"]), {})[spec["seed"]] = {**result, "spec": spec}
    rows = []
    for (mode, arm), by_seed in sorted(groups.items()):
        spec = next(iter(by_seed.values()))["spec"]
        row = {"mode": mode, "arm": arm, "seeds": sorted(by_seed), "learning_rate": spec["learning_rate"]}
        row["steps"], row["device"] = spec["steps"], next(iter(by_seed.values())).get("device")
        for key in ("initial", "last", "gain", "seconds"):
            row[key], row[f"{key}_half"] = mean_interval([r[key] for r in by_seed.values()])
        baseline = groups.get((mode, "GRPO"))
        if arm != "GRPO" and baseline:
            last = {s: r["last"] for s, r in by_seed.items()}
            row["vs_grpo"], row["vs_grpo_half"], _ = paired_difference(
                last, {s: r["last"] for s, r in baseline.items()}
            )
        rows.append(row)
    first = runs[0][0] if runs else {"eval_problems": "?", "device": "?"}
    lines = [
        f"Learning on {first['device']}: held-out accuracy (mean@4, temperature 1, {first['eval_problems']} two-digit "
        "additions never trained on) from the same supervised warm start per seed; mean ± 95 % interval over the "
        "seeds; Δ vs GRPO paired by seed (points); trained weights (the warm start), the runs at once (one process "
        "each), generation by transformers (no vLLM).",
        "",
        "| training | arm | seeds | lr | steps | before | after | gain (points) | Δ after vs GRPO (points) | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = format_interval(r["vs_grpo"], r["vs_grpo_half"], scale=100, sign=True) if "vs_grpo" in r else "–"
        lines.append(
            f"| {r['mode']} | {r['arm']} | {len(r['seeds'])} | {r['learning_rate']:g} | {r['steps']} | "
            f"{format_interval(r['initial'], r['initial_half'], digits=3)} | "
            f"{format_interval(r['last'], r['last_half'], digits=3)} | "
            f"{format_interval(r['gain'], r['gain_half'], scale=100, sign=True)} | {vs} | {r['seconds']:.0f} |"
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


def _plot(groups: dict, path: str) -> str | None:
    """Held-out accuracy against the step: each run thin, each arm's mean over its seeds thick; one panel per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    modes = sorted({mode for mode, _ in groups})
    if not modes:
        return None
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        for color, arm in zip(("tab:blue", "tab:orange"), ARMS):
            by_seed = groups.get((mode, arm), {})
            curves = [r["accuracy_curve"] for r in by_seed.values()]
            for curve in curves:
                ax.plot([e["step"] for e in curve], [e["accuracy"] for e in curve], color=color, alpha=0.3, lw=0.8)
            if curves and all(len(c) == len(curves[0]) for c in curves):
                steps = [e["step"] for e in curves[0]]
                mean = [statistics.fmean(c[i]["accuracy"] for c in curves) for i in range(len(steps))]
                ax.plot(steps, mean, color=color, lw=2, label=f"{arm} ({len(curves)} seeds)")
        ax.set_title(f"{mode} fine-tuning" if mode == "full" else "LoRA")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("held-out accuracy (mean@4)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["warm-starts", "train", "summary"])
    parser.add_argument("folders", nargs="+", help="WARM (warm-starts), WARM RESULTS (train) or RESULTS (summary)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--device", default=None, help="default: cpu for the warm starts, cuda for the runs")
    parser.add_argument("--sft-steps", type=int, default=1500)
    parser.add_argument("--sft-extra-rounds", type=int, default=3, help="rounds added while the model cannot add")
    parser.add_argument("--steps", type=int, default=400, help="RL optimizer steps (the demo's 400)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-problems", type=int, default=400)
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--workers", type=int, default=12, help="runs at once (processes of one torch thread)")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if args.command == "summary":
        print(Path(args.folders[0], "learning.md").read_text() if summary(args.folders[0]) else "")
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
