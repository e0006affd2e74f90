# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The paper's math-reasoning task (Sec. 5 and Appendix H), every public name of its two modules:

- [`data`]: the paper's prompt and datasets (DAPO-Math-17k for training; AIME24, AIME25 and AMC23 for evaluation);
- [`rewards`]: its verifiable rewards (the answer line checked with math-verify, the format reward, DAPO's soft
  overlong punishment).
"""

from . import data, rewards
from .data import *  # noqa: F403
from .rewards import *  # noqa: F403


__all__ = [*data.__all__, *rewards.__all__]
