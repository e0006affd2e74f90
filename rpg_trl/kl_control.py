# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""A KL budget: the adaptive KL coefficient (target KL) of Ziegler et al. (2019), on RPG's importance-weighted KL.

RPG maximises `J(θ) = E_{π_θ}[R] − β·D(π_θ, π_ref)` (paper Sec. 2-3) with a fixed β. A KL budget asks instead for the
reward under the constraint `D ≤ δ` (`kl_target`): the controller of Ziegler et al. (2019, "Fine-Tuning Language
Models from Human Preferences", Sec. 2.2), as verl (`algorithm.kl_ctrl.type: adaptive`), OpenRLHF (`--kl_target`) and
ROLL implement it, raises β while the measured divergence exceeds δ and lowers it otherwise. After each optimizer step,
with `KL` the divergence measured on that step and `n` the number of samples (completions) the step trained on:

    e = clip(KL / δ − 1, −0.2, 0.2)
    β ← clip(β · (1 + e · n / H), β_min, β_max)

`H` is the horizon (`kl_horizon`, in samples; verl's and OpenRLHF's default 10000): over `H` samples a persistent error
`e` changes β by a factor of about `exp(e)`. The update is verl's `AdaptiveKLController.update(current_kl, n_steps)`,
made once per optimizer step. It is a multiplicative dual ascent on the constraint `D ≤ δ`: β is the Lagrange
multiplier of the budget.

The KL is RPG's: the importance-weighted estimate `S` of the chosen divergence (the table of docs: *Design of the RPG
loss in rpg_trl*, "The regularised gradient": `E_old[S] = D(π_θ, π_ref)`), which measures the current policy even when
the batch was sampled by an older one (Sec. 3). It is the KL that the loss names as the one β weighs
([`~rpg_trl.losses.RPGLossSpec.controlled_kl`]): with `kl_level="token"` the logged `kl` (token mean over the step's
micro-batches and all processes); with `kl_level="sequence"` `kl/sequence` (the whole-completion estimate, averaged
over the step's completions), and the target is then a KL per completion.

[`KLControlArguments`] holds the configuration's fields (`kl_target`, `kl_horizon`, `kl_beta_min`, `kl_beta_max`);
[`AdaptiveKLController`] holds the rule and its state (plain Python, testable without a trainer);
[`AdaptiveKLCallback`] runs it inside a `transformers` Trainer: it writes β into the trainer's loss specification
(`trainer.rpg_beta`), which the loss reads at every micro-batch, logs `beta`, and exports its state to each checkpoint's
`trainer_state.json`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from transformers.utils import logging

from ._kl_callback import KLFedCallback, check_beta_bounds, load_attributes, rule_attribute
from .losses.kl import CONTROLLED_KL, ControlledKL


__all__ = [
    "KL_ERROR_CLIP",
    "AdaptiveKLCallback",
    "AdaptiveKLController",
    "KLControlArguments",
    "check_kl_control_arguments",
]

logger = logging.get_logger(__name__)

#: The proportional error is clipped to ±0.2 (Ziegler et al., 2019; verl; OpenRLHF).
KL_ERROR_CLIP = 0.2
#: The horizon H (in samples) when `kl_horizon` is None: verl's and OpenRLHF's default.
DEFAULT_HORIZON = 10000.0
#: The state exported to `trainer_state.json`.
STATE_ATTRIBUTES = ("beta", "last_kl", "num_updates")


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        suffix = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be a finite number > 0{suffix}; got {value!r}.")


def check_kl_control_arguments(
    beta: float,
    kl_target: float | None,
    kl_horizon: float | None,
    kl_beta_min: float | None,
    kl_beta_max: float | None,
    samples_per_step: int,
) -> float | None:
    """Check a configuration's KL-budget fields (`ValueError` naming the field, the allowed values and the fix) and
    return the horizon to use: `kl_horizon`, or 10000 when `kl_target` is set and `kl_horizon` is None.
    `samples_per_step`: the samples of one optimizer step (per_device_train_batch_size × gradient_accumulation_steps ×
    processes)."""
    fields = {"kl_target": kl_target, "kl_horizon": kl_horizon, "kl_beta_min": kl_beta_min, "kl_beta_max": kl_beta_max}
    if kl_target is None:
        for name, value in fields.items():
            if value is not None:
                raise ValueError(
                    f"`{name}` sets the adaptive KL coefficient, which only acts with `kl_target`; set `kl_target` "
                    f"(the KL to hold) or leave `{name}` unset."
                )
        return kl_horizon
    for name, value in fields.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < math.inf
        ):
            raise ValueError(f"`{name}` must be a finite number > 0 or None; got {value!r}.")
    horizon = DEFAULT_HORIZON if kl_horizon is None else kl_horizon
    if beta == 0.0:
        raise ValueError(
            "`kl_target` needs `beta > 0`: `beta` is the initial coefficient of the adaptive controller, which "
            "multiplies it and so cannot leave 0. Set `beta` to a starting value (the paper uses 1e-4)."
        )
    check_beta_bounds(
        beta,
        kl_beta_min,
        kl_beta_max,
        ("kl_beta_min", "kl_beta_max"),
        "the initial coefficient of the adaptive controller",
    )
    if not horizon > KL_ERROR_CLIP * samples_per_step:
        raise ValueError(
            f"`kl_horizon` must exceed {KL_ERROR_CLIP} × the samples of an optimizer step ({samples_per_step} = "
            "per_device_train_batch_size × gradient_accumulation_steps × processes): the controller multiplies β "
            f"by 1 + e·{samples_per_step}/kl_horizon with e >= −{KL_ERROR_CLIP}, which must stay > 0; got {horizon!r}."
        )
    return horizon


