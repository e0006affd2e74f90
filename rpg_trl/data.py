# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Deprecated alias of `rpg_trl.math_task.data` (the paper's math task, Sec. 5 and Appendix H): use
`rpg_trl.math_task.data` or `rpg_trl.math_task`."""

import warnings

from .math_task.data import *  # noqa: F403
from .math_task.data import __all__  # noqa: F401


warnings.warn(
    "`rpg_trl.data` is deprecated and will be removed: use `rpg_trl.math_task.data` (or `rpg_trl.math_task`, "
    "e.g. `from rpg_trl.math_task import load_dapo_math_17k`).",
    FutureWarning,
    stacklevel=2,
)
