# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""``rpg-trl bench-optimum --completion_length 2``: the KL between whole completions, ``kl_level`` token vs sequence.

The paper's objective ``J(π) = E_π[R] − β·D(π, π_ref)`` is over whole completions. On one-token completions
(``rpg-trl bench-optimum``) every RPG variant lands on the closed-form optimum of its objective. With several tokens,
``kl_level="token"`` (each token's KL term weighted by its own ratio, as the paper's code and every peer) follows
another vector field, whose fixed point is not that optimum; ``kl_level="sequence"`` follows the exact gradient of the
divergence between whole completions (``docs/design.md``). This module measures both.

**Task.** One prompt; a completion is up to ``L`` tokens of a tiny Qwen3 over the vocabulary of
``rpg_research.toy.build_char_tokenizer("ab")`` (7 tokens: ``<pad>``, ``</s>``, ``:``, ``A``, ``Q``, ``a``, ``b``), ending at
``</s>`` or after ``L`` tokens. The completions form a tree (57 for ``L = 2``), enumerated with their exact
probabilities from the model's own next-token distributions. The reward is non-additive: ``R = 1`` for ``ab``,
``0.5`` for ``bb``, 0 otherwise. The reference (the initial model) is fitted to conditionals that make ``ab`` rare
(``a`` first: 1 in 10 of ``a``/``b``; ``b`` after ``a``: 1 in 10), so the KL, β = 0.2, shapes the optimum.

**What is computed.**

* The optima over completions, in closed form (the one-token formulas over the set of completions:
  ``π*(y) ∝ π_ref(y)·exp(R̃(y)/β)`` for the reverse family, ``β·π_ref(y)/(λ − R̃(y))`` for the forward one; ``R̃ =
  (1 − 1/G)·R``, the group baseline's effective reward).
* The exact fixed point of each variant's expected update: a tabular policy (one softmax per prefix, so every
  distribution over completions is reachable) starts at the reference and follows the exact expected gradient of
  the RPG loss (every completion enumerated, weighted by its probability, on-policy, ``loss_type="luspo"``) with Adam
  until the gradient vanishes. For ``kl_level="sequence"`` this fixed point is the optimum; for ``kl_level="token"``
  it is not, and its distance to the optimum is the bias of per-token KL weighting.
* Training runs: ``RPGTrainer`` (both levels, every divergence × estimator), GRPO's uncorrected k3 and TRL's
  ``GRPOTrainer`` (with and without ``use_bias_correction_kl``), each measured against the optimum of its objective and
  against its own level's exact fixed point.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from .optima import (
    MODEL_KWARGS,
    OPTIMA,
    OPTIMUM_OF_DIVERGENCE,
    effective_reward_scale,
    kl_optimum,
    run_benchmark,
    total_variation,
    tracker_class,
    trainer_config,
)


ALPHABET = "ab"
PROMPT = "A:"
#: Rewards of the completions (their text without ``</s>``); every other completion gets 0.
REWARDS = {"ab": 1.0, "bb": 0.5}
#: The reference's target conditionals: ``</s>``, ``a`` and ``b`` (the other tokens get e^-4 of their weight), with ``a``
#: rare as the first token and ``b`` rare after ``a``.
RARE = 0.1
REFERENCE_FIT_STEPS = 400
DATASET_SIZE = 1024
#: Adam steps of the exact fixed-point iteration, and its learning rate.
FIXED_POINT_STEPS = 1500
FIXED_POINT_LR = 0.1


@dataclass(frozen=True)
class SequenceVariant:
    """A method of the benchmark over whole completions."""

    trainer: str  #: "rpg" (RPGTrainer) or "trl" (GRPOTrainer)
    overrides: dict
    objective: str  #: "reverse" or "forward"
    level: str  #: "token" or "sequence": where the KL's importance weights are taken
    fixed_point: str  #: the key of [`FIXED_POINTS`] whose exact fixed point its expected update has
    family: str = "corrected"  #: "uncorrected" for GRPO's k3 without importance weight


