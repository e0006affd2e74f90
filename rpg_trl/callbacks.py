# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Iterative reference updates (RPG_SPEC §5): re-sync π_ref ← π_θ when the KL to π_ref drifts past κ.

The paper's runs anchor the KL to the sampling policy, which moves every generation (`kl_anchor="sampling"`). With a
separate reference (`kl_anchor="reference"`), [`RefModelSyncCallback`] keeps the reference close to the policy: it
tracks an exponential moving average of the token KL between π_θ and π_ref that the trainer already computes on its
training batches (reduced over all processes), and sets `π_ref ← α·π_θ + (1 − α)·π_ref` when that average exceeds
`ref_model_sync_kl_threshold` (κ) and/or every `ref_model_sync_steps` steps (TRL's TR-DPO option). It syncs a full
reference model (plain, DDP, DeepSpeed ZeRO-2/3 through TRL's `SyncRefModelCallback.sync_target_model`, FSDP) or,
with PEFT, the frozen "ref" adapter (a copy of the trained adapter; no second base model is held).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext

import torch
from accelerate.utils import broadcast
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging
from trl.distributed import DistributedBackend
from trl.trainer.callbacks import SyncRefModelCallback


logger = logging.get_logger(__name__)

#: Name of the PEFT adapter that serves as the reference (the name TRL's GRPOTrainer looks for).
REF_ADAPTER = "ref"
#: File, inside each checkpoint folder, holding the synced reference (full model parameters or "ref" adapter).
REFERENCE_FILE = "rpg_reference.safetensors"


class RefModelSyncCallback(TrainerCallback, ExportableState):
    r"""
    Moves the KL anchor π_ref to the policy π_θ during training (the separate-reference variant of the paper's
    "iterative reference update", Sec. 5; RPG_SPEC §5).

    After every optimizer step the token KL between π_θ and π_ref measured on that step's training batches (the
    trainer's `kl` metric: the divergence the user chose, token-weighted over the gradient-accumulation micro-batches
    and all processes) updates the moving average `m ← γ·m + (1 − γ)·KL` (`m` starts at the first KL after each
    sync). A sync `π_ref ← α·π_θ + (1 − α)·π_ref` happens when `m > kl_threshold` (κ) or when `sync_steps` steps
    have passed since the previous sync, and only where the next step generates (and scores with π_ref) a fresh batch,
    so that buffered batches never mix two references. Every process takes the decision of the main process. The
    moving average restarts after a sync, so `ref/kl` (logged: the moving average at that step) drops after each sync;
    `ref/syncs` counts the syncs.

    The state (moving average, last sync step, number and steps of the syncs) is exported to each checkpoint's
    `trainer_state.json`; [`save_reference`] and [`load_checkpoint`] save and restore the synced reference weights.
    [`~rpg_trl.RPGTrainer`] installs the callback (see [`install`]), feeds it the KL and calls both.

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

    def __init__(
        self,
        trainer=None,
        kl_threshold: float | None = None,
        kl_ema: float = 0.9,
        sync_steps: int | None = None,
        mixup_alpha: float = 1.0,
    ):
        if kl_threshold is not None and not kl_threshold > 0:
            raise ValueError(f"`kl_threshold` (κ) must be > 0 or None; got {kl_threshold}.")
        if not 0.0 <= kl_ema < 1.0:
            raise ValueError(f"`kl_ema` must be in [0, 1); got {kl_ema}.")
        if sync_steps is not None and sync_steps < 1:
            raise ValueError(f"`sync_steps` must be >= 1 or None; got {sync_steps}.")
        if not 0.0 < mixup_alpha <= 1.0:
            raise ValueError(f"`mixup_alpha` must be in (0, 1]; got {mixup_alpha}.")
        self.kl_threshold = kl_threshold
        self.kl_ema = kl_ema
        self.sync_steps = sync_steps
        self.mixup_alpha = mixup_alpha
        # Exported state (`state()`), restored on resume.
        self.kl_moving_average: float | None = None
        self.last_sync_step = 0
        self.num_syncs = 0
        self.sync_history: list[int] = []
        # Token-weighted KL of the optimizer step in progress (global sums, identical on every process).
        self._kl_sum = 0.0
        self._kl_tokens = 0.0
        self._reference_restored = False
        self._warned_nothing_to_sync = False
        self.trainer = None
        if trainer is not None:
            self.bind(trainer)

    # ------------------------------------------------------------------------------------------------ set-up
    @classmethod
    def install(cls, trainer) -> RefModelSyncCallback | None:
        """Install the callback from `trainer.args` (`RPGConfig`) when `sync_ref_model` or
        `ref_model_sync_kl_threshold` asks for it, in place of TRL's `SyncRefModelCallback`; return it, or `None`.

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
        callback = cls(
            trainer,
            kl_threshold=threshold,
            kl_ema=getattr(args, "ref_model_sync_kl_ema", 0.9),
            sync_steps=args.ref_model_sync_steps if args.sync_ref_model else None,
            # TRL applies `ref_model_mixup_alpha` only with `sync_ref_model=True`; a KL-triggered sync alone copies.
            mixup_alpha=args.ref_model_mixup_alpha if args.sync_ref_model else 1.0,
        )
        trainer.add_callback(callback)
        return callback

    def bind(self, trainer) -> None:
        """Attach the trainer (and make this callback the one that receives the trainer's KL)."""
        self.trainer = trainer
        trainer.ref_sync_callback = self
        if self.has_reference():
            peft_model = self._peft_model()
            if peft_model is not None and REF_ADAPTER not in peft_model.peft_config:
                self._add_ref_adapter(peft_model)

    def has_reference(self) -> bool:
        """Whether there is a reference to sync; says once (warning) when there is none."""
        trainer = self.trainer
        reason = None
        if getattr(trainer.args, "kl_anchor", "reference") == "sampling":
            reason = (
                "kl_anchor='sampling' anchors the KL to the policy that sampled each batch, which moves every "
                "generation already (the paper's iterative reference update)"
            )
        elif trainer.ref_model is None and self._peft_model() is None:
            reason = "the trainer holds no reference model (beta == 0)"
        if reason is None:
            return True
        if not self._warned_nothing_to_sync:
            logger.warning(f"RefModelSyncCallback: nothing to sync: {reason}. The callback does nothing.")
            self._warned_nothing_to_sync = True
        return False

    def _peft_model(self):
        from accelerate.utils import is_peft_model

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        return model if is_peft_model(model) else None

    def _add_ref_adapter(self, peft_model) -> None:
        import peft
        from packaging.version import Version

        trained = peft_model.active_adapter
        config = peft_model.peft_config[trained]
        if getattr(config, "target_parameters", None) and Version(peft.__version__) < Version("0.20.0"):
            raise ValueError(
                f"PEFT {peft.__version__} cannot hold a second adapter next to one that uses `target_parameters` "
                f"(peft#3340), so the '{REF_ADAPTER}' adapter that a reference sync moves cannot be created. Upgrade "
                "to peft>=0.20.0, or unset `sync_ref_model` / `ref_model_sync_kl_threshold`."
            )
        peft_model.add_adapter(REF_ADAPTER, config)
        peft_model.set_adapter(trained)  # keeps the trained adapter trainable and the new one frozen
        trained_params, ref_params = _adapter_parameters(peft_model)
        if any(hasattr(p, "ds_id") for p in trained_params + ref_params):
            self._sync_adapter(alpha=1.0)  # already ZeRO-3-partitioned
        else:
            with torch.no_grad():  # before DeepSpeed/FSDP wrap the model: a plain copy on every process
                for param, ref_param in zip(trained_params, ref_params, strict=True):
                    ref_param.copy_(param)
        for param in ref_params:
            param.requires_grad_(False)
        logger.info(f"RefModelSyncCallback: created the frozen '{REF_ADAPTER}' adapter (a copy of '{trained}').")

    # ------------------------------------------------------------------------------------------------ KL and decision
    def observe_kl(self, kl_sum, num_tokens) -> None:
        """Add one training micro-batch's KL: `kl_sum` = Σ_tokens KL and `num_tokens`, both already summed over all
        processes (so every process sees the same values)."""
        kl_sum, num_tokens = float(kl_sum), float(num_tokens)
        if num_tokens > 0 and math.isfinite(kl_sum):
            self._kl_sum += kl_sum
            self._kl_tokens += num_tokens

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "RefModelSyncCallback has no trainer: it was rebuilt from a checkpoint without `bind(trainer)`. "
                "RPGTrainer does this itself; with another trainer call `callback.bind(trainer)` before `train()`."
            )
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        synced_before = isinstance(stored, dict) and stored.get("attributes", {}).get("num_syncs", 0) > 0
        if state.global_step > 0 and synced_before and not self._reference_restored:
            raise RuntimeError(
                "Resuming from a checkpoint taken after reference syncs, but the synced reference was not "
                "restored: training would silently anchor the KL to the initial model. Resume with RPGTrainer, "
                "or call `RefModelSyncCallback.load_checkpoint(trainer, checkpoint)` before training."
            )
        self._kl_sum = self._kl_tokens = 0.0
        self.last_sync_step = min(self.last_sync_step, state.global_step)  # a new `train()` restarts the step count
        self.has_reference()

    def on_step_end(self, args, state, control, **kwargs):
        kl = self._kl_sum / self._kl_tokens if self._kl_tokens > 0 else None
        self._kl_sum = self._kl_tokens = 0.0
        if not self.has_reference():
            return
        if kl is not None:
            m = self.kl_moving_average
            self.kl_moving_average = kl if m is None else self.kl_ema * m + (1.0 - self.kl_ema) * kl
        reason = None
        if self._at_generation_boundary():
            if self.sync_steps is not None and state.global_step - self.last_sync_step >= self.sync_steps:
                reason = f"{state.global_step - self.last_sync_step} steps since the last sync"
            elif (
                self.kl_threshold is not None
                and self.kl_moving_average is not None
                and self.kl_moving_average > self.kl_threshold
            ):
                reason = f"ref/kl = {self.kl_moving_average:.4g} > κ = {self.kl_threshold:g}"
        do_sync = self._agree(reason is not None)
        logged_kl = self.kl_moving_average
        if do_sync:
            self.sync()
            self.num_syncs += 1
            self.last_sync_step = state.global_step
            self.sync_history.append(state.global_step)
            self.kl_moving_average = None  # π_ref moved: the KL to the old one says nothing about the new one
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

    def _agree(self, decision: bool) -> bool:
        """Every process adopts the main process's decision and moving average (they already agree, since the KL is
        reduced over processes; the broadcast rules out float ties)."""
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return decision
        m = self.kl_moving_average
        payload = torch.tensor(
            [float(decision), math.nan if m is None else m], dtype=torch.float64, device=accelerator.device
        )
        payload = broadcast(payload, from_process=0)
        self.kl_moving_average = None if math.isnan(payload[1].item()) else payload[1].item()
        return bool(payload[0].item())

    # ------------------------------------------------------------------------------------------------ the sync
    def sync(self, alpha: float | None = None) -> None:
        """Set π_ref ← α·π_θ + (1 − α)·π_ref now (α defaults to `mixup_alpha`). Collective: call on every process."""
        alpha = self.mixup_alpha if alpha is None else alpha
        if self._peft_model() is not None:
            self._sync_adapter(alpha)
        else:
            self._sync_full_model(alpha)

    def _sync_full_model(self, alpha: float) -> None:
        trainer = self.trainer
        dist = DistributedBackend(trainer.accelerator)
        if dist.fsdp_version == 1:
            # Both roots are wrapped with the same policy, so their (flat) local shards correspond element-wise.
            policy, reference = trainer.model_wrapped, trainer.ref_model
        else:
            # DeepSpeed engines, DDP wrappers: the modules inside. FSDP2 parameters are DTensors sharded alike.
            policy = trainer.accelerator.unwrap_model(trainer.model)
            reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        _check_same_layout(policy.parameters(), reference.parameters(), "the policy", "the reference model")
        # TRL's helper: gathers ZeRO-3 partitions, updates on rank 0, re-partitions.
        SyncRefModelCallback.sync_target_model(policy, reference, alpha)

    def _sync_adapter(self, alpha: float) -> None:
        trainer = self.trainer
        peft_model = self._peft_model()
        dist = DistributedBackend(trainer.accelerator)
        # Under FSDP1 two adapters of one flat parameter are sharded at different offsets: materialise them.
        context = dist.summon_full_params(trainer.model_wrapped, writeback=True) if dist.fsdp_version == 1 else None
        with context or nullcontext():
            trained, ref = _adapter_parameters(peft_model)
            _check_same_layout(trained, ref, f"adapter '{peft_model.active_adapter}'", f"adapter '{REF_ADAPTER}'")
            SyncRefModelCallback.sync_target_model(_Parameters(trained), _Parameters(ref), alpha)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return {
            "args": {
                "kl_threshold": self.kl_threshold,
                "kl_ema": self.kl_ema,
                "sync_steps": self.sync_steps,
                "mixup_alpha": self.mixup_alpha,
            },
            "attributes": {
                "kl_moving_average": self.kl_moving_average,
                "last_sync_step": self.last_sync_step,
                "num_syncs": self.num_syncs,
                "sync_history": list(self.sync_history),
            },
        }

    def save_checkpoint(self, trainer, trial=None) -> None:
        """Save the synced reference into the checkpoint folder that `trainer._save_checkpoint` is about to write."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        self.save_reference(os.path.join(trainer._get_output_dir(trial=trial), folder))

    def save_reference(self, output_dir: str) -> None:
        """Write the synced reference into the checkpoint folder `output_dir` (nothing before the first sync: the
        reference is then the initial model, which a resumed trainer rebuilds). Collective: call on every process."""
        if self.num_syncs == 0 or not self.has_reference():
            return
        tensors = self._reference_tensors()
        if self.trainer.accelerator.is_main_process:
            from safetensors.torch import save_file

            os.makedirs(output_dir, exist_ok=True)
            kind = "adapter" if self._peft_model() is not None else "model"
            save_file(tensors, os.path.join(output_dir, REFERENCE_FILE), metadata={"format": "pt", "kind": kind})
        self.trainer.accelerator.wait_for_everyone()

    def load_checkpoint(self, trainer, checkpoint: str) -> None:
        """Restore, when resuming from `checkpoint`, the callback state (from `trainer.state`, loaded from the
        checkpoint's `trainer_state.json`) and the synced reference weights. Makes this instance the trainer's callback
        again if transformers replaced it by a copy rebuilt from the saved arguments
        (`restore_callback_states_from_checkpoint=True`); restores the state whatever that flag says, since the
        reference weights are always restored."""
        callbacks = trainer.callback_handler.callbacks
        mine = [i for i, cb in enumerate(callbacks) if isinstance(cb, RefModelSyncCallback)]
        callbacks.insert(mine[0] if mine else len(callbacks), self)
        callbacks[:] = [cb for cb in callbacks if cb is self or not isinstance(cb, RefModelSyncCallback)]
        self.bind(trainer)
        name = type(self).__name__
        stored = trainer.state.stateful_callbacks.get(name)
        if isinstance(stored, list):
            stored = stored[0]
        if stored:
            for key, value in stored.get("attributes", {}).items():
                setattr(self, key, value)
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
        from safetensors.torch import load_file

        self._load_reference_tensors(load_file(path))
        logger.info(f"Restored the reference synced at step {self.last_sync_step} from {path}.")

    def _reference_modules(self):
        """(module, parameter-name filter) holding the reference parameters."""
        trainer = self.trainer
        peft_model = self._peft_model()
        if peft_model is not None:
            fsdp = DistributedBackend(trainer.accelerator).is_fsdp
            return (trainer.model_wrapped if fsdp else peft_model), (lambda n: f".{REF_ADAPTER}." in n)
        if DistributedBackend(trainer.accelerator).is_fsdp:
            return trainer.ref_model, (lambda n: True)
        return trainer.accelerator.unwrap_model(trainer.ref_model), (lambda n: True)

    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        module, keep = self._reference_modules()
        dist = DistributedBackend(self.trainer.accelerator)
        if dist.is_fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {name: t.detach().clone().contiguous() for name, t in full.items() if keep(name)}
        tensors = {}
        for name, param in module.named_parameters():
            if keep(name):
                with dist.gather_params([param]):  # one parameter at a time under ZeRO-3
                    tensors[name] = param.detach().to("cpu", copy=True).contiguous()
        return tensors

    def _load_reference_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        module, keep = self._reference_modules()
        dist = DistributedBackend(self.trainer.accelerator)
        if dist.is_fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(module, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
            return
        params = {name: param for name, param in module.named_parameters() if keep(name)}
        if set(params) != set(tensors):
            raise ValueError(
                f"{REFERENCE_FILE} does not match the reference: missing {sorted(set(params) - set(tensors))[:5]}, "
                f"unexpected {sorted(set(tensors) - set(params))[:5]}. Resume with the model and PEFT config that "
                "wrote the checkpoint."
            )
        for name, param in params.items():
            if dist.is_zero3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if deepspeed.comm.get_rank() == 0:
                        param.data.copy_(tensors[name])
            else:
                param.data.copy_(tensors[name])


class _Parameters:
    """A parameter list with the `parameters()` method that `SyncRefModelCallback.sync_target_model` iterates."""

    def __init__(self, params):
        self._params = list(params)

    def parameters(self):
        return iter(self._params)


def _adapter_parameters(peft_model) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trained adapter's parameters and the matching "ref" adapter's, in the same order."""
    trained = peft_model.active_adapter
    named = dict(peft_model.named_parameters())
    pairs = [
        (param, named[name.replace(f".{trained}.", f".{REF_ADAPTER}.")])
        for name, param in named.items()
        if f".{trained}." in name and name.replace(f".{trained}.", f".{REF_ADAPTER}.") in named
    ]
    if not pairs:
        raise ValueError(f"The PEFT model has no '{REF_ADAPTER}' adapter matching its trained adapter '{trained}'.")
    return [p for p, _ in pairs], [r for _, r in pairs]


def _check_same_layout(source, target, source_name, target_name) -> None:
    source, target = list(source), list(target)
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in source]
    target_shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in target]
    if shapes != target_shapes:
        raise ValueError(
            f"Cannot sync {target_name} to {source_name}: their parameters differ ({len(target)} vs {len(source)} "
            "tensors, or different shapes). The reference must have the policy's architecture, wrapped the same way."
        )
