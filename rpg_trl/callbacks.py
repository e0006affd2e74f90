# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Deprecated alias of `rpg_trl.ref_sync.callback`: use `from rpg_trl.ref_sync import RefModelSyncCallback`.

The callback of the paper's iterative reference update (Sec. 5) moved next to its two parts, `rpg_trl/ref_sync/`.
"""

import warnings

from .ref_sync.callback import REF_ADAPTER, REFERENCE_FILE, RefModelSyncCallback


__all__ = ["REFERENCE_FILE", "REF_ADAPTER", "RefModelSyncCallback"]

warnings.warn(
    "`rpg_trl.callbacks` is deprecated and will be removed: use `from rpg_trl.ref_sync import RefModelSyncCallback`.",
    FutureWarning,
    stacklevel=2,
)