def _sequence_variants() -> dict[str, SequenceVariant]:
    table = {}
    for level in ("token", "sequence"):
        for estimator, prefix in (("reinforce", "RPG-REINFORCE-"), ("differentiable", "RPG-")):
            for divergence in ("fkl", "ufkl", "rkl", "urkl"):
                overrides = {"divergence": divergence, "estimator": estimator, "kl_level": level}
                name = f"{prefix}{divergence.upper()} ({level})"
                objective = OPTIMUM_OF_DIVERGENCE[divergence]
                table[name] = SequenceVariant("rpg", overrides, objective, level, f"{divergence}/{level}")
    overrides = {"divergence": "urkl", "estimator": "differentiable", "kl_importance_weight": False}
    table["GRPO-k3 (token)"] = SequenceVariant("rpg", overrides, "reverse", "token", "k3/token", "uncorrected")
    # TRL's per-token k3 with the importance weight is RPG-URKL at the token level; without it, GRPO's k3.
    trl = {"use_bias_correction_kl": True}
    table["TRL-GRPO (token)"] = SequenceVariant("trl", trl, "reverse", "token", "urkl/token")
    trl = {"use_bias_correction_kl": False}
    table["TRL-GRPO-uncorrected (token)"] = SequenceVariant("trl", trl, "reverse", "token", "k3/token", "uncorrected")
    return table


#: Variant name -> [`SequenceVariant`].
SEQUENCE_VARIANTS = _sequence_variants()
#: Fixed-point key -> the loss fields of its expected update (both estimators have the same one).
FIXED_POINTS = {
    **{
        f"{d}/{level}": {"divergence": d, "kl_level": level}
        for d in OPTIMUM_OF_DIVERGENCE
        for level in ("token", "sequence")
    },
    "k3/token": {"divergence": "urkl", "kl_importance_weight": False},
}


# ----------------------------------------------------------------------------------------------------------------------
# The tree of completions
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Tree:
    """Every completion of at most `length` tokens of a vocabulary of `vocab_size` with end token `eos`, and the prefixes
    at which a next token is chosen."""

    vocab_size: int
    eos: int
    length: int

    def __post_init__(self):
        completions = []

        def grow(prefix):
            for token in range(self.vocab_size):
                y = prefix + (token,)
                if token == self.eos or len(y) == self.length:
                    completions.append(y)
                else:
                    grow(y)

        grow(())
        self.completions = completions
        self.prefixes = sorted({y[:t] for y in completions for t in range(len(y))}, key=lambda p: (len(p), p))
        self.index = {p: i for i, p in enumerate(self.prefixes)}

    def tensors(self):
        """`(rows, tokens, mask)`, (N, L) each: the prefix index and the token of each completion's positions."""
        import torch

        rows = [[self.index[y[:t]] if t < len(y) else 0 for t in range(self.length)] for y in self.completions]
        tokens = [[y[t] if t < len(y) else 0 for t in range(self.length)] for y in self.completions]
        mask = [[1.0] * len(y) + [0.0] * (self.length - len(y)) for y in self.completions]
        return torch.tensor(rows), torch.tensor(tokens), torch.tensor(mask, dtype=torch.float64)

    def token_logps(self, log_conditionals):
        """(N, L) log π(y_t | y_<t) of every completion from the (prefixes, vocab) table of log conditionals."""
        rows, tokens, mask = self.tensors()
        return log_conditionals[rows, tokens] * mask

    def probabilities(self, log_conditionals) -> list[float]:
        """π(y) of every completion."""
        import torch

        return torch.exp(self.token_logps(log_conditionals).sum(-1)).tolist()


def completion_reward(completion: tuple[int, ...], tokens: list[str], eos: int) -> float:
    """``REWARDS`` of the completion's text (without the end token)."""
    return REWARDS.get("".join(tokens[t] for t in completion if t != eos), 0.0)


def target_conditionals(tree: Tree, tokens: list[str]):
    """The reference's target next-token distributions, (prefixes, vocab) float64 (module docstring)."""
    import torch

    a, b = tokens.index("a"), tokens.index("b")
    weights = torch.full((len(tree.prefixes), tree.vocab_size), math.exp(-4.0), dtype=torch.float64)
    for i, prefix in enumerate(tree.prefixes):
        weights[i, [tree.eos, a, b]] = 1.0
        if not prefix:
            weights[i, a] = RARE
        elif prefix[-1] == a:
            weights[i, b] = RARE
    return weights / weights.sum(-1, keepdim=True)