@dataclass
class KLControlArguments:
    """The configuration fields of a KL budget, the adaptive KL coefficient of Ziegler et al. (2019) (this module), as
    verl (`algorithm.kl_ctrl.type: adaptive`), OpenRLHF (`--kl_target`, `--kl_horizon`) and ROLL offer it, as a mixin
    of a `GRPOConfig` subclass. Shared by [`~rpg_trl.RPGConfig`] and the asynchronous trainer's configuration (which
    refuses it); [`AdaptiveKLCallback`] reads them."""

    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Target δ of the adaptive KL coefficient. After each optimizer step β is multiplied by "
            "1 + clip(KL/δ − 1, −0.2, 0.2)·n/kl_horizon (n: the samples of the step), where KL is RPG's "
            "importance-weighted estimate of the chosen divergence (the logged `kl`, or `kl/sequence` with "
            "kl_level='sequence'); `beta` is the initial β. None (default): a fixed β."
        },
    )
    kl_horizon: float | None = field(
        default=None,
        metadata={
            "help": "Horizon H of the adaptive KL coefficient, in samples: a persistent error e changes β by a factor "
            "of about exp(e) over H samples. Only with kl_target; None (default) gives 10000 (verl's and OpenRLHF's "
            "default)."
        },
    )
    kl_beta_min: float | None = field(
        default=None,
        metadata={"help": "Floor of the adaptive β (> 0). Only with kl_target; None (default): no floor."},
    )
    kl_beta_max: float | None = field(
        default=None,
        metadata={"help": "Ceiling of the adaptive β. Only with kl_target; None (default): no ceiling."},
    )

    def check_kl_control_arguments(self) -> None:
        """Validate the KL-budget fields ([`check_kl_control_arguments`]); `kl_horizon` None
        becomes 10000 when `kl_target` is set."""
        self.kl_horizon = check_kl_control_arguments(
            self.beta,
            self.kl_target,
            self.kl_horizon,
            self.kl_beta_min,
            self.kl_beta_max,
            samples_per_step=self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size,
        )


