# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A KL to a reference model that stops holding: one warning, naming the settings to change.

With a reference model (`kl_anchor="reference"`, β > 0) the KL term is meant to hold the policy near the reference. When
it does not, the logged metrics show a signature before the rewards do (docs/bench_algos.md, the KL tables): the KL to
the reference rises generation batch after generation batch while the token entropy falls, and the importance weights
π_θ/π_old reach far beyond the dual-clip bound c. [`KLDriftMonitor`] watches the trainer's logged `kl`, `entropy` and
`importance_weight/max`, grouped by generation batch, and warns once per run when

* the mean `kl` rose, by more than [`KL_RISE`] relative each time, over [`KL_DRIFT_WINDOW`] consecutive generation
  batches (periods of whole generation batches, at least [`MIN_PERIOD_STEPS`] optimizer steps) while the mean
  `entropy` fell at each of them, or
* the largest importance weight of a generation batch exceeded [`WEIGHT_FACTOR`] × `clip_c` while `kl` rose over the
  last two generation batches.

[`KLDriftMonitorMixin`] gives it to [`~rpg_trl.RPGTrainer`]; it is active only with a reference model and β > 0 (the
KL to the sampling policy restarts at 0 with every generation batch).
"""

from __future__ import annotations

import math
import warnings


#: Consecutive generation batches of rising KL and falling entropy that make the first signature.
KL_DRIFT_WINDOW = 3
#: The relative rise of the mean KL from one generation batch to the next that counts as rising.
KL_RISE = 0.25
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

    def _rising(self, window: int) -> bool:
        recent = self.batches[-(window + 1) :]
        return len(recent) == window + 1 and all(b["kl"] > a["kl"] * (1 + KL_RISE) for a, b in zip(recent, recent[1:]))

    def _check(self) -> bool:
        if self.warned or len(self.batches) < 3:
            return False
        recent = self.batches[-(KL_DRIFT_WINDOW + 1) :]
        entropy_falling = all(
            a["entropy"] is not None and b["entropy"] is not None and b["entropy"] < a["entropy"]
            for a, b in zip(recent, recent[1:])
        )
        drifting = self._rising(KL_DRIFT_WINDOW) and entropy_falling
        last = self.batches[-1]
        far = last["weight_max"] is not None and last["weight_max"] > WEIGHT_FACTOR * self.clip_c and self._rising(2)
        if not (drifting or far):
            return False
        self.warned = True
        kls = ", ".join(f"{b['kl']:.3g}" for b in recent)
        signs = []
        if drifting:
            entropies = ", ".join(f"{b['entropy']:.3g}" for b in recent)
            signs.append(f"the entropy fell at each of them ({entropies})")
        if far:
            signs.append(
                f"the largest importance weight π_θ/π_old reached {last['weight_max']:.3g}, beyond {WEIGHT_FACTOR:g} × "
                f"clip_c = {WEIGHT_FACTOR * self.clip_c:g}"
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
            f"The KL to the reference model is not holding the policy: over the last generation batches it rose ({kls}) "
            f"and {' and '.join(signs)}. This is the signature of a policy running away from its reference "
            f"(docs/bench_algos.md, the KL tables). To change: {'; '.join(advice)}. (Warned once per run.)",
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
