# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A KL to a reference model that stops holding: one warning, naming the settings to change.

With a reference model (`kl_anchor="reference"`, β > 0) the KL term is meant to hold the policy near the reference.
When it does not, the logged metrics show it before the rewards do (the KL tables of the project's CPU benchmark, a toy
task trained with a reference model): the KL to the reference, which levels off within a few generation batches when it
holds, keeps multiplying, and the importance weights π_θ/π_old reach far beyond the dual-clip bound c.
[`KLDriftMonitor`] watches the trainer's logged `kl`, `entropy` and `importance_weight/max`, averaged per generation
batch (periods of at least [`MIN_PERIOD_STEPS`] optimizer steps; a period is evaluated when the next one starts, and
the last one, however short, when `train()` ends), and warns once per run when, leaving out the first period (the KL to
a fresh reference rises from 0 there) and only while the latest period's mean KL is at least a floor
(`kl_drift_min_kl`, default [`KL_FLOOR`]: a KL that small is no drift, whatever its growth),

* the mean `kl` grew by a factor [`KL_GROWTH`] or more at each of two consecutive periods, or
* the largest importance weight exceeded [`WEIGHT_FACTOR`] × `clip_c` in two consecutive periods while `kl` grew by
  [`KL_GROWTH`] or more over those two periods.

