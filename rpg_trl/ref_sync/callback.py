# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Iterative reference updates (the paper, Sec. 5): re-sync π_ref ← π_θ when the KL to π_ref drifts past κ.

The paper's runs anchor the KL to the sampling policy, which moves every generation (`kl_anchor="sampling"`). With a
separate reference (`kl_anchor="reference"`), [`RefModelSyncCallback`] keeps the reference close to the policy: it
tracks an exponential moving average of the token KL between π_θ and π_ref that the trainer already computes on its
training batches (reduced over all processes), and sets `π_ref ← α·π_θ + (1 − α)·π_ref` when that average exceeds
`ref_model_sync_kl_threshold` (κ) and/or every `ref_model_sync_steps` steps (TRL's TR-DPO option).

The callback only joins two parts: [`rpg_trl.ref_sync.trigger.SyncTrigger`] decides when to sync (testable without a
trainer) and [`rpg_trl.ref_sync.weights`] moves, saves and restores the weights on each backend (plain, DDP, DeepSpeed
ZeRO-2/3 one parameter pair at a time, FSDP) or, with PEFT, the frozen "ref" adapter (a copy of the trained adapter;
no second base model is held).
"""

from __future__ import annotations

import os

from transformers.utils import logging
from trl.trainer.callbacks import SyncRefModelCallback

from .._kl_callback import KLFedCallback, rule_attribute
from . import weights
from .trigger import SyncTrigger, broadcast_from_main
from .weights import REF_ADAPTER, REFERENCE_FILE


__all__ = ["REFERENCE_FILE", "REF_ADAPTER", "RefModelSyncCallback"]

logger = logging.get_logger(__name__)


class RefModelSyncCallback(KLFedCallback):
    r"""
    Moves the KL anchor π_ref to the policy π_θ during training (the separate-reference variant of the paper's
    "iterative reference update", Sec. 5).

    After every optimizer step the token KL between π_θ and π_ref measured on that step's training batches (the
    trainer's `kl` metric: the divergence the user chose, token-weighted over the gradient-accumulation micro-batches
    and all processes) updates the moving average `m ← γ·m + (1 − γ)·KL` (`m` starts at the first KL after each
    sync). A sync `π_ref ← α·π_θ + (1 − α)·π_ref` happens when `m > kl_threshold` (κ) or when `sync_steps` steps
    have passed since the previous sync, and only where the next step generates (and scores with π_ref) a fresh batch,
    so that buffered batches never mix two references. Every process takes the decision of the main process. The
    moving average restarts after a sync, so `ref/kl` (logged: the moving average at that step) drops after each sync;
    `ref/syncs` counts the syncs. The decision is [`~rpg_trl.ref_sync.trigger.SyncTrigger`]'s (`self.trigger`); the
    weights move with [`rpg_trl.ref_sync.weights`].

    The state (moving average, last sync step, number and steps of the syncs) is exported to each checkpoint's
    `trainer_state.json`; [`save_checkpoint`] and [`load_checkpoint`] save and restore the synced reference weights
    (`rpg_reference.safetensors`). [`~rpg_trl.RPGTrainer`] installs the callback (see [`install`]), feeds it the KL
    and calls both.

    Args:
        trainer ([`~rpg_trl.RPGTrainer`], *optional*):
            The trainer whose `ref_model` (or "ref" adapter) to sync. `None` only while transformers rebuilds the
            callback from a checkpoint; [`bind`] attaches it.
        kl_threshold (`float`, *optional*):
            κ > 0: sync when the moving average of the token KL exceeds it. `None`: no KL trigger.
        kl_ema (`float`, *optional*, defaults to `0.9`):
            γ ∈ [0, 1): weight of the previous average (0 uses the last step's KL alone).
        sync_steps (`int`, *optional*):
            Sync at the latest every `sync_steps` optimizer steps. `None`: no periodic trigger.
        mixup_alpha (`float`, *optional*, defaults to `1.0`):
            α ∈ (0, 1]: weight of the policy in a sync. 1 copies the policy.
    """

    kl_threshold = rule_attribute("kl_threshold", "κ (see `SyncTrigger`).")
    kl_ema = rule_attribute("kl_ema", "γ (see `SyncTrigger`).")
    sync_steps = rule_attribute("sync_steps", "Periodic trigger (see `SyncTrigger`).")
    kl_moving_average = rule_attribute("kl_moving_average", "Moving average of the token KL since the last sync.")
    last_sync_step = rule_attribute("last_sync_step", "Optimizer step of the last sync.")
    num_syncs = rule_attribute("num_syncs", "Number of syncs so far.")
    sync_history = rule_attribute("sync_history", "Optimizer steps of the syncs.")

    rule_name = "trigger"

    def __init__(
        self,
        trainer=None,
        kl_threshold: float | None = None,
        kl_ema: float = 0.9,
        sync_steps: int | None = None,
        mixup_alpha: float = 1.0,
    ):
        self.trigger = SyncTrigger(kl_threshold=kl_threshold, kl_ema=kl_ema, sync_steps=sync_steps)
        if not 0.0 < mixup_alpha <= 1.0:
            raise ValueError(f"`mixup_alpha` must be in (0, 1]; got {mixup_alpha}.")
        self.mixup_alpha = mixup_alpha
        self._reference_restored = False
        self._warned_nothing_to_sync = False
        super().__init__(trainer)

    # ------------------------------------------------------------------------------------------------ set-up
    @classmethod
    def from_trainer(cls, trainer) -> RefModelSyncCallback | None:
        """The callback when `trainer.args` (`RPGConfig`) asks for it with `sync_ref_model` or
        `ref_model_sync_kl_threshold`, in place of TRL's `SyncRefModelCallback` (removed from `trainer`), else `None`.
        [`install`](KLFedCallback.install) adds it to the trainer.

        With PEFT, a frozen "ref" adapter copied from the trained adapter becomes the reference if none exists (TRL
        makes one only for an already-PEFT model; with `peft_config` it evaluates the reference with the adapter
        disabled, which a sync could not move). While the trained adapter is freshly initialised (zero LoRA B) the
        copy equals the base model, so the reference is unchanged.
        """
        args = trainer.args
        threshold = getattr(args, "ref_model_sync_kl_threshold", None)
        if not args.sync_ref_model and threshold is None:
            return None
        # GRPOTrainer adds its own (periodic, full-model only) sync when it sees `sync_ref_model`; this one replaces
        # it (RPGTrainer already hides the flag from GRPOTrainer, which would reject it with PEFT).
        trainer.remove_callback(SyncRefModelCallback)
        return cls(
            trainer,
            kl_threshold=threshold,
            kl_ema=getattr(args, "ref_model_sync_kl_ema", 0.9),
            sync_steps=args.ref_model_sync_steps if args.sync_ref_model else None,
            # TRL applies `ref_model_mixup_alpha` only with `sync_ref_model=True`; a KL-triggered sync alone copies.
            mixup_alpha=args.ref_model_mixup_alpha if args.sync_ref_model else 1.0,
        )

    def bind(self, trainer) -> None:
        """Attach the trainer (and make this callback the one that receives the trainer's KL)."""
        super().bind(trainer)
        trainer.ref_sync_callback = self
        if self.has_reference():
            peft_model = weights.peft_model_of(trainer)
            if peft_model is not None and REF_ADAPTER not in peft_model.peft_config:
                weights.add_ref_adapter(trainer, peft_model)

    def has_reference(self) -> bool:
        """Whether there is a reference to sync; says once (warning) when there is none."""
        trainer = self.trainer
        reason = None
        if getattr(trainer.args, "kl_anchor", "reference") == "sampling":
            reason = (
                "kl_anchor='sampling' anchors the KL to the policy that sampled each batch, which moves every "
                "generation already (the paper's iterative reference update)"
            )
        elif trainer.ref_model is None and weights.peft_model_of(trainer) is None:
            reason = "the trainer holds no reference model (beta == 0)"
        if reason is None:
            return True
        if not self._warned_nothing_to_sync:
            logger.warning(f"RefModelSyncCallback: nothing to sync: {reason}. The callback does nothing.")
            self._warned_nothing_to_sync = True
        return False

    # ------------------------------------------------------------------------------------------------ decision
    def on_train_begin(self, args, state, control, **kwargs):
        self.require_trainer()
        synced_before = self.stored_attributes(state).get("num_syncs", 0) > 0
        if state.global_step > 0 and synced_before and not self._reference_restored:
            raise RuntimeError(
                "Resuming from a checkpoint taken after reference syncs, but the synced reference was not "
                "restored: training would silently anchor the KL to the initial model. Resume with RPGTrainer, "
                "or call `RefModelSyncCallback.load_checkpoint(trainer, checkpoint)` before training."
            )
        self.trigger.start(state.global_step)
        self.has_reference()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.has_reference():
            self.trigger.discard_step()
            return
        reason = self.trigger.end_step(state.global_step, self._at_generation_boundary())
        do_sync = self.trigger.agree(reason is not None, broadcast_from_main(self.trainer.accelerator))
        logged_kl = self.trigger.kl_moving_average
        if do_sync:
            self.sync()
            self.trigger.record_sync(state.global_step)
            if self.trainer.accelerator.is_main_process:
                logger.info(
                    f"Step {state.global_step}: synced the reference to the policy (α = {self.mixup_alpha:g}; "
                    f"{reason or 'decision of the main process'}); {self.num_syncs} sync(s) so far."
                )
        metrics = self.trainer._metrics["train"]
        metrics["ref/syncs"] = [float(self.num_syncs)]
        if logged_kl is not None:
            metrics["ref/kl"] = [logged_kl]  # the value at this step, whatever the logging interval

    def _at_generation_boundary(self) -> bool:
        # GRPOTrainer scores a generation batch with π_ref once and reuses it for steps_per_generation *
        # num_iterations micro-batches; a sync inside that window would mix two references.
        trainer = self.trainer
        generate_every = trainer.args.steps_per_generation * getattr(trainer, "num_iterations", 1)
        return getattr(trainer, "_step", 0) % generate_every == 0

    def sync(self, alpha: float | None = None) -> None:
        """Set π_ref ← α·π_θ + (1 − α)·π_ref now (α defaults to `mixup_alpha`). Collective: call on every process."""
        weights.sync_reference(self.trainer, self.mixup_alpha if alpha is None else alpha)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def own_arguments(self) -> dict:
        return {"mixup_alpha": self.mixup_alpha}

    def save_checkpoint(self, trainer, trial=None) -> None:
        """Save the synced reference into the checkpoint folder that `trainer._save_checkpoint` is about to write."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from ..reliability.checkpoints import CommittedCheckpointsMixin, mark_being_written

        checkpoint = os.path.join(
            trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        )
        if isinstance(trainer, CommittedCheckpointsMixin) and self.num_syncs > 0 and self.has_reference():
            mark_being_written(trainer, checkpoint)  # the reference is written before the rest of the save
        self.save_reference(checkpoint)

    def save_reference(self, output_dir: str) -> None:
        """Write the synced reference into the checkpoint folder `output_dir` (nothing before the first sync: the
        reference is then the initial model, which a resumed trainer rebuilds). Only the main process holds a copy.
        Collective: call on every process."""
        if self.num_syncs == 0 or not self.has_reference():
            return
        weights.save_reference(self.trainer, output_dir)

    def load_checkpoint(self, trainer, checkpoint: str) -> None:
        """Restore, when resuming from `checkpoint`, the callback state (from `trainer.state`, loaded from the
        checkpoint's `trainer_state.json`) and the synced reference weights, on every process. Makes this instance the
        trainer's callback again if transformers replaced it by a copy rebuilt from the saved arguments
        (`restore_callback_states_from_checkpoint=True`); restores the state whatever that flag says, since the
        reference weights are always restored."""
        self.reinstall(trainer)
        name = type(self).__name__
        stored = self.stored_state(trainer.state)
        if stored:
            self.trigger.load_attributes(stored.get("attributes", {}))
        else:
            trainer.state.stateful_callbacks[name] = self.state()  # checkpoint taken before the callback existed
        self._reference_restored = True
        if self.num_syncs == 0 or not self.has_reference():
            return
        path = os.path.join(checkpoint, REFERENCE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"The checkpoint {checkpoint} records {self.num_syncs} reference sync(s) but has no {REFERENCE_FILE}: "
                "the synced reference cannot be restored. Resume from a checkpoint written by RPGTrainer."
            )
        weights.load_reference(trainer, path)
        logger.info(f"Restored the reference synced at step {self.last_sync_step} from {path}.")