def model_log_conditionals(model, tokenizer, tree: Tree):
    """The model's log next-token distributions at every prefix of the tree after the prompt, (prefixes, vocab)."""
    import torch

    prompt = tokenizer(PROMPT).input_ids
    by_length: dict[int, list[int]] = {}
    for i, prefix in enumerate(tree.prefixes):
        by_length.setdefault(len(prefix), []).append(i)
    out = torch.empty(len(tree.prefixes), tree.vocab_size, dtype=torch.float64)
    for rows in by_length.values():  # equal lengths: no padding
        input_ids = torch.tensor([prompt + list(tree.prefixes[i]) for i in rows], device=model.device)
        logits = model(input_ids=input_ids).logits[:, -1].double()
        out[rows] = torch.log_softmax(logits, -1).to(out.device)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Exact fixed points
# ----------------------------------------------------------------------------------------------------------------------


def exact_fixed_point(
    tree: Tree,
    ref_log_conditionals,
    rewards: list[float],
    *,
    beta: float,
    overrides: dict,
    steps: int = FIXED_POINT_STEPS,
    lr: float = FIXED_POINT_LR,
) -> tuple[list[float], float]:
    """The distribution over completions where the exact expected update of the RPG loss `overrides` vanishes, and the
    norm of that update there.

    A tabular policy (a softmax per prefix) starts at the reference. Each step enumerates every completion with its
    probability under the current policy (on-policy: ``π_old = π_θ``), takes advantage = reward − its mean (the group
    baseline in expectation; `rewards` already carry the ``1 − 1/G`` scale), and applies Adam to the exact gradient of
    ``Σ_y π(y)·Σ_t loss_t(y)`` (``loss_type="luspo"``), with the KL toward the reference.
    """
    import torch

    from rpg_trl.losses import rpg_per_token_loss

    mask = tree.tensors()[2]
    ref_logps = tree.token_logps(ref_log_conditionals)
    reward = torch.tensor(rewards, dtype=torch.float64)
    theta = ref_log_conditionals.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    settings = dict(beta=beta, clip=False, **overrides)
    norm = math.inf
    for _ in range(steps):
        logps = tree.token_logps(torch.log_softmax(theta, -1))
        old = logps.detach()
        probs = torch.exp(old.sum(-1))
        advantages = reward - (probs * reward).sum()
        per_token, _ = rpg_per_token_loss(logps, old, advantages, mask, ref_logps=ref_logps, **settings)
        optimizer.zero_grad()
        (probs * per_token.sum(-1)).sum().backward()
        norm = theta.grad.norm().item()
        optimizer.step()
    return tree.probabilities(torch.log_softmax(theta.detach(), -1)), norm


# ----------------------------------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class SequenceTask:
    """The saved reference model, its distribution over completions, the rewards, the optima and the exact fixed
    points of each KL weighting."""

    model_dir: str
    length: int
    completions: list[str]  #: the completions' text (``</s>`` written as ``$``)
    ref_probs: list[float]
    rewards: list[float]
    beta: float
    reward_scale: float
    optima: dict[str, list[float]]  #: "reverse"/"forward" -> the optimum for the effective reward
    #: "<divergence>/<level>" (and "k3/token") -> the exact fixed point and its residual update norm
    fixed_points: dict[str, dict]


