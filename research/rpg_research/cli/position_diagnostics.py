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
"""

from __future__ import annotations

import statistics
from collections import defaultdict


#: The numbers recorded per group and step ([`PositionDiagnostics.summary`] averages each over the steps).
LOG_W_KEYS = ("log_w_p05", "log_w_p95", "log_w_max", "log_w_min", "clipped")
TRUNCATION_KEYS = ("s_p05", "s_p50", "s_p95", "s_below_1")


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

    def attach(self, trainer) -> PositionDiagnostics:
        """Record the diagnostics of `trainer`'s training steps from now on (see the module docstring)."""
        from rpg_trl.trainer import RPGTrainer

        compute_loss, get_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
        captured: list = []
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
            setattr(trainer, name, logps_during_the_loss)
            try:
                loss = compute_loss(model, inputs)
            finally:
                if own is None:
                    delattr(trainer, name)
                else:
                    setattr(trainer, name, own)
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
            return loss

        trainer._compute_loss = wrapped
        return self

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
