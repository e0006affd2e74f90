# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The report of `rpg-trl bench-speed` ([`rpg_research.cli.bench_speed`]): the runs over their repeats, the paired
ratios and the A/A noise band, the targets (a), (b), (c), what was timed in words, and the markdown tables (the
breakdown of a step's time included); pure functions of the workers' results.

Every comparison pairs the two runs of one repeat (they ran one after the other, in the same process on CUDA), so a
drift of the machine between repeats cancels in the per-repeat ratio. The ratios are summarised twice: their median
with the range, and their mean with a two-sided 95 % Student-t interval over the repeats
([`rpg_research.cli.protocol.mean_interval`]; none with a single repeat). The A/A pair's interval is computed the same
way and shows how wide an interval the noise alone gives at this number of repeats."""

from __future__ import annotations

import math
import statistics

from .protocol import mean_interval


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
    ("(d) RPG exact per-position KL vs sampled KL", "rpg-vocabulary", "rpg-sampling"),
    ("(d') RPG exact per-position KL vs GRPO beta>0", "rpg-vocabulary", "grpo-ref"),
]
#: The targets: (a) the share of the reference pass the anchor saves, and of one copy of the weights (full fine-tuning);
#: (c) the loss alone against GRPO's (the mean of the paired rounds' ratios; 1.05 of the medians until 2026-11-27).
TARGET_A_SHARE, TARGET_A_WEIGHTS, TARGET_C = 0.90, 0.95, 1.00
#: (d): the exact per-position KL against the sampled estimate, the step time's mean ratio and the peak memory's.
TARGET_D_TIME, TARGET_D_MEMORY = 1.15, 1.10


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
        "parameter_dtypes": results[0].get("parameter_dtypes"),
    }


def interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of `values` and the half-width of its 95 % Student-t interval; None for the half-width of a single
    value (not measurable; None rather than NaN, which JSON lacks)."""
    mean, half = mean_interval(values)
    return mean, None if math.isnan(half) else half


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Each comparison of [`COMPARISONS`] whose runs were measured: the step-time ratio of each repeat (the two runs of
    one repeat, paired: the lists of `runs` are in repeat order), its median and range, its largest distance from 1
    (`band`), its mean with the half-width of the 95 % Student-t interval (None with one repeat), and the peak
    memory's."""
    out = {}
    for label, num, den in COMPARISONS:
        if not runs.get(num) or not runs.get(den):
            continue
        per_repeat = [n["step_time_s"] / d["step_time_s"] for n, d in zip(runs[num], runs[den])]
        memory = [n["peak_memory_bytes"] / d["peak_memory_bytes"] for n, d in zip(runs[num], runs[den])]
        saved = [d["peak_memory_bytes"] - n["peak_memory_bytes"] for n, d in zip(runs[num], runs[den])]
        mean, half = interval(per_repeat)
        out[label] = {
            "step_time": statistics.median(per_repeat),
            "step_time_min": min(per_repeat),
            "step_time_max": max(per_repeat),
            "step_time_per_repeat": per_repeat,
            "band": max(abs(r - 1) for r in per_repeat),
            "step_time_mean": mean,
            "step_time_half_width": half,
            "repeats": len(per_repeat),
            "peak_memory": statistics.median(memory),
            "peak_memory_saved_bytes": statistics.median(saved),
        }
    return out


def targets(
    summary: dict, runs: dict, ratios_: dict, band: float | None, loss: dict | None, lora: bool, cuda: bool = True
) -> dict:
    """The targets (a), (b), (c), each with its measured value, its rule and whether it is met (None: not measurable
    in this run: a single repeat for (b), LoRA or the CPU for the memory of (a)).

    (a) time: two rows paired by repeat, each a mean with its 95 % interval: the step time saved (GRPO's run less the
    anchor's) and the reference pass it avoids (GRPO's "scoring: reference log-probs" less the anchor's, which has
    none); met when the saved mean is >= [`TARGET_A_SHARE`] of the reference pass's mean (both intervals reported).
    (b): the mean per-repeat ratio's 95 % interval against 1: "slower" above, "faster" below, else no difference
    detected at ± its half-width; met when the interval holds 1. That is a failure to detect a difference, not a proof
    of equality: the A/A pair's half-width, reported beside it, says how large a difference these repeats could have
    detected."""
    out = {}
    if runs.get("grpo-ref") and runs.get("rpg-sampling"):
        pairs = list(zip(runs["grpo-ref"], runs["rpg-sampling"]))
        reference_row = PHASES[1]
        saved = [g["step_time_s"] - s["step_time_s"] for g, s in pairs]
        reference = [g["breakdown_s"][reference_row] - s["breakdown_s"][reference_row] for g, s in pairs]
        saved_mean, saved_half = interval(saved)
        reference_mean, reference_half = interval(reference)
        share = saved_mean / reference_mean if reference_mean > 0 else float("nan")
        out["(a) time"] = {
            "value": share,
            "saved_s": saved_mean,
            "saved_half_width_s": saved_half,
            "saved_median_s": statistics.median(saved),
            "saved_per_repeat_s": saved,
            "reference_pass_s": reference_mean,
            "reference_pass_half_width_s": reference_half,
            "reference_pass_per_repeat_s": reference,
            "repeats": len(pairs),
            "rule": f"the mean step time saved >= {TARGET_A_SHARE:.0%} of the mean of GRPO's reference pass (per "
            "repeat, less the anchor's)",
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
        ratio = ratios_[label_b]
        mean, half = ratio["step_time_mean"], ratio["step_time_half_width"]
        aa = ratios_.get(COMPARISONS[0][0])
        if half is None:
            verdict, met = "not measurable (one repeat)", None
        elif mean - half > 1:
            verdict, met = "slower", False
        elif mean + half < 1:
            verdict, met = "faster", False
        else:
            verdict, met = f"no difference detected at ± {half:.3f}", True
        out["(b)"] = {
            "value": mean,
            "half_width": half,
            "interval": None if half is None else [mean - half, mean + half],
            "median": ratio["step_time"],
            "repeats": ratio["repeats"],
            "aa_half_width": None if aa is None else aa["step_time_half_width"],
            "band": band,
            "verdict": verdict,
            "rule": "the mean per-repeat step-time ratio's 95 % Student-t interval holds 1 (no difference detected; "
            "compare its half-width with the A/A pair's, the noise's)",
            "met": met,
        }
    label_d = COMPARISONS[3][0]
    if label_d in ratios_:
        ratio = ratios_[label_d]
        mean, half = ratio["step_time_mean"], ratio["step_time_half_width"]
        memory = ratio["peak_memory"]
        upper = mean if half is None else mean + half
        out["(d)"] = {
            "value": mean,
            "half_width": half,
            "interval": None if half is None else [mean - half, mean + half],
            "median": ratio["step_time"],
            "repeats": ratio["repeats"],
            "peak_memory": memory,
            "rule": f"kl_estimate='vocabulary' against 'sample': the mean per-repeat step-time ratio (its 95 % interval's "
            f"upper end with several repeats) <= {TARGET_D_TIME:.2f} and the peak memory's median ratio <= "
            f"{TARGET_D_MEMORY:.2f}",
            "met": upper <= TARGET_D_TIME and memory <= TARGET_D_MEMORY,
        }
    if loss is None:
        return out
    # The mean of the paired rounds' ratios, with its interval (reports before 2026-11-27: the ratio of the medians).
    value = loss.get("ratio_mean", loss["ratio"])
    half = loss.get("ratio_half_width")
    out["(c)"] = {
        "value": value,
        "half_width": half,
        "interval": None if half is None or half != half else [value - half, value + half],
        "rule": f"the loss alone, in training mode: the mean of the paired rounds' ratios RPG / GRPO <= {TARGET_C:.2f}",
        "met": value <= TARGET_C and loss["model_training"],
    }
    return out


def conditions(opts, vocab_size: int, one_process_per_run: bool, order: str = "in rotated order") -> str:
    """What was timed, in words: printed above every table of figures, and saved with them. `order`: how the runs were
    ordered within the repeats ([`rpg_research.cli.bench_speed.run_orders`])."""
    processes = "one process per run" if one_process_per_run else "the runs of a repeat in one process"
    return (
        f"Timed: optimizer steps on fixed synthetic completions (generation not timed, no vLLM), random weights "
        f"loaded in {getattr(opts, 'dtype', 'float32')}, vocabulary {vocab_size:,}, "
        f"{'LoRA' if opts.lora else 'full fine-tuning'}, {opts.repeats} repeat(s) {order} ({processes}), "
        f"{opts.steps} timed steps each after {opts.warmup}; medians with [min-max] over the repeats; ratios paired "
        "by repeat, also as their mean ± the half-width of a 95 % Student-t interval; noise band: the A/A (GRPO vs "
        "GRPO) ratio's largest distance from 1."
    )


def _verdict(met) -> str:
    return "not measurable here" if met is None else ("met" if met else "**missed**")


def _pm(mean: float, half: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """`mean ± half` scaled, with the interval's ends; `mean` and "interval not measurable" when `half` is None."""
    if half is None:
        return f"{mean * scale:.{digits}f} (interval not measurable: one repeat)"
    low, high = (mean - half) * scale, (mean + half) * scale
    return f"{mean * scale:.{digits}f} ± {half * scale:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def format_report(report: dict, opts) -> str:
    """The markdown report: conditions, runs, comparisons, targets, where a step's time goes, and the loss alone."""
    summary, env, loss = report["runs"], report["environment"], report["loss_only"]
    lines = [
        f"device: {env['device_name']} ({opts.device}), {env['date_utc'][:10]}, "
        f"model: hidden {opts.hidden_size} x {opts.num_layers} layers, vocabulary {summary['grpo-ref']['vocab_size']:,}, "
        f"{opts.batch_size} completions x {opts.completion_length} tokens per micro-batch, "
        f"steps_per_generation={opts.steps_per_generation}, weights {getattr(opts, 'dtype', 'float32')}, "
        f"LoRA={opts.lora}, repeats={opts.repeats}, "
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
        "| comparison | step time ratio [min-max] | mean ratio ± 95 % interval | peak memory ratio | "
        "peak memory saved (MiB) |",
        "|---|---|---|---|---|",
    ]
    for label, r in report["ratios"].items():
        lines.append(
            f"| {label} | {r['step_time']:.3f} [{r['step_time_min']:.3f}-{r['step_time_max']:.3f}] | "
            f"{_pm(r['step_time_mean'], r['step_time_half_width'])} | {r['peak_memory']:.3f} | "
            f"{_mib(r['peak_memory_saved_bytes'])} |"
        )
    band = report["noise_band"]
    lines += ["", f"noise band (A/A): {'none (one repeat or no A/A pair)' if band is None else f'1.00 ± {band:.3f}'}"]
    aa = report["ratios"].get(COMPARISONS[0][0])
    if aa is not None:
        lines[-1] += f"; A/A mean ratio {_pm(aa['step_time_mean'], aa['step_time_half_width'])} over {aa['repeats']}"
        lines[-1] += " repeat(s)"
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
        lines += loss_details(loss)
    lines.append(f"one model's weights: {_mib(summary['grpo-ref']['model_weight_bytes'])} MiB")
    return "\n".join(lines)


def loss_details(loss: dict) -> list[str]:
    """(c)'s paired comparison and what each loss dispatches (reports since 2026-11-27; none before)."""
    lines = []
    if "ratio_mean" in loss:
        half = loss["ratio_half_width"]
        interval = (
            ""
            if half != half
            else f", 95 % interval [{loss['ratio_mean'] - half:.3f}, {loss['ratio_mean'] + half:.3f}]"
        )
        lines.append(
            f"(c) paired rounds: mean ratio {loss['ratio_mean']:.3f}{interval}; RPG's loss the slower in "
            f"{loss['rpg_slower_rounds']} of {loss['rounds']} rounds"
        )
    if "rpg_dispatch" in loss:
        for name in ("rpg", "grpo"):
            d = loss[f"{name}_dispatch"]
            lines.append(
                f"(c) {name.upper()}'s loss, forward and backward, once: {d['operators']} ATen operators, "
                f"{d['kernels']} of them kernels, {d['waits']} waits for the device, {d['copies_to_host']} copies to "
                "the host"
            )
    return lines


def format_targets(targets_: dict) -> list[str]:
    """The targets' lines of the report: the value, the rule and the verdict of each; a target saved before the
    intervals (no `repeats` field) in its former words."""
    lines = [""]
    for name, t in targets_.items():
        if name == "(a) time" and "repeats" in t:
            value = (
                f"step time saved {_pm(t['saved_s'], t['saved_half_width_s'], 1e3, 1)} ms, GRPO's reference pass "
                f"{_pm(t['reference_pass_s'], t['reference_pass_half_width_s'], 1e3, 1)} ms (means per step over "
                f"{t['repeats']} repeat(s), 95 % Student-t; saved {t['value']:.0%} of the pass)"
            )
        elif name == "(a) time":
            value = (
                f"saved {t['saved_s'] * 1e3:.1f} ms per step of the reference pass's {t['reference_pass_s'] * 1e3:.1f} "
                f"ms ({t['value']:.0%})"
            )
        elif name == "(a) memory":
            value = f"saved {_mib(t['saved_bytes'])} MiB, one copy of the weights {_mib(t['weights_bytes'])} MiB"
        elif name == "(b)" and "verdict" in t:
            aa = t["aa_half_width"]
            value = (
                f"mean ratio {_pm(t['value'], t['half_width'])} over {t['repeats']} repeat(s) (median "
                f"{t['median']:.3f}; A/A interval ± {'–' if aa is None else f'{aa:.3f}'}): {t['verdict']}"
            )
        elif name == "(b)":
            value = f"ratio {t['value']:.3f}" + ("" if t["band"] is None else f", band ± {t['band']:.3f}")
        elif name == "(d)":
            value = (
                f"mean step-time ratio {_pm(t['value'], t['half_width'])} over {t['repeats']} repeat(s) (median "
                f"{t['median']:.3f}), peak memory ratio {t['peak_memory']:.3f}"
            )
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