def build_sequence_task(directory: str | Path, args) -> SequenceTask:
    """Fit the tiny model to the reference conditionals, save it in `directory`, and compute the optima and the exact
    fixed points from the saved model's own conditionals."""
    import torch

    from ..toy.models import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer(ALPHABET)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tree = Tree(len(tokenizer), tokenizer.eos_token_id, args.completion_length)
    model = build_tiny_qwen3(tokenizer, seed=args.seed, **MODEL_KWARGS)
    target = target_conditionals(tree, tokens).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        for _ in range(REFERENCE_FIT_STEPS):
            log_conditionals = model_log_conditionals(model, tokenizer, tree).float()
            loss = -(target * log_conditionals).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with torch.no_grad():
        ref_log_conditionals = model_log_conditionals(model.eval(), tokenizer, tree)
    ref_probs = tree.probabilities(ref_log_conditionals)
    rewards = [completion_reward(y, tokens, tree.eos) for y in tree.completions]
    scale = effective_reward_scale(args.num_generations)
    scaled = [scale * r for r in rewards]
    optima = {kind: kl_optimum(kind, ref_probs, scaled, args.beta) for kind in OPTIMA}
    fixed_points = {}
    for key in sorted({SEQUENCE_VARIANTS[v].fixed_point for v in args.variants}):
        probs, norm = exact_fixed_point(
            tree, ref_log_conditionals, scaled, beta=args.beta, overrides=FIXED_POINTS[key]
        )
        fixed_points[key] = {"probs": probs, "residual": norm}
    names = ["".join("$" if t == tree.eos else tokens[t] for t in y) for y in tree.completions]
    return SequenceTask(
        model_dir=str(directory),
        length=args.completion_length,
        completions=names,
        ref_probs=ref_probs,
        rewards=rewards,
        beta=args.beta,
        reward_scale=scale,
        optima=optima,
        fixed_points=fixed_points,
    )


def sequence_reward(task: SequenceTask, tokenizer):
    """A TRL reward function: the reward of the completion (its token ids up to the end token)."""
    eos = tokenizer.eos_token_id
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))

    def sequence_reward(completions, completion_ids, **kwargs):
        out = []
        for ids in completion_ids:
            ids = list(ids)
            if len(ids) > task.length:
                raise ValueError(f"expected completions of at most {task.length} tokens; got {ids!r}.")
            out.append(completion_reward(tuple(ids), tokens, eos))
        return out

    return sequence_reward


# ----------------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------------


def _config(args, variant: str, regime: str, output_dir: str):
    # luspo: Σ over a completion's tokens, mean over completions, the estimator of an objective over completions.
    return trainer_config(
        args,
        SEQUENCE_VARIANTS[variant],
        regime,
        output_dir,
        loss_type="luspo",
        max_completion_length=args.completion_length,
    )


