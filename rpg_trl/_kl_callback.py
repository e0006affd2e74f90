# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""[`KLFedCallback`]: the base of the callbacks that the trainer hands a KL every training micro-batch.

Each such callback joins a rule that holds the decision and its state, testable without a trainer (the adaptive KL
coefficient's [`~rpg_trl.kl_control.AdaptiveKLController`], the reference sync's
[`~rpg_trl.ref_sync.trigger.SyncTrigger`]), to a `transformers` Trainer. The rule has `observe(kl_sum, count)`,
`arguments()` (its constructor's arguments), `attributes()` (its state) and `load_attributes(attributes)`; the base
class gives the callback:

* attributes that read and write the rule's ([`rule_attribute`]): `transformers` restores an exported state with
  `setattr`, and user code reads the callback;
* [`install`] from the trainer's configuration, [`bind`] to a trainer, and [`reinstall`], which makes an instance the
  trainer's callback again after `transformers` replaced it by a copy rebuilt from its saved arguments;
* [`observe_kl`], which the trainer calls with a micro-batch's KL summed over units and processes;
* the exportable state ([`state`]: the rule's arguments and attributes, and the callback's own arguments) and
  [`stored_attributes`], which reads it back from a `TrainerState`.

The two rules share the pieces of their state and of their arguments written here once: [`load_attributes`] (the
rules' `load_attributes`) and [`check_beta_bounds`] (the adaptive coefficient's floor and ceiling, checked by the
configuration and by the controller).
"""

from __future__ import annotations

import math

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState


__all__ = ["KLFedCallback", "check_beta_bounds", "load_attributes", "rule_attribute"]


def load_attributes(rule, attributes: dict, names: tuple[str, ...], kind: str) -> None:
    """Restore an exported state of `rule` (`attributes`, read back from `trainer_state.json`): each key is one of the
    rule's exported attributes `names`, set on the rule (a list is copied, so that the rule never shares it with the
    caller). A key outside `names` raises a `ValueError` naming `kind` (e.g. ``"KL-controller"``): the state is not
    this rule's, and nothing is set."""
    unknown = set(attributes) - set(names)
    if unknown:
        raise ValueError(f"Unknown {kind} state {sorted(unknown)}; expected some of {list(names)}.")
    for key, value in attributes.items():
        setattr(rule, key, list(value) if isinstance(value, (list, tuple)) else value)


def check_beta_bounds(
    beta: float, beta_min: float | None, beta_max: float | None, names: tuple[str, str], role: str
) -> None:
    """Check the floor `beta_min` and the ceiling `beta_max` of an adaptive β (`None`: none) against each other and
    against the initial `beta`. A `ValueError` names the two bounds as the caller spells them (`names`, e.g.
    ``("kl_beta_min", "kl_beta_max")``) and says what `beta` is (`role`, e.g. ``"the initial β"``)."""
    low = 0.0 if beta_min is None else beta_min
    high = math.inf if beta_max is None else beta_max
    if low > high:
        raise ValueError(f"`{names[0]}` ({beta_min}) must be <= `{names[1]}` ({beta_max}).")
    if not low <= beta <= high:
        raise ValueError(
            f"`beta` ({role}) must lie within [{names[0]}, {names[1]}] = [{low:g}, {high:g}]; got {beta:g}."
        )


def rule_attribute(name: str, doc: str) -> property:
    """A callback attribute kept by the callback's rule (`self.rule`): reading and writing it read and write the
    rule's."""

    def set_value(self, value):
        setattr(self.rule, name, value)

    return property(lambda self: getattr(self.rule, name), set_value, doc=doc)


class KLFedCallback(TrainerCallback, ExportableState):
    """A callback fed the KL of every training micro-batch, holding a rule (module docstring).

    A subclass sets the rule (the attribute named by `rule_name`) before calling `super().__init__(trainer)`, and
    implements [`from_trainer`] (which builds it from the trainer's configuration, or returns `None` when the
    configuration does not ask for it) and [`own_arguments`] (its constructor's arguments beside the rule's).
    """

    #: The attribute that holds the rule.
    rule_name = "rule"
    #: How to attach a rebuilt callback to a trainer other than RPGTrainer (named in the error of [`require_trainer`]).
    attach_hint = "callback.bind(trainer)"

    def __init__(self, trainer=None):
        self.trainer = None
        if trainer is not None:
            self.bind(trainer)

    @property
    def rule(self):
        """The object that holds the decision and its state."""
        return getattr(self, self.rule_name)

    # ------------------------------------------------------------------------------------------------ set-up
    @classmethod
    def from_trainer(cls, trainer) -> KLFedCallback | None:
        """The callback that `trainer.args` asks for, bound to `trainer`, or `None`."""
        raise NotImplementedError

    @classmethod
    def install(cls, trainer) -> KLFedCallback | None:
        """Add the callback that `trainer.args` asks for to `trainer` ([`from_trainer`]); return it, or `None`."""
        callback = cls.from_trainer(trainer)
        if callback is not None:
            trainer.add_callback(callback)
        return callback

    def bind(self, trainer) -> None:
        """Attach the trainer."""
        self.trainer = trainer

    def reinstall(self, trainer) -> None:
        """Make this instance the trainer's callback of its class again, once, in the place of the first one, if
        transformers replaced it by a copy rebuilt from the saved arguments (`restore_callback_states_from_checkpoint=
        True`), and bind it to `trainer`."""
        callbacks = trainer.callback_handler.callbacks
        kept, placed = [], False
        for callback in callbacks:
            if not isinstance(callback, type(self)):
                kept.append(callback)
            elif not placed:
                kept.append(self)
                placed = True
        callbacks[:] = kept if placed else [*kept, self]
        self.bind(trainer)

    def require_trainer(self) -> None:
        """Raise a `RuntimeError` when no trainer is attached (the callback was rebuilt from a checkpoint)."""
        if self.trainer is None:
            name = type(self).__name__
            raise RuntimeError(
                f"{name} has no trainer: it was rebuilt from a checkpoint without `bind(trainer)`. RPGTrainer does "
                f"this itself; with another trainer call `{self.attach_hint}` before `train()`."
            )

    # ------------------------------------------------------------------------------------------------ KL
    def observe_kl(self, kl_sum, count) -> None:
        """Add one training micro-batch's KL: `kl_sum`, the estimate summed over `count` units (tokens or
        completions), both already summed over all processes (so every process sees the same values; numbers or 0-d
        tensors). A micro-batch without units or with a non-finite sum adds nothing."""
        self.rule.observe(kl_sum, count)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def own_arguments(self) -> dict:
        """The callback's constructor arguments beside the rule's."""
        return {}

    def state(self) -> dict:
        return {"args": {**self.rule.arguments(), **self.own_arguments()}, "attributes": self.rule.attributes()}

    def stored_state(self, trainer_state) -> dict | None:
        """This callback's exported state in `trainer_state.stateful_callbacks`, or `None`."""
        stored = (trainer_state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):
            stored = stored[0]
        return stored if isinstance(stored, dict) else None

    def stored_attributes(self, trainer_state) -> dict:
        """The rule's attributes exported to `trainer_state` (empty when none were)."""
        stored = self.stored_state(trainer_state)
        return dict(stored.get("attributes") or {}) if stored else {}
