# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""Diagnostics by position along the completion, for ``rpg-trl bench-algos`` (the fourth protocol of
research/docs/bench_algos.md): what the importance weights, the clip and the sequence-level truncation do at each part of a
completion, for any trainer (TRL's ``GRPOTrainer``, ``RPGTrainer``, ``ReinforcePlusPlusTrainer``).

[`PositionDiagnostics.attach`] wraps the trainer's ``_compute_loss``: at every training step it reads, detached, the
policy's per-token log-probabilities that the loss computes (through ``_get_per_token_logps_and_entropies``, during
the loss only), the batch's ``old_per_token_logps`` (π_old; the policy's own when TRL skips them on-policy), the
reference's where the loss reads one, the advantages and the completion mask, and, for each group of positions
``[start, stop)`` (the long task's rows), records over its active tokens:

* the spread of ``log w = log π_θ − log π_old``: its 5th and 95th percentiles, its largest and smallest value;
* the fraction of tokens in the clip regions: RPG-Style Clip's (Sec. 3.3: ``A<0, w<1−ε_low``; ``A>0, w>1+ε_high``;
  ``A<0, w>c``) for ``RPGTrainer`` with the clip on, PPO's (the first two) for the others;
* at ``kl_level="sequence"``, the truncation factor ``s_t = min(1, c/M_t)`` of ``kl_clip_mode="truncated"``
  (docs/design.md; [`rpg_trl.losses.kl.sequence_log_truncation`], read whatever the mode): its 5th, 50th and 95th
  percentiles and the fraction of tokens with ``s_t < 1``.

[`PositionDiagnostics.summary`] averages each number over the training steps at which the group had tokens. The loss
and its gradient are not changed: the wrapper only reads tensors the loss computes anyway.

For ``RPGTrainer`` with β > 0 it also records, per training step (one micro-batch: the bench trains without gradient
accumulation), what the KL term's gradient is made of (issue 63; [`kl_gradient_diagnostics`]):

