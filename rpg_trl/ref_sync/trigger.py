# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""When to move the reference: the trigger of the paper's iterative reference update (Sec. 5).

The paper "periodically set[s] π_old ← π_θ (every K optimizer steps, or when a moving average of token-level KL
exceeds a target κ)". [`SyncTrigger`] holds that rule and its state and nothing else: it is fed the token KL of each
optimizer step and says, at the end of the step, whether (and why) the reference should be synced. It knows nothing
of models or trainers; [`rpg_trl.ref_sync.RefModelSyncCallback`] feeds it and moves the weights
([`rpg_trl.ref_sync.weights`]).

The moving average: `m ← γ·m + (1 − γ)·KL_step`, where `KL_step` is the token-weighted mean KL of the step (all
micro-batches, all processes) and `m` restarts at the first step after each sync (the KL to the old reference says
nothing about the new one).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from .._kl_callback import load_attributes


#: The moving-average and sync-history attributes exported to `trainer_state.json`, under these names (a checkpoint
#: restores them by name).
STATE_ATTRIBUTES = ("kl_moving_average", "last_sync_step", "num_syncs", "sync_history")


class SyncTrigger:
    r"""
    Decides when to sync the reference: when the moving average of the token KL to π_ref exceeds κ, or when
    `sync_steps` optimizer steps have passed since the last sync, and only at a generation boundary (the next step
    scores a fresh batch with π_ref, so buffered batches never mix two references).

    Args:
        kl_threshold (`float`, *optional*):
            κ > 0: sync when the moving average of the token KL exceeds it. `None`: no KL trigger.
        kl_ema (`float`, *optional*, defaults to `0.9`):
            γ ∈ [0, 1): weight of the previous average (0 uses the last step's KL alone).
        sync_steps (`int`, *optional*):
            Sync at the latest every `sync_steps` optimizer steps (the paper's K). `None`: no periodic trigger.

    Use: [`observe`] each micro-batch's KL, [`end_step`] once per optimizer step (returns the reason for a sync, or
    `None`), [`agree`] across processes, then [`record_sync`] if the reference was synced.
    """

    def __init__(self, kl_threshold: float | None = None, kl_ema: float = 0.9, sync_steps: int | None = None):
        if kl_threshold is not None and not (isinstance(kl_threshold, numbers.Real) and kl_threshold > 0):
            raise ValueError(f"`kl_threshold` (κ) must be a number > 0 or None; got {kl_threshold!r}.")
        if not (isinstance(kl_ema, numbers.Real) and 0.0 <= kl_ema < 1.0):
            raise ValueError(f"`kl_ema` (γ) must be in [0, 1); got {kl_ema!r}.")
        if sync_steps is not None and not (isinstance(sync_steps, numbers.Integral) and sync_steps >= 1):
            raise ValueError(f"`sync_steps` must be an integer >= 1 or None; got {sync_steps!r}.")
        self.kl_threshold = kl_threshold
        self.kl_ema = kl_ema
        self.sync_steps = sync_steps
        #: Moving average of the token KL since the last sync (`None` before the first step after a sync).
        self.kl_moving_average: float | None = None
        #: Optimizer step of the last sync (0: none yet, or the start of training).
        self.last_sync_step = 0
        self.num_syncs = 0
        self.sync_history: list[int] = []
        # Token-weighted KL of the optimizer step in progress.
        self._kl_sum = 0.0
        self._kl_tokens = 0.0

    # ------------------------------------------------------------------------------------------------ one step
    def observe(self, kl_sum, num_tokens) -> None:
        """Add one micro-batch's KL: `kl_sum` = Σ_tokens KL over `num_tokens` tokens (numbers or 0-d tensors).
        A micro-batch without tokens or with a non-finite sum is ignored."""
        kl_sum, num_tokens = float(kl_sum), float(num_tokens)
        if num_tokens > 0 and math.isfinite(kl_sum):
            self._kl_sum += kl_sum
            self._kl_tokens += num_tokens

    def discard_step(self) -> None:
        """Forget the KL observed since the last [`end_step`] (start of training, or nothing to sync)."""
        self._kl_sum = self._kl_tokens = 0.0

    def end_step(self, global_step: int, at_generation_boundary: bool = True) -> str | None:
        """Close optimizer step `global_step`: fold its token KL into the moving average (a step without KL leaves it
        unchanged) and return why the reference should be synced now, or `None`. The periodic trigger is checked
        first. Nothing is due away from a generation boundary, whatever the KL."""
        step_kl = self._kl_sum / self._kl_tokens if self._kl_tokens > 0 else None
        self.discard_step()
        if step_kl is not None:
            m = self.kl_moving_average
            self.kl_moving_average = step_kl if m is None else self.kl_ema * m + (1.0 - self.kl_ema) * step_kl
        if not at_generation_boundary:
            return None
        since = global_step - self.last_sync_step
        if self.sync_steps is not None and since >= self.sync_steps:
            return f"{since} steps since the last sync"
        m = self.kl_moving_average
        if self.kl_threshold is not None and m is not None and m > self.kl_threshold:
            return f"ref/kl = {m:.4g} > κ = {self.kl_threshold:g}"
        return None

    def agree(self, decision: bool, broadcast: Callable[[list[float]], list[float]] | None = None) -> bool:
        """Adopt the main process's decision and moving average. `broadcast` sends a list of floats from the main
        process to all and returns the main process's list ([`broadcast_from_main`]); `None` with one process.
        The processes already agree when their KL is reduced over all of them: this rules out float ties and any
        difference in what each observed."""
        if broadcast is None:
            return decision
        m = self.kl_moving_average
        main_decision, main_m = broadcast([float(decision), math.nan if m is None else float(m)])
        self.kl_moving_average = None if math.isnan(main_m) else float(main_m)
        return bool(main_decision)

    def record_sync(self, global_step: int) -> None:
        """Note that the reference was synced at `global_step`; the moving average restarts."""
        self.num_syncs += 1
        self.last_sync_step = global_step
        self.sync_history.append(global_step)
        self.kl_moving_average = None

    def start(self, global_step: int) -> None:
        """At the start of `train()`: forget a half-observed step; a new run (step 0) restarts the step count."""
        self.discard_step()
        self.last_sync_step = min(self.last_sync_step, global_step)

    # ------------------------------------------------------------------------------------------------ state
    def arguments(self) -> dict:
        return {"kl_threshold": self.kl_threshold, "kl_ema": self.kl_ema, "sync_steps": self.sync_steps}

    def attributes(self) -> dict:
        """The state to export (`trainer_state.json`): [`STATE_ATTRIBUTES`]."""
        return {
            "kl_moving_average": self.kl_moving_average,
            "last_sync_step": self.last_sync_step,
            "num_syncs": self.num_syncs,
            "sync_history": list(self.sync_history),
        }

    def load_attributes(self, attributes: dict) -> None:
        """Restore an exported state (`sync_history` copied); refuses unknown keys (a state that is not this
        trigger's)."""
        load_attributes(self, attributes, STATE_ATTRIBUTES, "reference-sync")


def broadcast_from_main(accelerator) -> Callable[[list[float]], list[float]] | None:
    """A `broadcast` for [`SyncTrigger.agree`] over `accelerator`'s processes (float64, on its device); `None` with
    one process. Collective: every process must call the returned function at the same point."""
    if accelerator.num_processes == 1:
        return None
    import torch
    from accelerate.utils import broadcast

    def send(values: list[float]) -> list[float]:
        payload = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
        return broadcast(payload, from_process=0).tolist()

    return send
