# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Deprecated alias of `rpg_trl.reinforce_plus_plus` (REINFORCE++ and REINFORCE++-Baseline, Hu, 2025): use
`from rpg_trl.reinforce_plus_plus import ReinforcePlusPlusTrainer` (and the other names)."""

import warnings

from .reinforce_plus_plus import *  # noqa: F403
from .reinforce_plus_plus import __all__  # noqa: F401


warnings.warn(
    "`rpg_trl.baselines` is deprecated and will be removed: use `rpg_trl.reinforce_plus_plus` (e.g. "
    "`from rpg_trl.reinforce_plus_plus import ReinforcePlusPlusTrainer`).",
    FutureWarning,
    stacklevel=2,
)
