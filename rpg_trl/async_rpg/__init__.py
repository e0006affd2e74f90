# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""RPG on TRL's asynchronous trainer (`trl.experimental.async_grpo`): [`AsyncRPGConfig`], [`AsyncRPGTrainer`].
Guide: `docs/async.md`. To run them on a CPU without a vLLM server: [`rpg_research.cpu_rollouts`] of the research
package (research/).

Importing this package imports `trl.experimental`, which warns that its API may change; `import rpg_trl` does not
(its `AsyncRPGConfig` and `AsyncRPGTrainer` attributes load this package on first use).
"""

from .config import AsyncRPGConfig
from .trainer import AsyncRPGTrainer


__all__ = ["AsyncRPGConfig", "AsyncRPGTrainer"]
