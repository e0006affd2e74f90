# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The paper's iterative reference update (Sec. 5) with a separate reference model, in two parts.

- [`trigger`]: *when* to move π_ref to π_θ (moving average of the token KL, every K steps, agreement across
  processes, the state written to `trainer_state.json`). Plain Python, testable without a trainer.
- [`weights`]: *how* to move it on each backend (plain model, DDP, DeepSpeed ZeRO-2/3, FSDP1/2, the PEFT "ref"
  adapter) and how to save and restore the synced reference with a checkpoint.

[`callback.RefModelSyncCallback`] (exported here: `from rpg_trl.ref_sync import RefModelSyncCallback`) joins the two
inside a `transformers` Trainer.
"""

__all__ = ["RefModelSyncCallback"]


def __getattr__(name):
    # The callback imports transformers and TRL; `trigger` stays importable without them.
    if name == "RefModelSyncCallback":
        from .callback import RefModelSyncCallback

        return RefModelSyncCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