def train_sequence_variant(task: SequenceTask, args, variant: str, regime: str, run_dir: Path, bar) -> dict:
    """Train `variant` from the reference; return its learned distribution over completions and its distances."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    from rpg_trl.trainer import RPGTrainer

    spec = SEQUENCE_VARIANTS[variant]
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    tree = Tree(len(tokenizer), tokenizer.eos_token_id, task.length)
    fixed_point = task.fixed_points[spec.fixed_point]["probs"]
    tracker = tracker_class()(
        lambda model: tree.probabilities(model_log_conditionals(model, tokenizer, tree)),
        {"optimum": task.optima[spec.objective], "fixed_point": fixed_point},
        args.eval_every,
        bar,
        f"{variant} {regime}",
    )
    trainer_class = RPGTrainer if spec.trainer == "rpg" else GRPOTrainer
    trainer = trainer_class(
        model=task.model_dir,
        reward_funcs=sequence_reward(task, tokenizer),
        args=_config(args, variant, regime, str(run_dir)),
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * DATASET_SIZE}),
        processing_class=tokenizer,
        callbacks=[tracker],
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    probs = tracker.probabilities(trainer.model)
    return {
        "variant": variant,
        "regime": regime,
        "objective": spec.objective,
        "level": spec.level,
        "probs": probs,
        "tv_optimum": total_variation(probs, task.optima[spec.objective]),
        "tv_fixed_point": total_variation(probs, fixed_point),
        "seconds": seconds,
        "curve": tracker.curve,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------


def format_sequence_table(task: SequenceTask, runs: list[dict], args) -> str:
    """Markdown table: per method, the exact fixed point's distance to the optimum of its objective, and the trained
    policy's distance to that optimum and to the fixed point."""
    fp_tv = {
        key: total_variation(value["probs"], task.optima[_objective_of_key(key)])
        for key, value in task.fixed_points.items()
    }
    lines = [
        f"Completions of up to {task.length} tokens ({len(task.completions)} in the tree), β = {task.beta}, "
        f"G = {args.num_generations}, {args.batch_size} completions per step, {args.steps} optimizer steps, "
        f'`loss_type="luspo"`. Total variation distance (TV) over completions. From the reference to the reverse / '
        f"forward optimum: {total_variation(task.ref_probs, task.optima['reverse']):.3f} / "
        f"{total_variation(task.ref_probs, task.optima['forward']):.3f}; between the optima: "
        f"{total_variation(task.optima['reverse'], task.optima['forward']):.3f}.",
        "",
        "| Method | KL level | objective | exact fixed point: TV to the optimum | trained: TV to the optimum | "
        "trained: TV to the fixed point |",
        "|---|---|---|---|---|---|",
    ]
    for variant in args.variants:
        spec = SEQUENCE_VARIANTS[variant]
        cells = [variant.rsplit(" (", 1)[0], spec.level, f"{spec.objective}-KL", f"{fp_tv[spec.fixed_point]:.3f}"]
        for field in ("tv_optimum", "tv_fixed_point"):
            values = [f"{r[field]:.3f}" for r in runs if r["variant"] == variant]
            cells.append(" / ".join(values) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _objective_of_key(key: str) -> str:
    divergence = key.split("/")[0]
    return "reverse" if divergence == "k3" else OPTIMUM_OF_DIVERGENCE[divergence]


def plot_sequence_results(task: SequenceTask, runs: list[dict], output: str) -> str:
    """Per objective, the optimum, the token-level fixed point and the trained policies over the likeliest
    completions; and the distance to the optimum along training by level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    shown = sorted(
        range(len(task.completions)),
        key=lambda i: -max(task.optima["reverse"][i], task.optima["forward"][i], task.ref_probs[i]),
    )[:10]
    x = list(range(len(shown)))
    labels = [f"{task.completions[i]}\nR={task.rewards[i]:.1f}" for i in shown]
    colors = {"token": "C3", "sequence": "C0"}
    for ax, kind, divergence in ((axes[0], "reverse", "rkl"), (axes[1], "forward", "fkl")):
        ax.bar(x, [task.optima[kind][i] for i in shown], color="0.85", edgecolor="0.5", label=f"{kind}-KL optimum")
        ax.step(x, [task.ref_probs[i] for i in shown], where="mid", color="0.6", ls=":", label="π_ref")
        token_fp = task.fixed_points.get(f"{divergence}/token")
        if token_fp is not None:
            ax.plot(
                x, [token_fp["probs"][i] for i in shown], "k_", ms=14, mew=2, label="exact fixed point, token level"
            )
        for run in runs:
            if run["objective"] != kind or SEQUENCE_VARIANTS[run["variant"]].trainer != "rpg":
                continue
            if SEQUENCE_VARIANTS[run["variant"]].family != "corrected":
                continue
            ax.plot(
                x,
                [run["probs"][i] for i in shown],
                ls="none",
                marker="o",
                ms=3,
                color=colors[run["level"]],
                alpha=0.6,
            )
        ax.plot([], [], "o", color=colors["sequence"], label="trained, kl_level='sequence'")
        ax.plot([], [], "o", color=colors["token"], label="trained, kl_level='token'")
        ax.set_title(f"({'a' if kind == 'reverse' else 'b'}) {kind}-KL objectives (all RPG variants)", fontsize=9)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("probability of the completion ($ = </s>)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    for run in runs:
        spec = SEQUENCE_VARIANTS[run["variant"]]
        color = colors[run["level"]] if spec.family == "corrected" else "C2"
        ax.plot([p["step"] for p in run["curve"]], [p["optimum"] for p in run["curve"]], color=color, lw=1, alpha=0.7)
    ax.plot([], [], color=colors["sequence"], label="kl_level='sequence'")
    ax.plot([], [], color=colors["token"], label="kl_level='token' (RPG, TRL GRPO)")
    ax.plot([], [], color="C2", label="k3 without importance weight")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("TV to the optimum of the method's objective")
    ax.set_title("(c) Distance to the optimum along training", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def run_sequence_bench(args) -> dict:
    """Build the task, train every (variant, regime) and write ``table.md``, the figure and the JSON results."""
    keys = ("variant", "regime", "level", "objective", "tv_optimum", "tv_fixed_point", "seconds")
    return run_benchmark(
        args,
        build_sequence_task,
        train_sequence_variant,
        format_sequence_table,
        plot_sequence_results,
        "bench_optimum_sequence.png",
        keys,
    )