class AdaptiveKLController:
    r"""
    The proportional KL controller (Ziegler et al., 2019, Sec. 2.2; verl's `AdaptiveKLController`), with a floor and a
    ceiling: after an optimizer step that measured the divergence `kl` on `n_samples` samples,
    `β ← clip(β·(1 + clip(kl/target − 1, −0.2, 0.2)·n_samples/horizon), beta_min, beta_max)`.

    Args:
        beta (`float`):
            Initial β > 0 (a multiplicative update cannot leave 0).
        target (`float`):
            δ > 0, the divergence to hold.
        horizon (`float`, *optional*, defaults to `10000`):
            H > 0, in samples: the update multiplies β by at most `1 ± 0.2·n_samples/H`.
        beta_min, beta_max (`float`, *optional*):
            Floor and ceiling of β (`None`: none). `beta` must lie within them.
    """

    def __init__(
        self,
        beta: float,
        target: float,
        horizon: float = 10000.0,
        beta_min: float | None = None,
        beta_max: float | None = None,
    ):
        _positive("beta", beta)
        _positive("target", target)
        _positive("horizon", horizon)
        _positive("beta_min", beta_min, allow_none=True)
        _positive("beta_max", beta_max, allow_none=True)
        check_beta_bounds(beta, beta_min, beta_max, ("beta_min", "beta_max"), "the initial β")
        self.initial_beta = float(beta)
        self.target = float(target)
        self.horizon = float(horizon)
        self.beta_min = beta_min
        self.beta_max = beta_max
        #: The current coefficient.
        self.beta = float(beta)
        #: The divergence of the last update (`None` before the first).
        self.last_kl: float | None = None
        self.num_updates = 0
        # The KL of the optimizer step in progress, summed over its units (tokens or completions).
        self._kl_sum = 0.0
        self._kl_count = 0.0

    def observe(self, kl_sum, count) -> None:
        """Add one micro-batch's KL: the estimate summed over `count` units (numbers or 0-d tensors). A micro-batch
        without units or with a non-finite sum adds nothing."""
        kl_sum, count = float(kl_sum), float(count)
        if count > 0 and math.isfinite(kl_sum):
            self._kl_sum += kl_sum
            self._kl_count += count

    def step_kl(self) -> float | None:
        """The divergence observed since the last [`discard_step`] (`None`: nothing observed)."""
        return self._kl_sum / self._kl_count if self._kl_count > 0 else None

    def discard_step(self) -> None:
        """Forget the KL observed so far (the step ended, or training starts)."""
        self._kl_sum = self._kl_count = 0.0

    def update(self, kl: float, n_samples: int) -> float:
        """Move β after an optimizer step that measured the divergence `kl` on `n_samples` samples; return the new β.
        A non-finite `kl` leaves β unchanged."""
        kl = float(kl)
        if not math.isfinite(kl):
            return self.beta
        error = min(max(kl / self.target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
        beta = self.beta * (1.0 + error * n_samples / self.horizon)
        if self.beta_min is not None:
            beta = max(beta, self.beta_min)
        if self.beta_max is not None:
            beta = min(beta, self.beta_max)
        if not beta > 0.0:
            raise ValueError(
                f"The KL controller's update made β = {beta} <= 0 ({n_samples} samples per update with horizon "
                f"{self.horizon:g}): the horizon must exceed {KL_ERROR_CLIP} × the samples per update."
            )
        self.beta = beta
        self.last_kl = kl
        self.num_updates += 1
        return beta

    def arguments(self) -> dict:
        return {
            "beta": self.initial_beta,
            "target": self.target,
            "horizon": self.horizon,
            "beta_min": self.beta_min,
            "beta_max": self.beta_max,
        }

    def attributes(self) -> dict:
        """The state to export (`trainer_state.json`): [`STATE_ATTRIBUTES`]."""
        return {"beta": self.beta, "last_kl": self.last_kl, "num_updates": self.num_updates}

    def load_attributes(self, attributes: dict) -> None:
        """Restore an exported state; refuses unknown keys (a state that is not this controller's)."""
        load_attributes(self, attributes, STATE_ATTRIBUTES, "KL-controller")


class AdaptiveKLCallback(KLFedCallback):
    r"""
    Runs [`AdaptiveKLController`] in an [`~rpg_trl.RPGTrainer`]: the trainer hands it the KL that β weighs of every
    training micro-batch ([`~rpg_trl.losses.RPGLossSpec.controlled_kl`]: the per-token estimate summed over tokens, or
    with `kl_level="sequence"` the whole-completion estimate summed over completions), summed over all processes
    ([`observe_kl`](KLFedCallback.observe_kl)); at the end of each optimizer step it updates β from the step's mean
    divergence and `n` = `per_device_train_batch_size × gradient_accumulation_steps × processes` samples, and sets
    `trainer.rpg_beta`, which the next step's loss uses. Every process computes the same β from the same reduced
    sums. `beta` (the coefficient the step's loss used) and `kl_control/kl` (the divergence the controller saw) are
    logged at every step.

    The state (β, the last KL, the number of updates) is exported to each checkpoint's `trainer_state.json`
    (`stateful_callbacks`) and restored from it when training resumes, whatever `restore_callback_states_from_checkpoint`
    says. [`install`](KLFedCallback.install) creates it from the configuration (`kl_target`, `kl_horizon`,
    `kl_beta_min`, `kl_beta_max`) and takes its KL level from the trainer's loss specification, whose
    `controlled_kl` is what the trainer feeds it: one source for the KL that β weighs.

    Args:
        trainer ([`~rpg_trl.RPGTrainer`], *optional*):
            The trainer whose β to control. `None` only while transformers rebuilds the callback from a checkpoint.
        beta, target, horizon, beta_min, beta_max:
            The [`AdaptiveKLController`]'s.
        level (`str`, *optional*, defaults to `"token"`):
            The KL level of the divergence it is fed (`kl_level`): `"token"`, the per-token estimate (`kl`);
            `"sequence"`, the whole-completion estimate (`kl/sequence`). Recorded with its state; a trainer it is bound
            to must feed it this level's KL ([`controlled_kl`]).
    """

    rule_name = "controller"
    attach_hint = "callback.reinstall(trainer)"

    beta = rule_attribute("beta", "The current β.")
    last_kl = rule_attribute("last_kl", "The divergence of the last update.")
    num_updates = rule_attribute("num_updates", "Number of updates so far.")

    def __init__(
        self,
        trainer=None,
        beta: float = 1e-4,
        target: float = 0.1,
        horizon: float = 10000.0,
        beta_min: float | None = None,
        beta_max: float | None = None,
        level: str = "token",
    ):
        if level not in CONTROLLED_KL:
            raise ValueError(f"`level` must be one of {', '.join(map(repr, CONTROLLED_KL))}; got {level!r}.")
        self.controller = AdaptiveKLController(beta, target, horizon, beta_min=beta_min, beta_max=beta_max)
        self.level = level
        super().__init__(trainer)

    @classmethod
    def from_trainer(cls, trainer) -> AdaptiveKLCallback | None:
        """The callback when `trainer.args.kl_target` is set, else `None`."""
        args = trainer.args
        if getattr(args, "kl_target", None) is None:
            return None
        return cls(
            trainer,
            beta=args.beta,
            target=args.kl_target,
            horizon=args.kl_horizon,
            beta_min=args.kl_beta_min,
            beta_max=args.kl_beta_max,
            level=trainer.loss_spec.kl_level,  # the level of `loss_spec.controlled_kl`, the KL the trainer feeds
        )

    @property
    def controlled_kl(self) -> ControlledKL:
        """The KL it is fed, as the loss's metrics name it: the [`~rpg_trl.losses.RPGLossSpec.controlled_kl`] of its
        level."""
        return CONTROLLED_KL[self.level]

    def bind(self, trainer) -> None:
        """Attach the trainer, which must feed the KL of this callback's level: its loss specification's
        `controlled_kl` ([`controlled_kl`]); a `ValueError` otherwise."""
        spec = getattr(trainer, "loss_spec", None)
        if spec is not None and spec.controlled_kl != self.controlled_kl:
            raise ValueError(
                f"AdaptiveKLCallback(level={self.level!r}) holds {self.controlled_kl.metric!r}, but the trainer feeds "
                f"{spec.controlled_kl.metric!r} (its loss has kl_level={spec.kl_level!r}): build the callback with "
                f"level={spec.kl_level!r}, or with `AdaptiveKLCallback.install(trainer)`."
            )
        super().bind(trainer)

    def step_kl(self) -> float | None:
        """The divergence observed since the last optimizer step (`None`: nothing observed)."""
        return self.controller.step_kl()

    # ------------------------------------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        self.require_trainer()
        self.controller.discard_step()
        # A new run starts from the configured β; a resumed one from the β of its checkpoint.
        self.controller.load_attributes({"beta": self.controller.initial_beta, "last_kl": None, "num_updates": 0})
        if state.global_step > 0:
            stored = self.stored_attributes(state)
            if stored:
                self.controller.load_attributes(stored)
            else:
                logger.warning(
                    f"Resuming at step {state.global_step} from a checkpoint without the KL controller's state "
                    f"(AdaptiveKLCallback): β restarts from beta = {self.controller.initial_beta:g}."
                )
                state.stateful_callbacks[type(self).__name__] = self.state()  # where the next checkpoint writes it
        self.trainer.rpg_beta = self.controller.beta

    def on_step_end(self, args, state, control, **kwargs):
        used = self.controller.beta
        kl = self.controller.step_kl()
        self.controller.discard_step()
        if kl is not None:
            n_samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
            n_samples *= self.trainer.accelerator.num_processes
            self.trainer.rpg_beta = self.controller.update(kl, n_samples)
        metrics = self.trainer._metrics["train"]
        metrics["beta"] = [used]  # the coefficient this step's loss used, whatever the logging interval
        if kl is not None:
            metrics["kl_control/kl"] = [kl]

    # ------------------------------------------------------------------------------------------------ checkpoints
    def own_arguments(self) -> dict:
        return {"level": self.level}
