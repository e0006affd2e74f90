# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Deprecated alias of `rpg_trl.math_task.rewards` (the paper's math task, Sec. 5 and Appendix H): use
`rpg_trl.math_task.rewards` or `rpg_trl.math_task`."""

import warnings

from .math_task.rewards import *  # noqa: F403
from .math_task.rewards import __all__  # noqa: F401


warnings.warn(
    "`rpg_trl.rewards` is deprecated and will be removed: use `rpg_trl.math_task.rewards` (or `rpg_trl.math_task`, "
    "e.g. `from rpg_trl.math_task import accuracy_reward`).",
    FutureWarning,
    stacklevel=2,
)
