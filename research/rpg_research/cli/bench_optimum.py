# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl bench-optimum`` command: each RPG variant, trained end to end, lands on the optimum of its own objective.

The paper's central claim (Sec. 3, Tables 1 and 4) is that each RPG loss gives the exact gradient of its
KL-regularised objective ``J(π) = E_π[R] − β·D``, while GRPO's k3 penalty without the importance weight does not
(Sec. 2.2). On a task whose optima are known in closed form, this command trains [`RPGTrainer`] for every divergence ×
estimator, on-policy and off-policy, GRPO's uncorrected k3 penalty, and TRL's own GRPOTrainer with its k3 penalty
with and without the importance weight (`use_bias_correction_kl`), and measures how far each learned policy ends from
each optimum (total variation distance). The derivations are in ``research/docs/bench_optimum.md``.

**Task.** One prompt; the completion is a single token ``y`` of a tiny Qwen3 ([`rpg_research.toy.models`]) whose whole vocabulary
has ``K = 8`` tokens, so the policy is the model's next-token distribution ``π(y)`` after the prompt, a softmax over
the ``K`` tokens. The reward is ``R(y) = y / (K − 1)`` for token id ``y``. The reference ``π_ref`` is the initial model,
fitted beforehand to a distribution that decreases with ``y`` (against the reward), and the KL is anchored to it
(``kl_anchor="reference"``) with β = 0.2, far above the paper's 1e-4, so that the KL shapes the optimum.

**Optima** (``research/docs/bench_optimum.md``). With advantage = reward − group mean over groups of ``G`` completions
(``scale_rewards="none"``), the expected gradient of the reward term is that of ``(1 − 1/G)·E_π[R]``: the effective
reward is ``R̃ = (1 − 1/G)·R``. Over the simplex UKL equals KL (the extra terms sum to zero), so the unnormalised
variants share the optimum of their normalised counterparts:

* reverse (``rkl``, ``urkl``): ``π*(y) ∝ π_ref(y)·exp(R̃(y)/β)``;
* forward (``fkl``, ``ufkl``): ``π*(y) = β·π_ref(y) / (λ − R̃(y))``, with ``λ ∈ (max R̃, max R̃ + β]`` such that
  ``Σ_y π*(y) = 1`` (solved by bisection).

GRPO's uncorrected k3 penalty estimates the reverse UKL, but its expected gradient is that of the *forward* KL
(``E_π[∇_θ k3(π_ref/π_θ)] = −Σ_y π_ref(y)·∇_θ log π_θ(y) = ∇_θ KL(π_ref‖π_θ)``), so its stationary point is the
forward optimum.

**Runs.** Every variant trains from the reference with the same budget: ``batch_size`` completions per optimizer step
(groups of ``num_generations``), Adam, a learning rate decaying to 0 (cosine) over ``steps`` optimizer steps. On-policy:
one optimizer step per generation batch (``w = 1``). Off-policy: ``steps_per_generation=2`` and ``num_iterations=2``,
four optimizer steps per generation batch, so ``w ≠ 1`` and the RPG-Style Clip can act.

Outputs in ``--output_dir``: ``table.md``, ``bench_optimum.png``, the reference model (``reference/``) and
``results.json`` (or ``--output_json``): the optima, each run's learned distribution, its distances and their curve.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from .optima import (
    MODEL_KWARGS,
    OPTIMA,
    OPTIMUM_OF_DIVERGENCE,
    REGIMES,
    effective_reward_scale,
    kl_optimum,
    run_benchmark,
    total_variation,
    tracker_class,
    trainer_config,
)


