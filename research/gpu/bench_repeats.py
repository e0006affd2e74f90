"""What a GPU bench-speed JSON holds repeat by repeat: the figures research/docs/benchmarks.md cites beside its medians.

    python research/gpu/bench_repeats.py research/docs/results/gpu_2026-11-27/call2/bench_speed_full_1024.json

Prints, from the JSON alone (stdlib and rpg_research only, no GPU, no model):

* each run's step time per repeat, the order of the runs in each repeat (the JSON's `orders`; a JSON saved before
  them: the rotation that `bench_speed.plan` used then) and each run's first (untimed) step per repeat: the slow one is
  the first run of its process;
* each comparison's step-time ratio per repeat, the repeats farther from 1 than the A/A band, and the mean ratio with
  its 95 % Student-t interval over the repeats (recomputed from the ratios, so also for a JSON saved before the
  intervals);
* the sampling anchor's step time saved per repeat (GRPO less RPG's anchor run, the same repeat), its median and its
  mean with the interval; beside it GRPO's reference pass per repeat (the breakdown row "scoring: reference log-probs",
  less the anchor's) with its interval, from `per_repeat_breakdown_s` (a JSON without it: the median only);
* the weights' size: `model_weight_bytes` as parameters of the JSON's dtype (float32 when it records none), and the
  same parameters in the other dtype (arithmetic);
  beside it, the parameter count of the Qwen3 that `bench_speed.py` builds from the JSON's hidden size, layers and
  vocabulary (max(hidden / 64, 2) heads splitting the hidden size, max(hidden / 128, 1) key-value heads, MLP
  4 x hidden, tied embeddings) and of the same with Qwen3-0.6B's heads of 128 and MLP of 3072;
* the loss alone (`loss_only`, when present): the paired rounds' ratios RPG / GRPO, the rounds where RPG's loss is
  slower, the sign test's p (one- and two-sided), the mean ratio with its 95 % Student-t interval and the median
  ratio with its distribution-free interval (order statistics).
"""

import json
import math
import statistics
import sys

from rpg_research.cli.protocol import mean_interval


MIB = 2**20


def rotation(scenarios: list[str], repeats: int) -> list[list[str]]:
    """The order of the runs in each repeat of a JSON saved without `orders`: repeat r ran `scenarios` rotated by r
    (bench_speed.plan before its Williams design)."""
    return [scenarios[r % len(scenarios) :] + scenarios[: r % len(scenarios)] for r in range(repeats)]


