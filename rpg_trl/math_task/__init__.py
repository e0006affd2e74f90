# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The paper's math-reasoning task (Sec. 5 and Appendix H), every public name of its two modules:

- [`data`]: the paper's prompt and datasets (DAPO-Math-17k for training; AIME24, AIME25 and AMC23 for evaluation);
- [`rewards`]: its verifiable rewards (the answer line checked with math-verify, the format reward, DAPO's soft
  overlong punishment).
"""

from .data import (
    AIME24_ID,
    AIME25_ID,
    AMC23_ID,
    ANSWER_COLUMNS,
    DAPO_MATH_17K_ENG_ID,
    DAPO_MATH_17K_ID,
    HUB_DATA_FILES,
    PROMPT_TEMPLATE,
    QUESTION_COLUMNS,
    format_math_dataset,
    load_aime24,
    load_aime25,
    load_amc23,
    load_dapo_math_17k,
    load_math_dataset,
    make_prompt,
    strip_prompt_template,
)
from .rewards import (
    MAX_ANSWER_CHARS,
    MAX_COMPLETION_CHARS,
    PARSING_TIMEOUT_SECONDS,
    VERIFY_TIMEOUT_SECONDS,
    accuracy_reward,
    extract_answer,
    format_reward,
    get_soft_overlong_punishment,
)


__all__ = [
    "AIME24_ID",
    "AIME25_ID",
    "AMC23_ID",
    "ANSWER_COLUMNS",
    "DAPO_MATH_17K_ENG_ID",
    "DAPO_MATH_17K_ID",
    "HUB_DATA_FILES",
    "MAX_ANSWER_CHARS",
    "MAX_COMPLETION_CHARS",
    "PARSING_TIMEOUT_SECONDS",
    "PROMPT_TEMPLATE",
    "QUESTION_COLUMNS",
    "VERIFY_TIMEOUT_SECONDS",
    "accuracy_reward",
    "extract_answer",
    "format_math_dataset",
    "format_reward",
    "get_soft_overlong_punishment",
    "load_aime24",
    "load_aime25",
    "load_amc23",
    "load_dapo_math_17k",
    "load_math_dataset",
    "make_prompt",
    "strip_prompt_template",
]
