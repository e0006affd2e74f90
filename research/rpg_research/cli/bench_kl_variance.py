# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""``rpg-trl bench-kl-variance``: the noise of the KL gradient at length, for each ``kl_to_go``, ``kl_estimate`` and
baseline of the KL-to-go.

With ``kl_level="sequence"`` each token's KL weight holds its KL-to-go, a sum over the tokens after it
(``rpg_trl.losses``, docs/design.md, "The KL-to-go at length"). Sampled as it is (``kl_to_go="log_ratio"``), that sum
adds one noisy ``log ρ`` per later token; ``kl_to_go="k3"`` replaces each later ``log ρ`` by its ``k3``, which has the
same expectation given the tokens before it. This command measures, at several completion lengths, how far each
estimate's mean is from the exact gradient and how much it varies, on a policy whose every gradient is known exactly.

**The policies.** A Markov chain over ``vocab_size`` tokens: the next token's logits are a table indexed by the
previous token (one row for the first token), so a completion of ``T`` tokens has an exact distribution, and the
divergence between whole completions, ``KL(π_θ‖π_ref) = Σ_t E_θ[KL(π_θ(·|y_{t−1}) ‖ π_ref(·|y_{t−1}))]``, is computed
exactly by propagating the marginals of ``y_{t−1}`` (``exact_kl``); autograd gives its exact gradient with respect to
the table. π_ref's logits are Gaussian (scale ``reference_scale``: uncertain tokens, as in the tasks where the KL
acts); π_old and π_θ add Gaussian perturbations of scales ``old_shift`` and ``theta_shift``, the distance one
generation batch and a few optimizer steps put between them. Two anchors: ``"sampling"`` (π_ref = π_old, the paper's
runs) and ``"reference"`` (a separate reference model).