# ----------------------------------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A method of the benchmark: which trainer runs it, its configuration, and the optimum of the objective it is
    meant to maximise."""

    trainer: str  #: "rpg" (RPGTrainer) or "trl" (TRL's GRPOTrainer)
    overrides: dict
    objective: str  #: "reverse" or "forward"
    #: "corrected": the gradient of its own objective (RPG, and TRL's importance-weighted k3); "uncorrected": GRPO's k3.
    family: str = "corrected"


def _variants() -> dict[str, Variant]:
    # The names of `rpg_trl.losses.PAPER_NAMES`, spelled out so that this module imports without torch.
    table = {}
    for estimator, prefix in (("differentiable", "RPG-"), ("reinforce", "RPG-REINFORCE-")):
        for divergence in ("fkl", "ufkl", "rkl", "urkl"):
            overrides = {"divergence": divergence, "estimator": estimator}
            table[prefix + divergence.upper()] = Variant("rpg", overrides, OPTIMUM_OF_DIVERGENCE[divergence])
    # GRPO's k3 penalty without the importance weight (Sec. 2.2): meant to estimate UKL(π_θ‖π_ref), whose optimum is
    # the reverse one. "differentiable" adds β·k3 to the loss as GRPO does; "reinforce" is its stop-gradient form.
    for estimator, name in (("differentiable", "GRPO-k3"), ("reinforce", "GRPO-k3-REINFORCE")):
        overrides = {"divergence": "urkl", "estimator": estimator, "kl_importance_weight": False}
        table[name] = Variant("rpg", overrides, "reverse", "uncorrected")
    # TRL's own GRPOTrainer: its β·k3 term is multiplied by the importance weight by default since TRL 1.16
    # (`use_bias_correction_kl=True`, the gradient of UKL(π_θ‖π_ref) like RPG-URKL); False is GRPO's original penalty.
    table["TRL-GRPO"] = Variant("trl", {"use_bias_correction_kl": True}, "reverse")
    table["TRL-GRPO-uncorrected"] = Variant("trl", {"use_bias_correction_kl": False}, "reverse", "uncorrected")
    return table


#: Variant name -> [`Variant`].
VARIANTS = _variants()
#: The tiny model's vocabulary: `rpg_research.toy.build_char_tokenizer(ALPHABET)` has <pad>, </s>, ':', 'A', 'Q', 'a',
#: 'b', 'c' (8 tokens), and every token is a possible one-token completion.
ALPHABET = "abc"
PROMPT = "A:"
#: Adam steps (lr 1e-2, cross-entropy) fitting the initial model to the target reference distribution.
REFERENCE_FIT_STEPS = 300
#: Prompts in the training dataset (all identical; TRL cycles through it).
DATASET_SIZE = 1024


@dataclass
class BenchOptimumArguments:
    """Arguments of ``rpg-trl bench-optimum``."""

    output_dir: str = field(
        default="runs/bench_optimum",
        metadata={"help": "Where to write table.md, bench_optimum.png, results.json and the reference model."},
    )
    output_json: str | None = field(
        default=None, metadata={"help": "Path of the JSON results. Default: <output_dir>/results.json."}
    )
    variants: list[str] | None = field(
        default=None, metadata={"help": f"Variants to train, a subset of {list(VARIANTS)}. Default: all."}
    )
    regimes: list[str] = field(
        default_factory=lambda: list(REGIMES),
        metadata={"help": f"Training regimes, a subset of {list(REGIMES)}. Default: both."},
    )
    beta: float = field(
        default=0.2, metadata={"help": "KL coefficient β (far above the paper's 1e-4, so that the KL matters)."}
    )
    reference_decay: float = field(
        default=0.4,
        metadata={
            "help": "The reference is fitted to π_ref(y) ∝ exp(−decay·y), against the reward R(y) = y/(K−1), so "
            "that the forward and reverse optima differ clearly (total variation ≈ 0.4 with the defaults)."
        },
    )
    steps: int = field(default=300, metadata={"help": "Optimizer steps per run."})
    learning_rate: float = field(
        default=1e-2, metadata={"help": "Initial learning rate (Adam), decaying to 0 over `steps` (cosine)."}
    )
    batch_size: int = field(
        default=128, metadata={"help": "Completions per optimizer step (per_device_train_batch_size)."}
    )
    num_generations: int = field(
        default=8, metadata={"help": "Group size G of the baseline; the effective reward scale is 1 − 1/G."}
    )
    eval_every: int = field(default=10, metadata={"help": "Record the distances to the optima every N steps."})
    seed: int = field(default=0, metadata={"help": "Seed of the reference model and of every run."})
    num_threads: int = field(default=1, metadata={"help": "Torch CPU threads."})
    completion_length: int = field(
        default=1,
        metadata={
            "help": "1 (default): the one-token task. 2 or 3: completions of up to that many tokens, where "
            "kl_level='token' and kl_level='sequence' differ (rpg_research.cli.bench_optimum_sequence; variants are then "
            "named with their level, e.g. 'RPG-REINFORCE-FKL (sequence)')."
        },
    )

    def __post_init__(self):
        if self.completion_length not in (1, 2, 3):
            raise ValueError(f"`completion_length` must be 1, 2 or 3; got {self.completion_length!r}.")
        known = VARIANTS
        if self.completion_length > 1:
            from .bench_optimum_sequence import SEQUENCE_VARIANTS as known
        if self.variants is None:
            self.variants = list(known)
        for name, given, allowed in (("variants", self.variants, known), ("regimes", self.regimes, REGIMES)):
            unknown = [v for v in given if v not in allowed]
            if unknown or not given:
                raise ValueError(f"`{name}` must be a non-empty subset of {list(allowed)}; got {given!r}.")
        for name in ("steps", "batch_size", "eval_every", "num_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}.")
        effective_reward_scale(self.num_generations)  # raises for G < 2
        if self.batch_size % self.num_generations:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) must be a multiple of `num_generations` ({self.num_generations}): "
                "each optimizer step takes whole groups."
            )
        for name in ("beta", "learning_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"`{name}` must be a positive finite number; got {value!r}.")
        if not (isinstance(self.reference_decay, (int, float)) and math.isfinite(self.reference_decay)):
            raise ValueError(f"`reference_decay` must be a finite number; got {self.reference_decay!r}.")


# ----------------------------------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """The one-token task: the saved reference model, its next-token distribution, the rewards and the optima."""

    model_dir: str
    tokens: list[str]
    ref_probs: list[float]
    rewards: list[float]
    beta: float
    reward_scale: float
    #: "reverse"/"forward" -> the optimum for the effective reward (1 − 1/G)·R, and (key + "_unscaled") for R itself.
    optima: dict[str, list[float]]


def next_token_distribution(model, tokenizer, prompt: str = PROMPT) -> list[float]:
    """The model's next-token distribution after `prompt` (temperature 1), as float64 numbers."""
    import torch

    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0, -1].double()
    return torch.softmax(logits, dim=-1).tolist()


