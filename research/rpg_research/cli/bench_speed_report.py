# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The report of `rpg-trl bench-speed` ([`rpg_research.cli.bench_speed`]): the runs over their repeats, the paired
ratios and the A/A noise band, the targets (a), (b), (c), what was timed in words, and the markdown tables (the
breakdown of a step's time included); pure functions of the workers' results."""

from __future__ import annotations

import statistics


#: Where a step's time goes (the report's table of that name): each phase timed between device synchronisations,
#: averaged over the timed steps (the scoring, done once per generation, spread over its steps); "rest of the step" is
#: the step time less the phases (TRL's input preparation and logging, the Trainer's bookkeeping, gradient clipping).
PHASES = (
    "scoring: policy log-probs",
    "scoring: reference log-probs",
    "scoring: rollout, rewards, rest",
    "forward and loss",
    "backward",
    "optimizer step",
    "rest of the step",
)
COMPARISONS = [
    ("(A/A) GRPO vs GRPO, the same run", "grpo-ref-2", "grpo-ref"),
    ("(a) RPG sampling anchor vs GRPO beta>0", "rpg-sampling", "grpo-ref"),
    ("(b) RPG reference model vs GRPO beta>0", "rpg-reference", "grpo-ref"),
]
#: The targets: (a) the share of the reference pass the anchor saves, and of one copy of the weights (full fine-tuning);
#: (c) the loss alone against GRPO's.
TARGET_A_SHARE, TARGET_A_WEIGHTS, TARGET_C = 0.90, 0.95, 1.05


def summarize(results: list[dict]) -> dict:
    """One scenario over its repeats: medians, with the step time's range; what does not vary, from the first."""
    times = [r["step_time_s"] for r in results]
    return {
        "step_time_s": statistics.median(times),
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_time_per_repeat_s": times,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
        "peak_memory_bytes": statistics.median(r["peak_memory_bytes"] for r in results),
        "model_weight_bytes": results[0]["model_weight_bytes"],
        "weights_in_memory_bytes": results[0]["weights_in_memory_bytes"],
        "has_ref_model": results[0]["has_ref_model"],
        "vocab_size": results[0]["vocab_size"],
        "resident_before_bytes": max((r["resident_before_bytes"] or 0) for r in results),
        "breakdown_s": {phase: statistics.median(r["breakdown_s"][phase] for r in results) for phase in PHASES},
    }


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Each comparison of [`COMPARISONS`] whose runs were measured: the step-time ratio of each repeat (the two runs of
    one repeat, paired), its median and range and its largest distance from 1 (`band`), and the peak memory's."""
    out = {}
    for label, num, den in COMPARISONS:
        if num not in runs or den not in runs:
            continue
        per_repeat = [n["step_time_s"] / d["step_time_s"] for n, d in zip(runs[num], runs[den])]
        memory = [n["peak_memory_bytes"] / d["peak_memory_bytes"] for n, d in zip(runs[num], runs[den])]
        saved = [d["peak_memory_bytes"] - n["peak_memory_bytes"] for n, d in zip(runs[num], runs[den])]
        out[label] = {
            "step_time": statistics.median(per_repeat),
            "step_time_min": min(per_repeat),
            "step_time_max": max(per_repeat),
            "step_time_per_repeat": per_repeat,
            "band": max(abs(r - 1) for r in per_repeat),
            "peak_memory": statistics.median(memory),
            "peak_memory_saved_bytes": statistics.median(saved),
        }
    return out


def targets(
    summary: dict, runs: dict, ratios_: dict, band: float | None, loss: dict | None, lora: bool, cuda: bool = True
) -> dict:
    """The targets (a), (b), (c), each with its measured value, its rule and whether it is met (None: not measurable
    in this run: no A/A pair or a single repeat for (b), LoRA or the CPU for the memory of (a))."""
    out = {}
    if "rpg-sampling" in runs:
        reference_pass = summary["grpo-ref"]["breakdown_s"]["scoring: reference log-probs"]
        saved = statistics.median(
            g["step_time_s"] - s["step_time_s"] for g, s in zip(runs["grpo-ref"], runs["rpg-sampling"])
        )
        share = saved / reference_pass if reference_pass > 0 else float("nan")
        out["(a) time"] = {
            "value": share,
            "saved_s": saved,
            "reference_pass_s": reference_pass,
            "rule": f"the step time saved >= {TARGET_A_SHARE:.0%} of GRPO's reference pass",
            "met": share >= TARGET_A_SHARE,
        }
        weights = summary["grpo-ref"]["model_weight_bytes"]
        saved_bytes = summary["grpo-ref"]["peak_memory_bytes"] - summary["rpg-sampling"]["peak_memory_bytes"]
        out["(a) memory"] = {
            "value": saved_bytes / weights,
            "saved_bytes": saved_bytes,
            "weights_bytes": weights,
            "rule": f"peak memory saved >= {TARGET_A_WEIGHTS:.0%} of one copy of the weights (full fine-tuning on CUDA; "
            "with LoRA the reference is the base model with the adapter off: no copy to save; on CPU the peak RSS "
            "holds the whole process)",
            "met": None if lora or not cuda else saved_bytes >= TARGET_A_WEIGHTS * weights,
        }
    label_b = COMPARISONS[2][0]
    if label_b in ratios_:
        value = ratios_[label_b]["step_time"]
        out["(b)"] = {
            "value": value,
            "band": band,
            "rule": "|step-time ratio - 1| <= the A/A band (the A/A ratio's largest distance from 1 over the repeats)",
            "met": None if band is None else abs(value - 1) <= band,
        }
    if loss is None:
        return out
    out["(c)"] = {
        "value": loss["ratio"],
        "rule": f"the loss alone, in training mode, <= {TARGET_C:.2f} x GRPO's",
        "met": loss["ratio"] <= TARGET_C and loss["model_training"],
    }
    return out


def conditions(opts, vocab_size: int, one_process_per_run: bool) -> str:
    """What was timed, in words: printed above every table of figures, and saved with them."""
    processes = "one process per run" if one_process_per_run else "the runs of a repeat in one process"
    return (
        f"Timed: optimizer steps on fixed synthetic completions (generation not timed, no vLLM), random weights, "
        f"vocabulary {vocab_size:,}, {'LoRA' if opts.lora else 'full fine-tuning'}, {opts.repeats} repeat(s) in "
        f"rotated order ({processes}), {opts.steps} timed steps each after {opts.warmup}; medians with [min-max] over "
        "the repeats; noise band: the A/A (GRPO vs GRPO) ratio's largest distance from 1."
    )


def _verdict(met) -> str:
    return "not measurable here" if met is None else ("met" if met else "**missed**")


def format_report(report: dict, opts) -> str:
    """The markdown report: conditions, runs, comparisons, targets, where a step's time goes, and the loss alone."""
    summary, env, loss = report["runs"], report["environment"], report["loss_only"]
    lines = [
        f"device: {env['device_name']} ({opts.device}), {env['date_utc'][:10]}, "
        f"model: hidden {opts.hidden_size} x {opts.num_layers} layers, vocabulary {summary['grpo-ref']['vocab_size']:,}, "
        f"{opts.batch_size} completions x {opts.completion_length} tokens per micro-batch, "
        f"steps_per_generation={opts.steps_per_generation}, LoRA={opts.lora}, repeats={opts.repeats}, "
        f"{opts.steps} timed steps each, torch threads: {opts.num_threads or 'default'}",
        "",
        report["conditions"],
        "",
        "| run | step time (s) [min-max] | tokens/s | peak memory (MiB) | weights held (MiB) |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['step_time_s']:.4f} [{s['step_time_min_s']:.4f}-{s['step_time_max_s']:.4f}] | "
            f"{s['tokens_per_s']:.0f} | {_mib(s['peak_memory_bytes'])} | {_mib(s['weights_in_memory_bytes'])} |"
        )
    lines += [
        "",
        "| comparison | step time ratio [min-max] | peak memory ratio | peak memory saved (MiB) |",
        "|---|---|---|---|",
    ]
    for label, r in report["ratios"].items():
        lines.append(
            f"| {label} | {r['step_time']:.3f} [{r['step_time_min']:.3f}-{r['step_time_max']:.3f}] | "
            f"{r['peak_memory']:.3f} | {_mib(r['peak_memory_saved_bytes'])} |"
        )
    band = report["noise_band"]
    lines += ["", f"noise band (A/A): {'none (one repeat or no A/A pair)' if band is None else f'1.00 ± {band:.3f}'}"]
    lines += format_targets(report["targets"])
    lines += ["", breakdown_table(summary), ""]
    if loss is None:
        lines.append("(c) loss alone: not measured in this command (--loss-repeats 0)")
    else:
        lines.append(
            f"(c) loss alone, B={opts.loss_batch}, T={opts.loss_length}, training mode: "
            f"RPG {loss['rpg_loss_s'] * 1e3:.2f} ms (IQR {loss['rpg_loss_iqr_s'] * 1e3:.2f}), GRPO {loss['grpo_loss_s'] * 1e3:.2f} ms (IQR "
            f"{loss['grpo_loss_iqr_s'] * 1e3:.2f}), ratio {loss['ratio']:.3f} (per round "
            f"{loss['ratio_per_round']['min']:.3f}-{loss['ratio_per_round']['max']:.3f}; {loss['rounds']} rounds of "
            f"{loss['calls_per_round']} calls, {loss['timer']})"
        )
    lines.append(f"one model's weights: {_mib(summary['grpo-ref']['model_weight_bytes'])} MiB")
    return "\n".join(lines)


def format_targets(targets_: dict) -> list[str]:
    lines = [""]
    for name, t in targets_.items():
        if name == "(a) time":
            value = (
                f"saved {t['saved_s'] * 1e3:.1f} ms per step of the reference pass's {t['reference_pass_s'] * 1e3:.1f} "
                f"ms ({t['value']:.0%})"
            )
        elif name == "(a) memory":
            value = f"saved {_mib(t['saved_bytes'])} MiB, one copy of the weights {_mib(t['weights_bytes'])} MiB"
        elif name == "(b)":
            value = f"ratio {t['value']:.3f}" + ("" if t["band"] is None else f", band ± {t['band']:.3f}")
        else:
            value = f"ratio {t['value']:.3f}"
        lines.append(f"- target {name}: {value}; rule: {t['rule']}: {_verdict(t['met'])}")
    if any(t["met"] is False for t in targets_.values()):
        lines.append("- where the time goes: the breakdown's Δ columns (ms per step, RPG less GRPO, by phase)")
    return lines


def breakdown_table(runs: dict) -> str:
    """Markdown: milliseconds per step of each phase of [`PHASES`] (rows) for each run (columns), and each
    comparison's difference (the first run less the second, a column each)."""
    names = list(runs)
    deltas = [(label.split(" ")[0], num, den) for label, num, den in COMPARISONS if num in runs and den in runs]
    heads = names + [f"Δ {short} ({num} − {den})" for short, num, den in deltas]
    lines = [
        "| where a step's time goes (ms per step) | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(heads),
    ]

    def row(label, value):
        cells = [f"{value(runs[n]) * 1e3:.1f}" for n in names]
        cells += [f"{(value(runs[num]) - value(runs[den])) * 1e3:+.1f}" for _, num, den in deltas]
        return f"| {label} | " + " | ".join(cells) + " |"

    for phase in PHASES:
        lines.append(row(phase, lambda run, phase=phase: run["breakdown_s"][phase]))
    lines.append(row("step", lambda run: run["step_time_s"]))
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"