def qwen3_parameters(hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """Parameters of a Qwen3 causal LM with tied embeddings: attention (q, k, v, o and the q/k norms), MLP (gate, up,
    down), the two norms of each layer, the embeddings and the final norm."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
    return vocab * hidden + layers * (attention + 3 * hidden * mlp + 2 * hidden) + hidden


def sign_test(slower: int, rounds: int) -> tuple[float, float]:
    """One- and two-sided p of `slower` or more of `rounds` paired rounds on one side, under no difference."""
    tail = sum(math.comb(rounds, k) for k in range(slower, rounds + 1)) / 2**rounds
    return tail, min(1.0, 2 * tail)


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The narrowest order-statistic interval [x(k), x(n+1-k)] for the median with coverage >= 95 %, and its
    coverage."""
    values, n = sorted(values), len(values)
    best = (values[0], values[-1], 1 - 2 / 2**n)
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if coverage >= 0.95:
            best = (values[k - 1], values[n - k], coverage)
    return best


def with_interval(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    """The mean of `values` with its 95 % Student-t interval, `mean ± half [low, high]`; the mean alone with one value."""
    mean, half = mean_interval(values)
    if math.isnan(half):
        return f"{mean * scale:.{digits}f} (one value: no interval)"
    low, high = (mean - half) * scale, (mean + half) * scale
    return f"{mean * scale:.{digits}f} ± {half * scale:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def target_a(data: dict) -> None:
    """Target (a)'s two rows per repeat: the step time saved by the anchor and GRPO's reference pass, each with its
    mean and interval."""
    runs = data["runs"]
    grpo, anchor = runs["grpo-ref"]["step_time_per_repeat_s"], runs["rpg-sampling"]["step_time_per_repeat_s"]
    saved = [(g - a) * 1e3 for g, a in zip(grpo, anchor)]
    print(
        f"  (a) step time saved per repeat (ms): {[round(s, 1) for s in saved]}, median {statistics.median(saved):.1f}, "
        f"mean {with_interval(saved, digits=1)}"
    )
    row = "scoring: reference log-probs"
    breakdowns = data.get("per_repeat_breakdown_s", {})
    if "grpo-ref" in breakdowns and "rpg-sampling" in breakdowns:
        pairs = zip(breakdowns["grpo-ref"], breakdowns["rpg-sampling"])
        reference = [(g[row] - a[row]) * 1e3 for g, a in pairs]
        share = (
            f"{statistics.fmean(saved) / statistics.fmean(reference):.0%}" if statistics.fmean(reference) > 0 else "–"
        )
        print(
            f"  (a) GRPO's reference pass per repeat, less the anchor's (ms): {[round(x, 1) for x in reference]}, "
            f"mean {with_interval(reference, digits=1)}; saved / pass, of the means: {share}"
        )
    elif "breakdown_s" in runs["grpo-ref"]:
        median = runs["grpo-ref"]["breakdown_s"][row] * 1e3
        print(f"  (a) GRPO's reference pass: median {median:.1f} ms (per repeat not in this JSON: no interval)")


def main(path: str) -> None:
    data = json.loads(open(path).read())
    runs, ratios = data["runs"], data["ratios"]
    repeats = data["settings"]["repeats"]
    names = list(runs)
    processes = data.get("processes")
    cut = ""
    if processes and processes["finished"] < processes["planned"]:
        cut = f" (cut short: {processes['finished']} of {processes['planned']} processes finished)"
    print(f"{path}: {repeats} repeat(s){cut}")
    orders = data.get("orders") or rotation(names, repeats)
    source = "recorded" if data.get("orders") else "not recorded: the rotation of its time"
    for r, order in enumerate(orders, 1):
        print(f"  repeat {r} runs, in order ({source}): {', '.join(order)}")
    for name, run in runs.items():
        print(f"  {name}: step time per repeat (ms) {[round(s * 1e3, 1) for s in run['step_time_per_repeat_s']]}")
    for name, steps in data.get("per_repeat", {}).items():
        print(f"  {name}: first step per repeat (s) {[round(repeat[0], 2) for repeat in steps]}")
    band = data.get("noise_band")
    print(f"  A/A band: {'none' if band is None else f'± {band:.3f}'}")
    for name, ratio in ratios.items():
        per_repeat = ratio["step_time_per_repeat"]
        outside = [r + 1 for r, x in enumerate(per_repeat) if band is not None and abs(x - 1) > band]
        print(f"  {name}: ratio per repeat {[round(x, 3) for x in per_repeat]}; repeats outside the band: {outside}")
        print(f"    mean ratio {with_interval(per_repeat)} (95 % Student-t over {len(per_repeat)} repeat(s))")
    if "grpo-ref" in runs and "rpg-sampling" in runs:
        target_a(data)
    weights = runs["grpo-ref"]["model_weight_bytes"]
    dtype = data["settings"].get("dtype", "float32")
    size, other = (2, 4) if dtype == "bfloat16" else (4, 2)
    print(
        f"  weights ({dtype}): {weights} bytes = {weights // size:,} parameters x {size} bytes = "
        f"{weights / MIB:.1f} MiB; x {other} bytes = {weights // size * other / MIB:.1f} MiB"
    )
    hidden, layers = data["settings"]["hidden_size"], data["settings"]["num_layers"]
    vocab = data["settings"]["vocab_size"] or runs["grpo-ref"]["vocab_size"]  # None: the character tokenizer's
    heads = max(hidden // 64, 2)
    built = qwen3_parameters(hidden, layers, vocab, heads, max(hidden // 128, 1), hidden // heads, 4 * hidden)
    heads_128 = qwen3_parameters(hidden, layers, vocab, 16, 8, 128, 3072)
    print(
        f"  hidden {hidden} x {layers} layers, vocabulary {vocab}: {built:,} parameters with {heads} heads of "
        f"{hidden // heads} and MLP {4 * hidden} (bench_speed.py's); {heads_128:,} with 16 heads of 128, 8 key-value, MLP 3072 (Qwen3-0.6B's)"
    )
    loss = data.get("loss_only")
    if loss:
        pairs = zip(loss["grpo_loss_rounds_s"], loss["rpg_loss_rounds_s"])
        per_round = [rpg / grpo for grpo, rpg in pairs]
        slower = sum(x > 1 for x in per_round)
        one, two = sign_test(slower, len(per_round))
        mean, half = mean_interval(per_round)
        low, high, coverage = median_interval(per_round)
        print(f"  loss alone: ratio per round {[round(x, 3) for x in per_round]}")
        print(
            f"    RPG slower in {slower} of {len(per_round)} rounds; sign test p {one:.3f} one-sided, {two:.3f} two-sided"
        )
        print(f"    mean ratio {mean:.3f}, 95 % Student-t interval [{mean - half:.3f}, {mean + half:.3f}]")
        print(
            f"    median ratio {statistics.median(per_round):.3f}, interval [{low:.3f}, {high:.3f}] "
            f"(order statistics, coverage {coverage:.3f})"
        )


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        main(argument)