def build_task(directory: str | Path, args: BenchOptimumArguments) -> Task:
    """Build the tiny model, fit it to the target reference distribution, save it in `directory` and compute the
    optima from the saved model's exact next-token distribution."""
    import torch

    from ..toy.models import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer(ALPHABET)
    num_tokens = len(tokenizer)
    model = build_tiny_qwen3(tokenizer, seed=args.seed, **MODEL_KWARGS)
    target = torch.softmax(-args.reference_decay * torch.arange(num_tokens, dtype=torch.float32), dim=0)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        for _ in range(REFERENCE_FIT_STEPS):
            log_probs = torch.log_softmax(model(input_ids=input_ids).logits[0, -1], dim=-1)
            loss = -(target * log_probs).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # The optima use the distribution of the model the trainers load, not the target it was fitted to.
    ref_probs = next_token_distribution(model.eval(), tokenizer)
    rewards = [y / (num_tokens - 1) for y in range(num_tokens)]
    scale = effective_reward_scale(args.num_generations)
    optima = {}
    for kind in OPTIMA:
        optima[kind] = kl_optimum(kind, ref_probs, [scale * r for r in rewards], args.beta)
        optima[kind + "_unscaled"] = kl_optimum(kind, ref_probs, rewards, args.beta)
    return Task(
        model_dir=str(directory),
        tokens=tokenizer.convert_ids_to_tokens(list(range(num_tokens))),
        ref_probs=ref_probs,
        rewards=rewards,
        beta=args.beta,
        reward_scale=scale,
        optima=optima,
    )


def token_reward(rewards: list[float]):
    """A TRL reward function: the reward of the (single) completion token."""

    def token_reward(completions, completion_ids, **kwargs):
        out = []
        for ids in completion_ids:
            if len(ids) != 1:
                raise ValueError(f"bench-optimum expects one-token completions; got {ids!r}.")
            out.append(rewards[ids[0]])
        return out

    return token_reward


# ----------------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------------