* ``kl_grad_cosine``: the cosine between the parameter gradients of the KL term alone (``β·Σ K̃·∇log π_θ``, the
  trainer's aggregation) on the first and on the second half of the step's completions: near 1 when the KL term pushes
  the same way on any sample, near 0 when its gradient is noise;
* ``kl_reward_grad_ratio``: ``‖∇ KL term‖ / ‖∇ reward term‖`` on the whole step;
* the loss's own diagnostics of the step ([`rpg_trl.losses.DIAGNOSTIC_METRICS`]): the largest and the smallest
  whole-completion log importance weight ``log W≤T``, their effective sample size and the KL's share of the gradient
  weight;

each tagged with whether the step is the first one after π_old was refreshed (a new generation batch).
[`PositionDiagnostics.gradient_summary`] averages them over the steps, over the first steps after a refresh and over
the others. They cost four extra backward passes per step (through the graph the loss already built; the trainer's
own backward pass is unchanged).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict


#: The numbers recorded per group and step ([`PositionDiagnostics.summary`] averages each over the steps).
LOG_W_KEYS = ("log_w_p05", "log_w_p95", "log_w_max", "log_w_min", "clipped")
TRUNCATION_KEYS = ("s_p05", "s_p50", "s_p95", "s_below_1")
#: The numbers recorded per step for the KL term's gradient ([`kl_gradient_diagnostics`]) -> the loss metric each of
#: the last four is (``None``: computed here).
GRADIENT_KEYS = {
    "kl_grad_cosine": None,
    "kl_reward_grad_ratio": None,
    "log_prefix_weight_max": "kl/log_prefix_weight/max",
    "log_prefix_weight_min": "kl/log_prefix_weight/min",
    "prefix_ess": "kl/prefix_ess",
    "kl_weight_share": "kl/weight_share",
}
#: The parts of the steps [`PositionDiagnostics.gradient_summary`] averages over: every step, the first step after each
#: refresh of π_old, the others.
GRADIENT_PHASES = ("all", "after_refresh", "later")


def kl_gradient_diagnostics(
    parameters, logps, inputs, spec, aggregate, ref_logps=None, position_kl=None, groups=None
) -> dict[str, float]:
    """The numbers of [`GRADIENT_KEYS`] of one step, from the policy's log-probabilities `logps` (B, T) with their
    graph to `parameters`, the batch `inputs` (``old_per_token_logps``, ``advantages``, ``completion_mask``) and the
    loss `spec` ([`rpg_trl.losses.RPGLossSpec`]); `aggregate(per_token_loss, float_mask)` reduces a per-token loss
    as the trainer does. The KL term alone is `rpg_per_token_loss` with the reward term masked out (``reward_mask``
    0, so the clip regions stay the step's), the reward term alone the same loss with β = 0. With
    ``kl_estimate="vocabulary"``, `position_kl` is the step's exact per-position KL (with its graph) and `groups` the
    prompt labels of ``kl_to_go_baseline``, as the trainer passed them to the loss. The graphs of `logps` and
    `position_kl` are kept (``retain_graph``): the trainer's backward pass follows."""
    import torch

    from rpg_trl.losses import rpg_per_token_loss, summarize_stats

    parameters = [p for p in parameters if p.requires_grad]
    mask = inputs["completion_mask"]
    fmask = (mask > 0).to(torch.promote_types(logps.dtype, torch.float32))
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    advantages = inputs["advantages"]

    def per_token(loss_spec, reward_mask=None):
        return rpg_per_token_loss(
            logps, old, advantages, mask, loss_spec, ref_logps=ref_logps, reward_mask=reward_mask,
            position_kl=position_kl, groups=groups,
        )  # fmt: skip

    kl_loss, _ = per_token(spec, reward_mask=torch.zeros_like(fmask))
    reward_loss, _ = per_token(spec.replace(beta=0.0))
    _, full_stats = per_token(spec)

    def gradient(per_token_loss, rows):
        loss = aggregate(per_token_loss[rows], fmask[rows])
        grads = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
        return torch.cat(
            [(torch.zeros_like(p) if g is None else g).double().flatten() for p, g in zip(parameters, grads)]
        )

    everything, half = slice(None), logps.shape[0] // 2
    kl_grad, reward_grad = gradient(kl_loss, everything), gradient(reward_loss, everything)
    cosine = math.nan
    if half > 0:
        first, second = gradient(kl_loss, slice(0, half)), gradient(kl_loss, slice(half, None))
        norms = first.norm() * second.norm()
        cosine = float(first @ second / norms) if norms > 0 else math.nan
    reward_norm = float(reward_grad.norm())
    metrics = summarize_stats(full_stats, fmask)
    out = {
        "kl_grad_cosine": cosine,
        "kl_reward_grad_ratio": float(kl_grad.norm()) / reward_norm if reward_norm > 0 else math.nan,
    }
    out.update({key: float(metrics[metric]) for key, metric in GRADIENT_KEYS.items() if metric is not None})
    return out


class PositionDiagnostics:
    """Per-position diagnostics of one training run; see the module docstring.

    Args:
        groups: ``(name, start, stop)`` per group of completion positions.
    """

    def __init__(self, groups):
        if not groups:
            raise ValueError("`groups` is empty: name at least one range of completion positions.")
        for name, start, stop in groups:
            if not 0 <= start < stop:
                raise ValueError(f"The group {name!r} needs 0 <= start < stop; got [{start}, {stop}).")
        self.groups = tuple(groups)
        self.steps: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name, _, _ in self.groups}
        #: Per step of an RPGTrainer with β > 0: the numbers of [`GRADIENT_KEYS`] and ``after_refresh``.
        self.gradient_steps: list[dict] = []

    def attach(self, trainer) -> PositionDiagnostics:
        """Record the diagnostics of `trainer`'s training steps from now on (see the module docstring)."""
        from rpg_trl.trainer import RPGTrainer

        compute_loss, get_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
        captured: list = []
        #: kl_estimate="vocabulary": the loss's exact per-position KL and prompt labels, as the loss received them.
        loss_inputs: dict = {}
        if isinstance(trainer, RPGTrainer):
            import rpg_trl.trainer as trainer_module

            loss_function = trainer_module.rpg_per_token_loss

            def keep_loss_inputs(*args, position_kl=None, groups=None, **kwargs):
                loss_inputs.update(position_kl=position_kl, groups=groups)
                return loss_function(*args, position_kl=position_kl, groups=groups, **kwargs)

        if isinstance(trainer, RPGTrainer):
            spec = trainer.loss_spec
            dual_clip = spec.clip
            epsilon_low, epsilon_high, clip_c = spec.epsilon_low, spec.epsilon_high, spec.clip_c
        else:
            spec, dual_clip = None, False
            epsilon_low, epsilon_high, clip_c = trainer.epsilon_low, trainer.epsilon_high, float("inf")

        def logps_during_the_loss(*args, **kwargs):
            out = get_logps(*args, **kwargs)
            captured.append(out[0])
            return out

        name = "_get_per_token_logps_and_entropies"
        # What the trainer had before the loss (an attribute of its own, e.g. another wrapper, or the class's method).
        own = trainer.__dict__.get(name)

        def wrapped(model, inputs):
            captured.clear()
            loss_inputs.clear()
            setattr(trainer, name, logps_during_the_loss)
            if spec is not None:
                trainer_module.rpg_per_token_loss = keep_loss_inputs
            try:
                loss = compute_loss(model, inputs)
            finally:
                if own is None:
                    delattr(trainer, name)
                else:
                    setattr(trainer, name, own)
                if spec is not None:
                    trainer_module.rpg_per_token_loss = loss_function
            if trainer.model.training and captured:
                current_spec = trainer.loss_spec if spec is not None else None
                self.record(
                    captured[0],
                    inputs,
                    epsilon_low=epsilon_low,
                    epsilon_high=epsilon_high,
                    clip_c=clip_c,
                    dual_clip=dual_clip,
                    spec=current_spec,
                    reference=spec is not None and trainer.args.kl_anchor == "reference",
                )
                if current_spec is not None and current_spec.beta > 0 and captured[0].requires_grad:
                    self.record_gradients(trainer, model, captured[0], inputs, current_spec, **loss_inputs)
            return loss

        trainer._compute_loss = wrapped
        return self

    def record_gradients(self, trainer, model, logps, inputs, spec, position_kl=None, groups=None) -> None:
        """Add one step's numbers of [`GRADIENT_KEYS`] ([`kl_gradient_diagnostics`]) for an `RPGTrainer` `trainer`,
        with the trainer's aggregation (its `_aggregate`, without the gradient-accumulation scale, which no ratio
        reads) and whether the step is the first after a refresh of π_old (TRL's micro-batch counter `_step`)."""
        ref = inputs.get("ref_per_token_logps") if trainer.args.kl_anchor == "reference" else None

        def aggregate(per_token_loss, fmask):
            return trainer._aggregate(per_token_loss, fmask, inputs, "eval")[0]

        numbers = kl_gradient_diagnostics(model.parameters(), logps, inputs, spec, aggregate, ref, position_kl, groups)
        generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        numbers["after_refresh"] = getattr(trainer, "_step", len(self.gradient_steps)) % generate_every == 0
        self.gradient_steps.append(numbers)

    def gradient_summary(self) -> dict[str, float | int]:
        """Each number of [`GRADIENT_KEYS`] averaged (over the steps where it is finite) over every step, the first
        step after each refresh of π_old and the others ([`GRADIENT_PHASES`]): ``"{key}/{phase}"``; with ``"steps"``
        and ``"refreshes"``, their numbers. Empty when no step was recorded."""
        if not self.gradient_steps:
            return {}
        phases = {
            "all": self.gradient_steps,
            "after_refresh": [step for step in self.gradient_steps if step["after_refresh"]],
            "later": [step for step in self.gradient_steps if not step["after_refresh"]],
        }
        out: dict[str, float | int] = {"steps": len(self.gradient_steps), "refreshes": len(phases["after_refresh"])}
        for key in GRADIENT_KEYS:
            for phase, steps in phases.items():
                values = [step[key] for step in steps if math.isfinite(step[key])]
                out[f"{key}/{phase}"] = statistics.fmean(values) if values else math.nan
        return out

    def record(self, logps, inputs, *, epsilon_low, epsilon_high, clip_c, dual_clip, spec, reference) -> None:
        """Add one step's numbers per group, from the policy's log-probabilities `logps` (B, T) and the batch `inputs`."""
        import torch

        from rpg_trl.losses.kl import sequence_log_truncation
        from rpg_trl.losses.ratios import clip_regions, importance_ratios

        with torch.no_grad():
            dtype = torch.promote_types(logps.dtype, torch.float32)
            logps = logps.detach().to(dtype)
            old = inputs.get("old_per_token_logps")
            old = logps if old is None else old.to(dtype)
            active = inputs["completion_mask"].bool()
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            ref = inputs.get("ref_per_token_logps") if reference else None
            ratios = importance_ratios(logps, old, None if ref is None else ref.to(dtype), active)
            log_w = ratios.token_log_ratio
            regions = clip_regions(ratios.token_w, advantages, epsilon_low, epsilon_high, clip_c)
            clipped = (regions.low | regions.high | regions.dual) if dual_clip else (regions.low | regions.high)
            log_s = None
            if spec is not None and spec.kl_level == "sequence":
                log_s = -sequence_log_truncation(spec.kl_term, ratios.prefixes, spec)
            length = log_w.shape[1]
            for name, start, stop in self.groups:
                if start >= length:
                    continue
                mask = active[:, start:stop]
                if not mask.any():
                    continue
                values = log_w[:, start:stop][mask]
                quantiles = torch.quantile(values.double(), torch.tensor([0.05, 0.95], dtype=torch.float64))
                row = self.steps[name]
                row["log_w_p05"].append(float(quantiles[0]))
                row["log_w_p95"].append(float(quantiles[1]))
                row["log_w_max"].append(float(values.max()))
                row["log_w_min"].append(float(values.min()))
                row["clipped"].append(float(clipped[:, start:stop][mask].double().mean()))
                if log_s is not None:
                    s = log_s[:, start:stop][mask].double().exp()
                    quantiles = torch.quantile(s, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
                    row["s_p05"].append(float(quantiles[0]))
                    row["s_p50"].append(float(quantiles[1]))
                    row["s_p95"].append(float(quantiles[2]))
                    row["s_below_1"].append(float((s < 1.0).double().mean()))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per group: each recorded number averaged over the training steps, and ``"steps"``, their number."""
        out = {}
        for name, _, _ in self.groups:
            row = self.steps[name]
            if not row:
                continue
            out[name] = {key: statistics.fmean(values) for key, values in row.items()}
            out[name]["steps"] = len(row["log_w_p05"])
        return out


def summarize_positions(runs: list[dict], group_key: str) -> list[dict]:
    """One row per (value of `group_key`, group of positions) among the `runs` that carry ``"positions"``: each
    number averaged over the runs (seeds), with the number of runs."""
    rows = []
    names = list(dict.fromkeys(run[group_key] for run in runs if run.get("positions")))
    for name in names:
        group_runs = [run for run in runs if run[group_key] == name and run.get("positions")]
        for position in dict.fromkeys(p for run in group_runs for p in run["positions"]):
            entries = [run["positions"][position] for run in group_runs if position in run["positions"]]
            row = {group_key: name, "positions": position, "runs": len(entries)}
            for key in (*LOG_W_KEYS, *TRUNCATION_KEYS):
                values = [entry[key] for entry in entries if key in entry]
                row[key] = statistics.fmean(values) if values else None
            rows.append(row)
    return rows


def format_positions_table(rows: list[dict], group_key: str, caption: str) -> str:
    """Markdown table of [`summarize_positions`]'s rows."""
    from .warm_start_bench import markdown_table

    def number(value, fmt):
        return "–" if value is None else format(value, fmt)

    header = [
        "Method",
        "Tokens",
        "log w: 5th / 95th pct",
        "log w: min / max",
        "Clipped (%)",
        "s_t: 5th / 50th / 95th pct",
        "s_t < 1 (%)",
    ]
    cells = []
    for row in rows:
        truncation = "–" if row["s_p50"] is None else f"{row['s_p05']:.3g} / {row['s_p50']:.3g} / {row['s_p95']:.3g}"
        cells.append(
            [
                row[group_key],
                row["positions"],
                f"{row['log_w_p05']:+.3f} / {row['log_w_p95']:+.3f}",
                f"{row['log_w_min']:+.2f} / {row['log_w_max']:+.2f}",
                number(None if row["clipped"] is None else 100 * row["clipped"], ".2f"),
                truncation,
                number(None if row["s_below_1"] is None else 100 * row["s_below_1"], ".1f"),
            ]
        )
    return markdown_table(caption, header, cells)


def summarize_gradients(runs: list[dict], group_key: str) -> list[dict]:
    """One row per value of `group_key` among the `runs` that carry ``"kl_gradient"``
    ([`PositionDiagnostics.gradient_summary`]): each number averaged over the runs (seeds), with the number of runs."""
    rows = []
    for name in dict.fromkeys(run[group_key] for run in runs if run.get("kl_gradient")):
        entries = [run["kl_gradient"] for run in runs if run[group_key] == name and run.get("kl_gradient")]
        row = {group_key: name, "runs": len(entries)}
        for key in ("steps", "refreshes", *(f"{k}/{p}" for k in GRADIENT_KEYS for p in GRADIENT_PHASES)):
            values = [entry[key] for entry in entries if key in entry and math.isfinite(entry[key])]
            row[key] = statistics.fmean(values) if values else None
        rows.append(row)
    return rows


def format_gradients_table(rows: list[dict], group_key: str, caption: str) -> str:
    """Markdown table of [`summarize_gradients`]'s rows: per number, its mean over the first steps after a refresh of
    π_old, over the other steps and over every step."""
    from .warm_start_bench import markdown_table

    def three(row, key, fmt):
        return " / ".join(
            "–" if row[f"{key}/{p}"] is None else format(row[f"{key}/{p}"], fmt)
            for p in ("after_refresh", "later", "all")
        )

    header = [
        "Method",
        "Runs",
        "KL grad half-batch cosine",
        "‖∇KL‖ / ‖∇reward‖",
        "max log W≤T",
        "min log W≤T",
        "prefix ESS",
        "KL weight share",
    ]
    cells = [
        [
            row[group_key],
            str(row["runs"]),
            three(row, "kl_grad_cosine", ".3f"),
            three(row, "kl_reward_grad_ratio", ".3g"),
            three(row, "log_prefix_weight_max", "+.2f"),
            three(row, "log_prefix_weight_min", "+.2f"),
            three(row, "prefix_ess", ".3f"),
            three(row, "kl_weight_share", ".3f"),
        ]
        for row in rows
    ]
    return markdown_table(caption, header, cells)


#: The caption of [`format_gradients_table`] in the bench's report.
GRADIENTS_CAPTION = (
    "**The KL term's gradient per step** (RPG arms with β > 0; each cell: the mean over the first step after each "
    "refresh of π_old / over the other steps / over every step, then over the seeds). Half-batch cosine: between the "
    "parameter gradients of the KL term alone on the two halves of the step's completions; ‖∇KL‖ / ‖∇reward‖: of the "
    "KL term and of the reward term on the whole step; log W≤T = Σ_t (log π_θ − log π_old) of each completion (its "
    "largest and smallest); prefix ESS: (Σ W)²/(n·Σ W²) of the W≤T; KL weight share: Σ|β·K̃| / (Σ|w·A| + Σ|β·K̃|)."
)