A reference sync (the `ref/syncs` count that [`~rpg_trl.ref_sync.RefModelSyncCallback`] logs, for
`ref_model_sync_kl_threshold` and `sync_ref_model` alike) starts the watch again: the KL to a freshly synced reference
restarts near 0, and its saw-tooth is no trend. The entropy is reported, not required: in the collapsing runs of the KL
table it fell in some and rose in others. It is a hint, not a guard: it misses many collapses (on the benchmark's runs
that chose none of its thresholds it caught 8 of 32 collapses, with 1 false alarm in 36 runs that held; docs:
*Guarantees*, "Hostile data and diverged policies"). [`KLDriftMonitorMixin`] gives the monitor to
[`~rpg_trl.RPGTrainer`] and [`~rpg_trl.async_rpg.AsyncRPGTrainer`]; it is active only with a reference model, β > 0
and `kl_drift_warning=True` (the default; the KL to the sampling policy restarts at 0 with every generation batch).
"""

from __future__ import annotations

import math
import warnings


#: The first signature: the mean KL of a period at least this many times the previous period's, twice in a row; the
#: second: over two periods.
KL_GROWTH = 2.0
#: The second signature: the largest importance weight of a generation batch beyond this many times `clip_c`.
WEIGHT_FACTOR = 10.0
#: The fewest optimizer steps that one period of the monitor spans: with fewer steps per generation batch, consecutive
#: generation batches are grouped, so that three rises in a row are a trend and not step-to-step noise.
MIN_PERIOD_STEPS = 8
#: The default floor (`kl_drift_min_kl`): no warning while the latest period's mean KL (nats per token) is below it.
KL_FLOOR = 0.01
#: The logged count of reference syncs ([`~rpg_trl.ref_sync.RefModelSyncCallback`]).
SYNCS_METRIC = "ref/syncs"


def check_settings(warning, min_kl) -> None:
    """Raise a `ValueError` naming the field unless `kl_drift_warning` (`warning`) is a bool and `kl_drift_min_kl`
    (`min_kl`) a finite number >= 0."""
    if not isinstance(warning, bool):
        raise ValueError(f"`kl_drift_warning` must be True or False; got {warning!r}.")
    if isinstance(min_kl, bool) or not isinstance(min_kl, (int, float)) or not 0.0 <= min_kl < math.inf:
        raise ValueError(f"`kl_drift_min_kl` must be a finite number >= 0 (a KL in nats per token); got {min_kl!r}.")


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
        min_kl (`float`): the floor: no warning while the latest period's mean KL is below it.
        kl_can_push_away (`bool`): whether the loss's KL weight can push the policy away from the reference on some
            token ([`~rpg_trl.losses.RPGLossSpec.kl_can_push_away`]); the warning then advises a `kl_clip_mode` that
            keeps the sign.
    """

    def __init__(
        self,
        steps_per_generation: int,
        clip_c: float,
        settings: dict | None = None,
        min_kl: float = KL_FLOOR,
        kl_can_push_away: bool = False,
    ):
        # A period: whole generation batches, at least MIN_PERIOD_STEPS optimizer steps.
        steps_per_generation = max(1, int(steps_per_generation))
        self.steps_per_generation = steps_per_generation * math.ceil(MIN_PERIOD_STEPS / steps_per_generation)
        self.clip_c = clip_c
        self.min_kl = float(min_kl)
        self.settings = dict(settings or {})
        self.kl_can_push_away = bool(kl_can_push_away)
        #: Finished generation batches: dicts with the mean `kl`, mean `entropy` and largest weight.
        self.batches: list[dict] = []
        self._current: int | None = None
        self._values: dict[str, list[float]] = {}
        self._syncs: float | None = None
        #: Optimizer steps at which a reference sync started the watch again.
        self.resets: list[int] = []
        self.warned = False

    def reset(self) -> None:
        """Forget the periods seen so far (the reference was synced: the KL to it restarts near 0)."""
        self.batches, self._current, self._values = [], None, {}

    def observe(self, logs: dict, step: int) -> bool:
        """Record the logged metrics of optimizer step `step` (`logs`: the trainer's log entry, or one logging
        interval's metrics); return whether it warned. A change of the logged `ref/syncs` count resets the watch, and
        the values logged with it (which straddle the sync) are left out."""
        syncs = logs.get(SYNCS_METRIC)
        if isinstance(syncs, (int, float)) and math.isfinite(syncs):
            changed = self._syncs is not None and syncs != self._syncs
            self._syncs = syncs
            if changed:
                self.reset()
                self.resets.append(step)
                return False
        batch = (step - 1) // self.steps_per_generation
        if self._current is not None and batch != self._current:
            self._finish()
        self._current = batch
        for key in ("kl", "entropy", "importance_weight/max"):
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._values.setdefault(key, []).append(float(value))
        return self._check()

    def finish(self) -> bool:
        """Evaluate the last period, which no later step closes (training has ended; it may be shorter than the
        others); return whether it warned. Without values since the last period ended, nothing changes."""
        if self._current is None:
            return False
        self._finish()
        self._current = None
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
        if not kl[2] >= self.min_kl:
            return False
        growing = kl[2] >= KL_GROWTH * kl[1] and kl[1] >= KL_GROWTH * kl[0]
        bound = WEIGHT_FACTOR * self.clip_c
        far = all(b["weight_max"] is not None and b["weight_max"] > bound for b in recent[1:]) and kl[2] >= (
            KL_GROWTH * kl[0]
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
        if self.kl_can_push_away:
            mode = self.settings.get("kl_clip_mode", "?")
            advice.append(
                f"kl_clip_mode={mode!r} can push tokens away from the reference: use kl_clip_mode='truncated' (the "
                "default) or 'exact'"
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
            "of a policy running away from its reference (the runs that collapsed in the KL tables of rpg_trl's CPU "
            "benchmark). To change: "
            f"{'; '.join(advice)}. (Warned once per run; kl_drift_warning=False turns the check off.)",
            KLDriftWarning,
            stacklevel=2,
        )
        return True


class KLDriftMonitorMixin:
    """Feeds the trainer's training log entries to a [`KLDriftMonitor`] when the KL is anchored to a reference model
    with β > 0 and `args.kl_drift_warning` is on. Goes before the TRL trainer in a class line; reads `args.kl_anchor`,
    `args.beta`, `args.kl_drift_warning`, `args.kl_drift_min_kl`, the settings the warning names and the trainer's
    loss specification (`self.loss_spec`, an [`~rpg_trl.losses.RPGLossSpec`]). An asynchronous
    trainer, which has no generation batches, watches periods of [`MIN_PERIOD_STEPS`] optimizer steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.args
        #: The monitor, or None without a reference model or with `kl_drift_warning=False` (its `warned` says whether
        #: it warned).
        self.kl_drift_monitor = None
        watch = getattr(config, "kl_drift_warning", True)
        if watch and getattr(config, "kl_anchor", None) == "reference" and config.beta > 0:
            generate_every = getattr(config, "steps_per_generation", None) or 1
            generate_every *= getattr(config, "num_iterations", 1)
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
                min_kl=getattr(config, "kl_drift_min_kl", KL_FLOOR),
                kl_can_push_away=self.loss_spec.kl_can_push_away(separate_reference=True),
            )

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.kl_drift_monitor is not None:
            self.kl_drift_monitor.finish()  # the last period: no later step closes it
        return output

    def log(self, logs, start_time=None):
        if self.kl_drift_monitor is not None and self.model.training:
            # The training metrics of this logging interval (one value per micro-batch), before `log` clears them.
            metrics = self._metrics["train"]
            interval = {}
            for key, reduce in (
                ("kl", _mean),
                ("entropy", _mean),
                ("importance_weight/max", max),
                (SYNCS_METRIC, max),
            ):
                values = [v for v in metrics.get(key, ()) if math.isfinite(v)]
                if values:
                    interval[key] = reduce(values)
            if "kl" in interval:
                self.kl_drift_monitor.observe(interval, self.state.global_step)
        super().log(logs, start_time)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
