# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""What both optimum benchmarks share: ``rpg-trl bench-optimum`` on one-token completions
([`rpg_research.cli.bench_optimum`]) and on whole completions ([`rpg_research.cli.bench_optimum_sequence`]).

* the closed-form optima of the KL-regularised objective ``E_π[R] − β·D`` over a finite set of completions, for the
  reverse and the forward family (``research/docs/bench_optimum.md``), and the total variation distance;
* the training regimes, the trainer configuration of one run and the callback that records the distance to the
  optima along training;
* the benchmark loop: build the task, train every (variant, regime) under one progress bar, write the table, the
  figure and the JSON results.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from . import machine


# ----------------------------------------------------------------------------------------------------------------------
# Closed-form optima (research/docs/bench_optimum.md)
# ----------------------------------------------------------------------------------------------------------------------

#: Which optimum each divergence's objective has over the simplex (UKL = KL there, research/docs/bench_optimum.md).
OPTIMUM_OF_DIVERGENCE = {"rkl": "reverse", "urkl": "reverse", "fkl": "forward", "ufkl": "forward"}
OPTIMA = ("reverse", "forward")


def effective_reward_scale(num_generations: int) -> float:
    """``1 − 1/G``: with advantage = reward − mean of its group of ``G`` (the group includes the sample itself), the
    expected policy gradient is ``(1 − 1/G)·∇E_π[R]`` (the other ``G − 1`` rewards are independent of the sample and
    ``E_π[∇ log π] = 0``), on-policy and, with importance weights, off-policy."""
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"`num_generations` must be an integer >= 2 (a group baseline); got {num_generations!r}.")
    return 1.0 - 1.0 / num_generations


def _check_distribution(name: str, probs: list[float]) -> list[float]:
    probs = [float(p) for p in probs]
    if not probs or any(not (p > 0.0 and math.isfinite(p)) for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
        raise ValueError(f"`{name}` must be a distribution with positive entries summing to 1; got {probs!r}.")
    return probs


def _check_inputs(ref_probs, rewards, beta) -> tuple[list[float], list[float]]:
    ref_probs = _check_distribution("ref_probs", ref_probs)
    rewards = [float(r) for r in rewards]
    if len(rewards) != len(ref_probs) or not all(math.isfinite(r) for r in rewards):
        raise ValueError(
            f"`rewards` must hold one finite reward per token ({len(ref_probs)}); got {len(rewards)} values."
        )
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (beta > 0 and math.isfinite(beta)):
        raise ValueError(f"`beta` must be a positive finite number; got {beta!r}.")
    return ref_probs, rewards


def reverse_kl_optimum(ref_probs, rewards, beta: float) -> list[float]:
    """Maximiser over the simplex of ``E_π[R] − β·KL(π‖π_ref)`` (and of ``− β·UKL(π‖π_ref)``, equal on the simplex):
    ``π*(y) ∝ π_ref(y)·exp(R(y)/β)`` (the Gibbs distribution; Lagrange condition ``R − β(log(π/π_ref) + 1) = λ``)."""
    ref_probs, rewards = _check_inputs(ref_probs, rewards, beta)
    logits = [math.log(p) + r / beta for p, r in zip(ref_probs, rewards)]
    top = max(logits)
    weights = [math.exp(z - top) for z in logits]
    total = sum(weights)
    return [v / total for v in weights]


def forward_kl_optimum(ref_probs, rewards, beta: float) -> list[float]:
    """Maximiser over the simplex of ``E_π[R] − β·KL(π_ref‖π)`` (and of ``− β·UKL(π_ref‖π)``, equal on the simplex).

    The Lagrange condition ``R(y) + β·π_ref(y)/π(y) = λ`` gives ``π(y) = β·π_ref(y)/(λ − R(y))``; ``λ`` is the unique
    root in ``(max R, max R + β]`` of ``Σ_y β·π_ref(y)/(λ − R(y)) = 1`` (the sum decreases from +∞ and is ≤ 1 at
    ``max R + β``), found by bisection to machine precision.
    """
    ref_probs, rewards = _check_inputs(ref_probs, rewards, beta)
    top = max(rewards)

    def mass(lam: float) -> float:
        return sum(beta * p / (lam - r) for p, r in zip(ref_probs, rewards))

    low, high = top, top + beta  # mass(low+) = +inf, mass(high) <= 1
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid <= low or mid >= high:
            break
        if mass(mid) > 1.0:
            low = mid
        else:
            high = mid
    probs = [beta * p / (high - r) for p, r in zip(ref_probs, rewards)]
    total = sum(probs)  # 1 up to the bisection's last ulp
    return [p / total for p in probs]


def kl_optimum(kind: str, ref_probs, rewards, beta: float) -> list[float]:
    """The ``"reverse"`` or ``"forward"`` optimum ([`reverse_kl_optimum`], [`forward_kl_optimum`])."""
    if kind == "reverse":
        return reverse_kl_optimum(ref_probs, rewards, beta)
    if kind == "forward":
        return forward_kl_optimum(ref_probs, rewards, beta)
    raise ValueError(f"Unknown optimum {kind!r}; choose 'reverse' or 'forward'.")


def total_variation(p, q) -> float:
    """``½·Σ|p − q|``, the total variation distance between two distributions on the same tokens."""
    if len(p) != len(q):
        raise ValueError(f"Distributions over different supports: {len(p)} vs {len(q)} tokens.")
    return 0.5 * sum(abs(float(a) - float(b)) for a, b in zip(p, q))


#: The tiny Qwen3 of both tasks, one layer (about 6k parameters): the policy is its next-token distribution after the
#: prompt (one token), or one such distribution per prefix (whole completions).
MODEL_KWARGS = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 8,
}


