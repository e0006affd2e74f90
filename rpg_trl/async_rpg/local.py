# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Deprecated alias of `rpg_trl.cpu_rollouts` (the CPU rollout worker and tree attention that run the asynchronous
trainers without a vLLM server): use `from rpg_trl.cpu_rollouts import LocalRolloutWorker, cpu_backend` (and the
other names)."""

import warnings

from ..cpu_rollouts import *  # noqa: F403
from ..cpu_rollouts import __all__  # noqa: F401


warnings.warn(
    "`rpg_trl.async_rpg.local` is deprecated and will be removed: use `rpg_trl.cpu_rollouts` (e.g. "
    "`from rpg_trl.cpu_rollouts import LocalRolloutWorker, cpu_backend`).",
    FutureWarning,
    stacklevel=2,
)