def _config(args: BenchOptimumArguments, variant: str, regime: str, output_dir: str):
    # One token per completion: the token mean is the mean over completions.
    return trainer_config(args, VARIANTS[variant], regime, output_dir, loss_type="dapo", max_completion_length=1)


def train_variant(task: Task, args: BenchOptimumArguments, variant: str, regime: str, run_dir: Path, bar) -> dict:
    """Train `variant` in `regime` from the reference with RPGTrainer; return its learned distribution and distances."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    from rpg_trl.trainer import RPGTrainer

    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    tracker = tracker_class()(
        lambda model: next_token_distribution(model, tokenizer),
        {kind: task.optima[kind] for kind in OPTIMA},
        args.eval_every,
        bar,
        f"{variant} {regime}",
    )
    trainer_class = RPGTrainer if VARIANTS[variant].trainer == "rpg" else GRPOTrainer
    trainer = trainer_class(
        model=task.model_dir,
        reward_funcs=token_reward(task.rewards),
        args=_config(args, variant, regime, str(run_dir)),
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * DATASET_SIZE}),
        processing_class=tokenizer,
        callbacks=[tracker],
    )
    trainer.remove_callback(PrinterCallback)  # the progress bar reports; no log lines
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    probs = next_token_distribution(trainer.model.eval(), tokenizer)
    return {
        "variant": variant,
        "regime": regime,
        "objective": VARIANTS[variant].objective,
        "probs": probs,
        "tv": {kind: total_variation(probs, task.optima[kind]) for kind in task.optima},
        "seconds": seconds,
        "curve": tracker.curve,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def format_table(task: Task, runs: list[dict], args: BenchOptimumArguments) -> str:
    """Markdown table: per variant, its distance to each optimum on-policy / off-policy; the optimum of the objective
    the variant is meant to maximise in bold."""
    regimes = [r for r in REGIMES if r in args.regimes]
    lines = [
        f"Total variation distance between the learned next-token distribution and each optimum after {args.steps} "
        f"optimizer steps ({' / '.join(regimes)}; β = {args.beta}, G = {args.num_generations}, {args.batch_size} "
        f"completions per step; off-policy: 4 optimizer steps per generation batch). Bold: the optimum of the "
        f"objective the method is meant to maximise. Between the two optima: "
        f"{total_variation(task.optima['reverse'], task.optima['forward']):.3f}; from the reference to the reverse / "
        f"forward optimum: {total_variation(task.ref_probs, task.optima['reverse']):.3f} / "
        f"{total_variation(task.ref_probs, task.optima['forward']):.3f}.",
        "",
        "| Method | meant to maximise | TV to reverse-KL optimum | TV to forward-KL optimum |",
        "|---|---|---|---|",
    ]
    for variant in args.variants:
        objective = VARIANTS[variant].objective
        cells = [variant, f"{objective}-KL objective"]
        for kind in OPTIMA:
            values = []
            for regime in regimes:
                run = next((r for r in runs if r["variant"] == variant and r["regime"] == regime), None)
                values.append("–" if run is None else f"{run['tv'][kind]:.3f}")
            text = " / ".join(values)
            cells.append(f"**{text}**" if kind == objective else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: Colours of the figure, by divergence (RPG) or family.
_COLORS = {"rkl": "C0", "urkl": "C9", "fkl": "C3", "ufkl": "C1", "trl": "C4", "uncorrected": "C2"}


def _color_key(variant: str) -> str:
    spec = VARIANTS[variant]
    if spec.family == "uncorrected":
        return "uncorrected"
    return "trl" if spec.trainer == "trl" else spec.overrides["divergence"]


def plot_results(task: Task, runs: list[dict], output: str) -> str:
    """Learned vs optimal distributions (one panel per optimum, one for the uncorrected k3) and the distance to the
    optimum of each method's objective along training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    axes = axes.ravel()
    x = list(range(len(task.tokens)))
    labels = [f"{t}\nR={r:.2f}" for t, r in zip(task.tokens, task.rewards)]
    panels = (
        ("reverse", "(a) Reverse-KL objectives: RPG-RKL / URKL,\nTRL GRPO (importance-weighted k3)", "corrected"),
        ("forward", "(b) Forward-KL objectives: RPG-FKL / UFKL", "corrected"),
        ("forward", "(c) GRPO's k3 without importance weight\n(meant for the reverse objective)", "uncorrected"),
    )
    for ax, (kind, title, family) in zip(axes, panels):
        other = "forward" if kind == "reverse" else "reverse"
        ax.bar(x, task.optima[kind], width=0.8, color="0.85", edgecolor="0.5", label=f"{kind}-KL optimum")
        ax.step(x, task.optima[other], where="mid", color="0.25", linestyle="--", lw=1.2, label=f"{other}-KL optimum")
        ax.step(x, task.ref_probs, where="mid", color="0.6", linestyle=":", lw=1.2, label="π_ref")
        chosen = [
            r
            for r in runs
            if VARIANTS[r["variant"]].family == family and (family == "uncorrected" or r["objective"] == kind)
        ]
        for i, run in enumerate(chosen):
            spec = VARIANTS[run["variant"]]
            color = _COLORS[_color_key(run["variant"])]
            offset = (i - (len(chosen) - 1) / 2) * 0.7 / max(len(chosen), 1)
            ax.plot(
                [v + offset for v in x],
                run["probs"],
                linestyle="none",
                marker="s" if spec.trainer == "trl" or spec.overrides.get("estimator") == "differentiable" else "o",
                markersize=4,
                color=color,
                markerfacecolor=color if run["regime"] == "on-policy" else "white",
                label=f"{run['variant']}, {run['regime']}",
            )
        ax.set_title(title, fontsize=9)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("probability")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[3]
    for run in runs:
        ax.plot(
            [p["step"] for p in run["curve"]],
            [p[run["objective"]] for p in run["curve"]],
            color=_COLORS[_color_key(run["variant"])],
            linestyle="-" if run["regime"] == "on-policy" else "--",
            lw=1,
            alpha=0.8,
        )
    ax.set_yscale("log")
    ax.set_title("(d) TV to the optimum of the method's objective\n(solid on-policy, dashed off-policy)", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("total variation distance")
    ax.grid(alpha=0.3)
    names = {"rkl": "RPG-RKL", "urkl": "RPG-URKL", "fkl": "RPG-FKL", "ufkl": "RPG-UFKL", "trl": "TRL GRPO"}
    names["uncorrected"] = "k3 without importance weight"
    handles = [plt.Line2D([], [], color=c, label=names[k]) for k, c in _COLORS.items()]
    ax.legend(handles=handles, fontsize=7)
    fig.text(
        0.5,
        0.005,
        "Markers: circle = REINFORCE estimator, square = differentiable (or TRL's loss); filled = on-policy, "
        "hollow = off-policy (4 optimizer steps per generation batch).",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def run_bench(args: BenchOptimumArguments) -> dict:
    """Build the one-token task, train every (variant, regime) and write ``table.md``, the plot and the JSON results."""
    keys = ("variant", "regime", "objective", "tv", "probs", "seconds")
    return run_benchmark(args, build_task, train_variant, format_table, plot_results, "bench_optimum.png", keys)


def add_parser(subparsers):
    """Register ``rpg-trl bench-optimum`` (see [`rpg_research.cli`])."""
    return subparsers.add_parser(
        "bench-optimum",
        help="Each RPG variant, trained end to end, lands on the closed-form optimum of its own KL objective.",
        description="On a one-token task whose KL-regularised optima are known in closed form, train RPGTrainer for "
        "every divergence x estimator, on-policy and off-policy, and GRPO's uncorrected k3 penalty; print the total "
        "variation distance of each learned distribution to the reverse- and forward-KL optima, and write table.md, "
        "bench_optimum.png and results.json.",
        dataclass_types=[BenchOptimumArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-optimum`` with the parsed command-line `args`."""
    from . import dataclass_arguments, print_report

    bench_args = dataclass_arguments(args, BenchOptimumArguments)
    if bench_args.completion_length > 1:
        from .bench_optimum_sequence import run_sequence_bench

        report = run_sequence_bench(bench_args)
    else:
        report = run_bench(bench_args)
    print_report(
        bench_args.output_dir,
        report["seconds"],
        f"{bench_args.output_dir}/table.md, {Path(report['figure']).name} and {report['output_json']}",
    )
    return 0
