# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A KL to a reference model that stops holding: one warning, naming the settings to change.

With a reference model (`kl_anchor="reference"`, β > 0) the KL term is meant to hold the policy near the reference. When
it does not, the logged metrics show it before the rewards do (docs/bench_algos.md, the KL tables): the KL to the
reference, which levels off within a few generation batches when it holds, keeps multiplying, and the importance
weights π_θ/π_old reach far beyond the dual-clip bound c. [`KLDriftMonitor`] watches the trainer's logged `kl`,
`entropy` and `importance_weight/max`, averaged per generation batch (periods of at least [`MIN_PERIOD_STEPS`]
optimizer steps), and warns once per run when, leaving out the first period (the KL to a fresh reference rises from 0
there),

* the mean `kl` grew by a factor [`KL_GROWTH`] or more at each of two consecutive periods, or
* the largest importance weight exceeded [`WEIGHT_FACTOR`] × `clip_c` in two consecutive periods while `kl` rose at
  both.

The entropy is reported, not required: in the collapsing runs of the KL table it fell in some and rose in others.
Replayed on the logged metrics of the 90 regularised runs of the second KL table (docs/bench_algos.md;
`python docs/results/replay_kl_drift.py runs/kl2`), these rules
warn on 13 of the 18 runs that collapsed, at the 4th to 6th generation batch of 8, and on none of the 72 that held.
[`KLDriftMonitorMixin`] gives the monitor to [`~rpg_trl.RPGTrainer`]; it is active only with a reference model and
β > 0 (the KL to the sampling policy restarts at 0 with every generation batch).
"""

from __future__ import annotations

import math
import warnings


#: The first signature: the mean KL of a period at least this many times the previous period's, twice in a row.
KL_GROWTH = 2.0
#: The second signature: the largest importance weight of a generation batch beyond this many times `clip_c`.
WEIGHT_FACTOR = 10.0
#: The fewest optimizer steps that one period of the monitor spans: with fewer steps per generation batch, consecutive
#: generation batches are grouped, so that three rises in a row are a trend and not step-to-step noise.
MIN_PERIOD_STEPS = 8


class KLDriftWarning(UserWarning):
    """The KL to the reference model is not holding the policy ([`KLDriftMonitor`])."""


class KLDriftMonitor:
    """Collects the logged `kl`, `entropy` and `importance_weight/max` per generation batch and warns once when the KL
    to the reference stops holding (module docstring).

    Args:
        steps_per_generation (`int`): optimizer steps served by one generation batch; a period is the fewest whole
            generation batches that span [`MIN_PERIOD_STEPS`] steps, n, and the logged values of the steps
            `1 + g·n … (g + 1)·n` form period g.
        clip_c (`float`): the dual-clip bound c of the second signature.
        settings (`dict`): the configuration values the warning names (e.g. `kl_clip_mode`, `beta`, `learning_rate`).
    """

    def __init__(self, steps_per_generation: int, clip_c: float, settings: dict | None = None):
        # A period: whole generation batches, at least MIN_PERIOD_STEPS optimizer steps.
        steps_per_generation = max(1, int(steps_per_generation))
        self.steps_per_generation = steps_per_generation * math.ceil(MIN_PERIOD_STEPS / steps_per_generation)
        self.clip_c = clip_c
        self.settings = dict(settings or {})
        #: Finished generation batches: dicts with the mean `kl`, mean `entropy` and largest weight.
        self.batches: list[dict] = []
        self._current: int | None = None
        self._values: dict[str, list[float]] = {}
        self.warned = False

    def observe(self, logs: dict, step: int) -> bool:
        """Record the logged metrics of optimizer step `step` (`logs`: the trainer's log entry); return whether it
        warned."""
        batch = (step - 1) // self.steps_per_generation
        if self._current is not None and batch != self._current:
            self._finish()
        self._current = batch
        for key in ("kl", "entropy", "importance_weight/max"):
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._values.setdefault(key, []).append(float(value))
        return self._check()

    def _finish(self) -> None:
        kl, entropy = self._values.get("kl"), self._values.get("entropy")
        if kl:
            weights = self._values.get("importance_weight/max")
            self.batches.append(
                {
                    "kl": sum(kl) / len(kl),
                    "entropy": sum(entropy) / len(entropy) if entropy else None,
                    "weight_max": max(weights) if weights else None,
                }
            )
        self._values = {}

    def _check(self) -> bool:
        # Periods 1, 2, ... (the first period, 0, is the KL's rise from 0 and is left out).
        if self.warned or len(self.batches) < 4:
            return False
        recent = self.batches[-3:]
        kl = [b["kl"] for b in recent]
        growing = kl[2] >= KL_GROWTH * kl[1] and kl[1] >= KL_GROWTH * kl[0]
        bound = WEIGHT_FACTOR * self.clip_c
        far = (
            all(b["weight_max"] is not None and b["weight_max"] > bound for b in recent[1:]) and kl[2] > kl[1] > kl[0]
        )
        if not (growing or far):
            return False
        self.warned = True
        last = recent[-1]
        kls = ", ".join(f"{b['kl']:.3g}" for b in recent)
        entropies = ", ".join("?" if b["entropy"] is None else f"{b['entropy']:.3g}" for b in recent)
        signs = [f"the KL to the reference went {kls} over the last three periods (entropy {entropies})"]
        if far:
            signs.append(
                f"the largest importance weight π_θ/π_old reached {last['weight_max']:.3g}, beyond {WEIGHT_FACTOR:g} × "
                f"clip_c = {bound:g}, twice in a row"
            )
        advice = []
        if self.settings.get("kl_clip_mode") == "clipped":
            advice.append(
                "kl_clip_mode='clipped' (Algorithm 1's reading) can push tokens away from the reference: use "
                "kl_clip_mode='truncated' (the default) or 'exact'"
            )
        advice.append(
            f"lower learning_rate (now {self.settings.get('learning_rate', '?')}) or steps_per_generation (now "
            f"{self.settings.get('steps_per_generation', '?')}), so that π_θ stays near the policy that sampled each "
            "batch"
        )
        if self.settings.get("kl_target") is None:
            advice.append(
                f"raise beta (now {self.settings.get('beta', '?')}) or set kl_target for an adaptive β, or sync the "
                "reference with ref_model_sync_kl_threshold"
            )
        else:
            advice.append(
                f"let the adaptive β react faster: lower kl_horizon (now {self.settings.get('kl_horizon', '?')}) or "
                f"raise kl_beta_max (now {self.settings.get('kl_beta_max', '?')})"
            )
        warnings.warn(
            f"The KL to the reference model is not holding the policy: {' and '.join(signs)}. This is the signature "
            f"of a policy running away from its reference (docs/bench_algos.md, the KL tables). To change: {'; '.join(advice)}. (Warned once per run.)",
            KLDriftWarning,
            stacklevel=2,
        )
        return True


class KLDriftMonitorMixin:
    """Feeds the trainer's training log entries to a [`KLDriftMonitor`] when the KL is anchored to a reference model
    with β > 0. Goes before the TRL trainer in a class line; reads `args.kl_anchor`, `args.beta` and the settings the
    warning names."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.args
        #: The monitor, or None without a reference model (its `warned` says whether it warned).
        self.kl_drift_monitor = None
        if getattr(config, "kl_anchor", None) == "reference" and config.beta > 0:
            generate_every = config.steps_per_generation * config.num_iterations
            self.kl_drift_monitor = KLDriftMonitor(
                max(1, generate_every // config.gradient_accumulation_steps),
                config.clip_c,
                {
                    name: getattr(config, name, None)
                    for name in (
                        "kl_clip_mode",
                        "beta",
                        "learning_rate",
                        "steps_per_generation",
                        "kl_target",
                        "kl_horizon",
                        "kl_beta_max",
                    )
                },
            )

    def log(self, logs, start_time=None):
        if self.kl_drift_monitor is not None and self.model.training:
            # The training metrics of this logging interval (one value per micro-batch), before `log` clears them.
            metrics = self._metrics["train"]
            interval = {}
            for key, reduce in (("kl", _mean), ("entropy", _mean), ("importance_weight/max", max)):
                values = [v for v in metrics.get(key, ()) if math.isfinite(v)]
                if values:
                    interval[key] = reduce(values)
            if "kl" in interval:
                self.kl_drift_monitor.observe(interval, self.state.global_step)
        super().log(logs, start_time)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