# ----------------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------------

#: Training regimes -> RPGConfig overrides. Off-policy: 4 optimizer steps per generation batch (2 micro-batches × 2
#: iterations), so the importance weights differ from 1.
REGIMES = {
    "on-policy": {"steps_per_generation": 1, "num_iterations": 1},
    "off-policy": {"steps_per_generation": 2, "num_iterations": 2},
}


def trainer_config(args, spec, regime: str, output_dir: str, **task_settings):
    """The `RPGConfig` (KL toward the reference) or TRL `GRPOConfig` of one run (`args`: the `BenchOptimumArguments`): the benchmark's shared settings, the
    `regime`, the variant `spec`'s overrides and the task's settings (`loss_type`, `max_completion_length`)."""
    from ..toy.training import no_activation_checkpointing

    common = dict(
        output_dir=output_dir,
        beta=args.beta,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="none",  # advantage = reward − group mean: the reward's scale is (1 − 1/G) exactly
        num_generations=args.num_generations,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        temperature=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_steps=args.steps,
        logging_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        **no_activation_checkpointing(),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **task_settings,
        **REGIMES[regime],
        **spec.overrides,
    )
    if spec.trainer == "trl":
        from trl import GRPOConfig

        return GRPOConfig(**common)
    from rpg_trl.config import RPGConfig

    return RPGConfig(kl_anchor="reference", **common)


def tracker_class():
    """`DistanceTracker(distribution, targets, every, bar, label)`: a `TrainerCallback` that records the total
    variation distance of `distribution(model)` (evaluated in eval mode, without gradients) to each named target
    distribution at step 0 and every `every` steps, in `curve`, and advances the progress bar `bar`."""
    import torch
    from transformers import TrainerCallback

    class DistanceTracker(TrainerCallback):
        def __init__(self, distribution, targets: dict, every: int, bar, label: str):
            self.distribution, self.targets, self.every, self.bar, self.label = (
                distribution,
                targets,
                every,
                bar,
                label,
            )
            self.curve = []

        def probabilities(self, model) -> list[float]:
            was_training = model.training
            with torch.no_grad():
                probs = self.distribution(model.eval())
            model.train(was_training)
            return probs

        def record(self, model, step: int):
            probs = self.probabilities(model)
            point = {"step": step, **{k: total_variation(probs, target) for k, target in self.targets.items()}}
            self.curve.append(point)
            return point

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.record(model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % self.every == 0 or state.global_step == state.max_steps:
                point = self.record(model, state.global_step)
                distances = ", ".join(f"{k} {point[k]:.3f}" for k in self.targets)
                self.bar.set_postfix_str(f"{self.label}: TV {distances}")
            self.bar.update(1)

    return DistanceTracker


def run_benchmark(args, build, train, format_table, plot, figure_name: str, table_keys: tuple) -> dict:
    """The loop of both benchmarks: `build(directory, args)` the task in ``<output_dir>/reference``, `train(task, args,
    variant, regime, run_dir, bar)` every (variant, regime) under one progress bar, then write ``table.md``
    (`format_table(task, runs, args)`), the figure `figure_name` (`plot(task, runs, path)`) and the JSON results
    (the `table_keys` of each run in its ``table``, the task, the runs, the arguments and the machine)."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from ..toy.training import cpu_session

    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # model loading/saving bars would break the benchmark's own
    try:
        with cpu_session(args.num_threads):
            task = build(output_dir / "reference", args)
            pairs = [(v, r) for v in args.variants for r in REGIMES if r in args.regimes]
            runs = []
            with tqdm(total=len(pairs) * args.steps, desc="bench-optimum", unit="step", dynamic_ncols=True) as bar:
                for variant, regime in pairs:
                    run_dir = output_dir / "runs" / variant.replace(" ", "_") / regime
                    runs.append(train(task, args, variant, regime, run_dir, bar))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (output_dir / "table.md").write_text(format_table(task, runs, args))
    figure = plot(task, runs, str(output_dir / figure_name))
    report = {
        "table": [{k: r[k] for k in table_keys} for r in runs],
        "task": asdict(task),
        "runs": runs,
        "seconds": time.perf_counter() - start,
        "arguments": asdict(args),
        "machine": machine(),
        "figure": figure,
    }
    output_json = Path(args.output_json) if args.output_json else output_dir / "results.json"
    output_json.parent.mkdir(parents=True, exist_ok=True)
    output_json.write_text(json.dumps(report, indent=2) + "\n")
    report["output_json"] = str(output_json)
    return report
