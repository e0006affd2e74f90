# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""RPG on TRL's asynchronous trainer (`trl.experimental.async_grpo`): [`AsyncRPGConfig`], [`AsyncRPGTrainer`].
Guide: docs: *RPG with asynchronous rollouts*. To run them on a CPU without a vLLM server:
[`rpg_trl.testing.cpu_rollouts`] (the library's testing package).

Importing this package imports `trl.experimental`, which warns that its API may change; `import rpg_trl` does not
(its `AsyncRPGConfig` and `AsyncRPGTrainer` attributes load this package on first use).

Needs TRL 1.16 or later (`rpg_trl.trl_release.ASYNC_TRL`): the trainer builds on `trl.experimental.async_grpo`'s packed
stream and tree attention, new in TRL 1.16. With an older release of the library's TRL window, importing this package
raises an `ImportError` that says so (before it imports `trl.experimental`), and `RPGTrainer` serves.
"""

from ..trl_release import require_async_trl


require_async_trl()

from .config import AsyncRPGConfig  # noqa: E402 - after the check, which names the TRL release they need
from .trainer import AsyncRPGTrainer  # noqa: E402


__all__ = ["AsyncRPGConfig", "AsyncRPGTrainer"]