**The estimates.** ``num_completions`` completions of exactly ``T`` tokens are sampled from π_old; each one's KL
gradient is ``Σ_t K_t·∇log π_θ(y_t|y_{t−1})`` with ``K_t`` from ``rpg_trl.losses.rpg_per_token_loss`` (A = 0, β = 1,
``clip=False``: the exact weights, no truncation), for each entry of [`ESTIMATES`]: both KL levels, each ``kl_to_go``,
each position's KL sampled or exact over the vocabulary (``kl_estimate="vocabulary"``, which adds the direct gradient
of each position's KL), and the KL-to-go with or without its leave-one-out baseline over groups of ``group_size``
consecutive completions (one prompt's group). Reported per
(anchor, divergence, length, ``kl_to_go``): the relative bias ``‖ḡ − ∇D‖/‖∇D‖`` with its standard error (the
estimate is unbiased when the bias is within a few standard errors), the variance per completion relative to the
signal, ``E‖g − ḡ‖²/‖∇D‖²`` (the number of completions a batch needs before its gradient's error is as large as the
gradient), and the mean cosine between the gradients of the two halves of a batch of ``batch_size`` completions (a
step of the fourth protocol of research/docs/bench_algos.md has 64).

Outputs in ``--output_dir``: ``table.md``, ``results.json`` (arguments, machine, rows) and ``kl_variance.png``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


ANCHORS = ("sampling", "reference")
#: The estimates compared, ``(kl_level, kl_to_go, kl_clip_mode)``: the sequence level with each ``kl_to_go``, exact
#: (the clip off) and truncated (the default ``kl_clip_mode``: each token's KL-to-go scaled by ``min(1, c/M_t)``, biased
#: where a prefix ratio passes c = 10, bounded), and the token level, exact and truncated (RPG's default). The token
#: level's expectation is not the gradient of the divergence between whole completions: its bias is the price of its
#: lower variance.
#: Each estimate also names how each position's KL is estimated (``kl_estimate``: ``"sample"``, the sampled token's
#: log-ratio; ``"vocabulary"``, exactly over the vocabulary) and the KL-to-go's baseline (``kl_to_go_baseline``:
#: ``"none"`` or ``"leave_one_out"``, the mean over the other completions of a group of ``group_size`` at each
#: position): ``(kl_level, kl_to_go, kl_clip_mode, kl_estimate, kl_to_go_baseline)``.
ESTIMATES = (
    ("sequence", "log_ratio", "exact", "sample", "none"),
    ("sequence", "k3", "exact", "sample", "none"),
    ("sequence", "log_ratio", "truncated", "sample", "none"),
    ("sequence", "k3", "truncated", "sample", "none"),
    ("token", "log_ratio", "exact", "sample", "none"),
    ("token", "log_ratio", "truncated", "sample", "none"),
    ("token", "log_ratio", "exact", "vocabulary", "none"),
    ("sequence", "log_ratio", "exact", "vocabulary", "none"),
    ("sequence", "k3", "exact", "sample", "leave_one_out"),
    ("sequence", "log_ratio", "exact", "vocabulary", "leave_one_out"),
)


@dataclass
class KLVarianceArguments:
    """Arguments of ``rpg-trl bench-kl-variance``."""

    lengths: list[int] = field(default_factory=lambda: [64, 256, 1024], metadata={"help": "Completion lengths T."})
    divergences: list[str] = field(
        default_factory=lambda: ["urkl", "rkl"], metadata={"help": "Divergences with a KL-to-go: 'urkl', 'rkl'."}
    )
    anchors: list[str] = field(
        default_factory=lambda: list(ANCHORS),
        metadata={"help": "'sampling' (π_ref = π_old) and/or 'reference' (a separate reference)."},
    )
    vocab_size: int = field(default=16, metadata={"help": "Tokens of the Markov chain."})
    reference_scale: float = field(default=1.0, metadata={"help": "Scale of π_ref's Gaussian logits."})
    old_shift: float = field(default=0.1, metadata={"help": "Scale of π_old − π_ref (logits), 'reference' anchor."})
    theta_shift: float = field(default=0.1, metadata={"help": "Scale of π_θ − π_old (logits)."})
    num_completions: int = field(default=4096, metadata={"help": "Completions sampled from π_old per length."})
    batch_size: int = field(default=64, metadata={"help": "Completions per batch for the half-batch cosine."})
    group_size: int = field(
        default=16,
        metadata={
            "help": "Completions per prompt for the leave-one-out baseline of the KL-to-go (the paper's runs: 16); "
            "must divide num_completions (and batch_size / 2, for the halves of a batch to hold whole groups)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the policies and of the samples."})
    num_threads: int = field(default=1, metadata={"help": "torch threads."})
    output_dir: str = field(default="runs/kl_variance", metadata={"help": "Where the table, results and figure go."})

    def __post_init__(self):
        from rpg_trl.losses import KL_TERMS

        from . import check_arguments

        check_arguments(self, at_least_one=("vocab_size", "num_threads"), positive=("reference_scale",))
        if self.vocab_size < 2:
            raise ValueError(f"`vocab_size` must be >= 2; got {self.vocab_size!r}.")
        for name in ("old_shift", "theta_shift"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be a finite number >= 0; got {value!r}.")
        if not self.lengths or not all(isinstance(t, int) and t >= 2 for t in self.lengths):
            raise ValueError(f"`lengths` must be one or more integers >= 2; got {self.lengths!r}.")
        with_to_go = [d for d, term in KL_TERMS.items() if "to_go" in term.sequence_parts]
        if not self.divergences or any(d not in with_to_go for d in self.divergences):
            raise ValueError(f"`divergences` must be one or more of {with_to_go}; got {self.divergences!r}.")
        if not self.anchors or any(a not in ANCHORS for a in self.anchors):
            raise ValueError(f"`anchors` must be one or more of {list(ANCHORS)}; got {self.anchors!r}.")
        if self.batch_size < 2 or self.batch_size % 2:
            raise ValueError(f"`batch_size` must be an even integer >= 2; got {self.batch_size!r}.")
        if self.num_completions < 2 * self.batch_size:
            raise ValueError(
                f"`num_completions` must be at least 2 × batch_size = {2 * self.batch_size} (two batches for the "
                f"half-batch cosine); got {self.num_completions!r}."
            )
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.num_completions % self.group_size:
            raise ValueError(
                f"`group_size` must be an integer >= 2 that divides num_completions = {self.num_completions}; got "
                f"{self.group_size!r}."
            )


def markov_policies(args: KLVarianceArguments, anchor: str, generator):
    """``(θ, old, ref)`` logits tables, float64, of shape ``(V + 1, V)``: row ``V`` is the first token's."""
    import torch

    shape = (args.vocab_size + 1, args.vocab_size)
    ref = args.reference_scale * torch.randn(shape, generator=generator, dtype=torch.float64)
    old = (
        ref
        if anchor == "sampling"
        else ref + args.old_shift * torch.randn(shape, generator=generator, dtype=ref.dtype)
    )
    theta = old + args.theta_shift * torch.randn(shape, generator=generator, dtype=ref.dtype)
    return theta, old, ref


def sample_completions(logits, num: int, length: int, generator):
    """``num`` completions of ``length`` tokens from the Markov chain of `logits`, (num, length) int64."""
    import torch

    probs = torch.softmax(logits, -1)
    first = logits.shape[0] - 1
    ys = torch.empty(num, length, dtype=torch.long)
    previous = torch.full((num,), first, dtype=torch.long)
    for t in range(length):
        previous = torch.multinomial(probs[previous], 1, generator=generator).squeeze(-1)
        ys[:, t] = previous
    return ys


def token_logps(logits, ys):
    """``log π(y_t | y_{t−1})`` (N, T) under the chain of `logits`."""
    import torch

    previous = torch.cat([torch.full_like(ys[:, :1], logits.shape[0] - 1), ys[:, :-1]], -1)
    return torch.log_softmax(logits, -1)[previous, ys]


def exact_kl(theta, ref, length: int):
    """``KL(π_θ‖π_ref)`` between whole completions of `length` tokens (differentiable in `theta`): the per-token KL of
    each previous token, weighted by its marginal under π_θ, summed over the positions."""
    import torch

    log_p, log_q = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    per_state = (log_p.exp() * (log_p - log_q)).sum(-1)  # (V + 1,)
    marginal = torch.zeros(theta.shape[0], dtype=theta.dtype)
    marginal[-1] = 1.0
    transition = log_p.exp()  # (V + 1, V): from a previous token to the next
    total = theta.new_zeros(())
    for _ in range(length):
        total = total + (marginal * per_state).sum()
        marginal = torch.cat([marginal @ transition, marginal.new_zeros(1)])
    return total


def per_completion_gradients(
    theta,
    old,
    ref,
    ys,
    divergence: str,
    kl_to_go: str,
    anchor: str,
    kl_level: str = "sequence",
    kl_clip_mode: str = "exact",
    chunk: int = 256,
    kl_estimate: str = "sample",
    kl_to_go_baseline: str = "none",
    group_size: int | None = None,
):
    """(N, (V + 1)·V): each completion's KL gradient ``Σ_t K_t·∇_θ log π_θ(y_t|y_{t−1})``, ``K_t`` from the loss
    (``kl_clip_mode="exact"``: the clip off; another mode: the clip on, which with A = 0 leaves only that mode's KL
    weight). With ``kl_estimate="vocabulary"`` each position's exact KL (the softmax row of ``y_{t−1}`` against the
    anchor's) enters the loss as `position_kl`, and its direct term ``c_t·∇_θ KL_t`` (``c_t``: the loss's gradient with
    respect to it) is added in row ``y_{t−1}``. `kl_to_go_baseline`: the loss's, over groups of `group_size`
    consecutive completions."""
    import torch

    from rpg_trl.losses import KL_TERMS, rpg_per_token_loss

    probs = torch.softmax(theta, -1)
    rows, vocab = theta.shape
    old_lp = token_logps(old, ys)
    ref_lp = None if anchor == "sampling" else token_logps(ref, ys)
    logps = token_logps(theta, ys).detach().requires_grad_(True)
    previous = torch.cat([torch.full_like(ys[:, :1], rows - 1), ys[:, :-1]], -1)
    inputs = [logps]
    position = None
    if kl_estimate == "vocabulary":
        log_p = torch.log_softmax(theta, -1)
        log_q = torch.log_softmax(old if anchor == "sampling" else ref, -1)
        if KL_TERMS[divergence].direction == "reverse":
            state_kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            state_grad = log_p.exp() * (log_p - log_q - state_kl[:, None])  # ∂KL(p‖q)/∂logits of the row
        else:
            state_kl = (log_q.exp() * (log_q - log_p)).sum(-1)
            state_grad = log_p.exp() - log_q.exp()
        position = state_kl[previous].detach().requires_grad_(True)
        inputs.append(position)
    groups = None if group_size is None else torch.arange(ys.shape[0]) // group_size
    per_token, _ = rpg_per_token_loss(
        logps, old_lp, torch.zeros(ys.shape[0], dtype=theta.dtype), torch.ones_like(old_lp), ref_logps=ref_lp,
        divergence=divergence, beta=1.0, clip=kl_clip_mode != "exact", kl_level=kl_level, kl_to_go=kl_to_go,
        kl_clip_mode=kl_clip_mode, kl_estimate=kl_estimate, kl_to_go_baseline=kl_to_go_baseline,
        position_kl=position, groups=groups,
    )  # fmt: skip
    # K_t (the reinforce loss's gradient is β·K), and with the vocabulary estimate c_t
    weights, *direct = torch.autograd.grad(per_token.sum(), inputs)
    out = []
    for start in range(0, ys.shape[0], chunk):
        y, prev, k = ys[start : start + chunk], previous[start : start + chunk], weights[start : start + chunk]
        n = y.shape[0]
        grad = torch.zeros(n, rows, vocab, dtype=theta.dtype)
        sample = torch.arange(n)[:, None].expand_as(y)
        # K_t·(e_{y_t} − π_θ(·|y_{t−1})) in row y_{t−1}: the score of a softmax row.
        grad.index_put_((sample, prev, y), k, accumulate=True)
        grad.index_put_((sample, prev), -k[..., None] * probs[prev], accumulate=True)
        if direct:
            c = direct[0][start : start + chunk]
            grad.index_put_((sample, prev), c[..., None] * state_grad[prev], accumulate=True)
        out.append(grad.flatten(1))
    return torch.cat(out)


def gradient_statistics(grads, exact, batch_size: int) -> dict:
    """Relative bias (and its standard error), variance per completion relative to ``‖exact‖²``, half-batch cosine."""
    import torch

    n = grads.shape[0]
    mean = grads.mean(0)
    centred = grads - mean
    variance = (centred**2).sum(-1).mean() * n / (n - 1)
    signal = (exact**2).sum()
    batches = grads[: n // batch_size * batch_size].view(-1, 2, batch_size // 2, grads.shape[-1]).mean(2)
    cosines = torch.nn.functional.cosine_similarity(batches[:, 0], batches[:, 1], dim=-1)
    return {
        "relative_bias": float((mean - exact).norm() / exact.norm()),
        "bias_standard_error": float(torch.sqrt(variance / n / signal)),
        "relative_variance": float(variance / signal),
        "half_batch_cosine": float(cosines.mean()),
        "gradient_norm": float(exact.norm()),
    }


def run_kl_variance(args: KLVarianceArguments, progress=None) -> dict:
    """Measure every (anchor, divergence, length, ``kl_to_go``); return the report written to ``results.json``."""
    import torch

    from . import machine

    torch.set_num_threads(args.num_threads)
    started = time.perf_counter()
    rows = []
    for anchor in args.anchors:
        generator = torch.Generator().manual_seed(args.seed)
        theta, old, ref = markov_policies(args, anchor, generator)
        for length in args.lengths:
            theta_grad = theta.clone().requires_grad_(True)
            (exact,) = torch.autograd.grad(exact_kl(theta_grad, ref, length), theta_grad)
            ys = sample_completions(old, args.num_completions, length, generator)
            for divergence in args.divergences:
                for kl_level, kl_to_go, mode, kl_estimate, baseline in ESTIMATES:
                    grads = per_completion_gradients(
                        theta, old, ref, ys, divergence, kl_to_go, anchor, kl_level, mode, kl_estimate=kl_estimate,
                        kl_to_go_baseline=baseline, group_size=args.group_size if baseline != "none" else None,
                    )  # fmt: skip
                    row = {"anchor": anchor, "divergence": divergence, "length": length, "kl_level": kl_level}
                    row.update(kl_to_go=kl_to_go, kl_clip_mode=mode, kl_estimate=kl_estimate)
                    row.update(kl_to_go_baseline=baseline)
                    row.update(gradient_statistics(grads, exact.flatten(), args.batch_size))
                    rows.append(row)
                    if progress is not None:
                        progress(row)
    return {
        "arguments": asdict(args),
        "machine": machine(),
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }


def estimate_of(row: dict) -> tuple[str, str, str, str, str]:
    """The ``(kl_level, kl_to_go, kl_clip_mode, kl_estimate, kl_to_go_baseline)`` of a row (the last two
    ``"sample"`` and ``"none"`` in reports written before they were measured)."""
    return (
        row["kl_level"],
        row["kl_to_go"],
        row["kl_clip_mode"],
        row.get("kl_estimate", "sample"),
        row.get("kl_to_go_baseline", "none"),
    )


def estimate_name(row: dict) -> str:
    """How the tables and the figure name a row's estimate."""
    kl_level, kl_to_go, mode, kl_estimate, baseline = estimate_of(row)
    extra = (", exact per-position KL" if kl_estimate == "vocabulary" else "") + (
        ", leave-one-out baseline" if baseline != "none" else ""
    )
    if kl_level == "token":
        return f"token level, {mode}{extra}"
    if kl_estimate == "vocabulary":
        return f"sequence, {mode}{extra}"
    return f"sequence, kl_to_go={kl_to_go}, {mode}{extra}"


def markdown_table(report: dict) -> str:
    """The rows of `report` as a Markdown table, with the variance ratio of the two estimates."""
    args = report["arguments"]
    lines = [
        f"KL gradient at length, Markov chain of {args['vocab_size']} tokens (π_ref logits scale "
        f"{args['reference_scale']}, π_old − π_ref {args['old_shift']} with a separate reference, π_θ − π_old "
        f"{args['theta_shift']}), {args['num_completions']} completions from π_old per length, seed "
        f"{args['seed']}; exact: the clip off, truncated: the default kl_clip_mode (c = 10). Bias: ‖mean − exact‖/‖exact‖ (± its standard error); variance: "
        "E‖g − mean‖²/‖exact‖² per completion; cosine: between the two halves of a batch of "
        f"{args['batch_size']} completions; exact per-position KL: kl_estimate='vocabulary'; leave-one-out baseline: "
        f"kl_to_go_baseline='leave_one_out' over groups of {args.get('group_size', 16)} completions.",
        "",
        "| Anchor | Divergence | T | Estimate | Bias (± s.e.) | Variance per completion | Variance: sequence "
        "log_ratio exact / this | Half-batch cosine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["anchor"], r["divergence"], r["length"], *estimate_of(r)): r for r in report["rows"]}
    for r in report["rows"]:
        sampled = by_key.get((r["anchor"], r["divergence"], r["length"], *ESTIMATES[0]))
        ratio = f"{sampled['relative_variance'] / r['relative_variance']:.3g}" if sampled and sampled is not r else "–"
        estimate = estimate_name(r)
        lines.append(
            f"| {r['anchor']} | {r['divergence']} | {r['length']} | {estimate} | {r['relative_bias']:.3f} ± "
            f"{r['bias_standard_error']:.3f} | {r['relative_variance']:.4g} | {ratio} | {r['half_batch_cosine']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Variance per completion (top) and half-batch cosine (bottom) against the length, one column per (divergence,
    anchor), one line per estimate, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["divergence"], r["anchor"]) for r in report["rows"]}, key=lambda k: (k[0] != "urkl", k))
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.4), squeeze=False, sharex=True)
    colours = plt.get_cmap("tab10")
    for column, (divergence, anchor) in enumerate(panels):
        for index, estimate in enumerate(ESTIMATES):
            rows = [
                r
                for r in report["rows"]
                if (r["divergence"], r["anchor"], *estimate_of(r)) == (divergence, anchor, *estimate)
            ]
            if not rows:
                continue
            style = dict(color=colours(index), marker="o" if estimate[2] == "exact" else "x",
                         linestyle=":" if estimate[0] == "token" else ("--" if estimate[1] == "k3" else "-"),
                         linewidth=2.5 if estimate[3] == "vocabulary" else 1.5)  # fmt: skip
            lengths = [r["length"] for r in rows]
            axes[0, column].plot(
                lengths, [r["relative_variance"] for r in rows], label=estimate_name(rows[0]), **style
            )
            axes[1, column].plot(lengths, [r["half_batch_cosine"] for r in rows], **style)
        axes[0, column].set_title(f"{divergence}, {anchor} anchor", fontsize=9)
        axes[0, column].set_yscale("log")
        axes[1, column].set_xscale("log", base=2)
        axes[1, column].set_xlabel("completion length T")
        axes[1, column].set_ylim(-0.1, 1.05)
    axes[0, 0].set_ylabel("variance per completion / ‖∇D‖²")
    axes[1, 0].set_ylabel(f"half-batch cosine ({report['arguments']['batch_size']} completions)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.suptitle("KL gradient against length: noise and agreement of two half-batches", fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(output_dir: str) -> None:
    """Draw ``kl_variance.png`` again from the ``results.json`` in `output_dir`."""
    plot(json.loads((Path(output_dir) / "results.json").read_text()), Path(output_dir) / "kl_variance.png")


def add_parser(subparsers):
    """Register ``rpg-trl bench-kl-variance`` (see [`rpg_research.cli`])."""
    return subparsers.add_parser(
        "bench-kl-variance",
        help="Bias and variance of the KL gradient at length: each kl_level, kl_to_go, kl_estimate and baseline.",
        description="Sample completions of a Markov-chain policy whose KL gradient is known exactly; measure each "
        "kl_to_go's bias, variance per completion and half-batch cosine at each length; write table.md, "
        "results.json and kl_variance.png.",
        dataclass_types=[KLVarianceArguments],
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-kl-variance`` with the parsed command-line `args`."""
    from tqdm.auto import tqdm

    from . import dataclass_arguments, print_report

    variance_args = dataclass_arguments(args, KLVarianceArguments)
    total = len(variance_args.anchors) * len(variance_args.lengths) * len(variance_args.divergences) * len(ESTIMATES)
    output_dir = Path(variance_args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tqdm(total=total, desc="bench-kl-variance", unit="row") as bar:
        report = run_kl_variance(variance_args, progress=lambda row: bar.update(1))
    (output_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (output_dir / "table.md").write_text(markdown_table(report))
    plot(report, output_dir / "kl_variance.png")
    print_report(str(output_dir), report["seconds"], f"{output_dir}/table.md, results.json and kl_variance.png")
    return 0
