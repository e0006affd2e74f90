# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""Datasets of the paper's math-reasoning setup (Sec. 5 and Appendix H).

The paper trains on the English subset of DAPO-Math-17k and evaluates on AIME24, AIME25 and AMC23; where the authors
published the files they use (the English training file, their AIME 2024 copy), those are the defaults. The loaders
below return a [`datasets.Dataset`] in TRL's conversational prompt-only format, ready for [`~trl.GRPOTrainer`] /
[`rpg_trl.RPGTrainer`] with [`rpg_trl.math_task.rewards.accuracy_reward`]:

- ``prompt``: one user message whose content is the paper's prompt ([`PROMPT_TEMPLATE`]) around the question;
- ``solution``: the reference answer as a string.

Two source schemas are understood, from the Hugging Face Hub or from local ``.parquet`` / ``.json`` / ``.jsonl``
files or folders:

- **plain**: a question column (``problem`` or ``question``) and an answer column (``answer`` or ``solution``; when
  both exist ``answer`` is used, since ``solution`` is then usually a worked solution);
- **verl** (the format of the authors' code, of their English DAPO-Math-17k and AIME 2024 files and of the
  DAPO-Math-17k release): ``prompt``, a list of chat messages whose user message usually already contains the paper's
  prompt, and ``reward_model``, a dict with the reference answer under ``ground_truth``; verl's other columns
  (``data_source``, ``ability``, ``extra_info``) are dropped.

When the question text already carries the paper's prompt, the prompt is removed and the question re-wrapped, so every
prompt contains the template exactly once whatever the source.
"""

from __future__ import annotations

import re
from pathlib import Path

from datasets import Dataset, DatasetDict, Features, Value, load_dataset


__all__ = [
    "AIME24_ID",
    "AIME25_ID",
    "AMC23_ID",
    "ANSWER_COLUMNS",
    "DAPO_MATH_17K_ENG_ID",
    "DAPO_MATH_17K_ID",
    "HUB_DATA_FILES",
    "PROMPT_TEMPLATE",
    "QUESTION_COLUMNS",
    "format_math_dataset",
    "load_aime24",
    "load_aime25",
    "load_amc23",
    "load_dapo_math_17k",
    "load_math_dataset",
    "make_prompt",
    "strip_prompt_template",
]


#: The paper's prompt (Sec. 5, Appendix H), also used by DAPO. ``{question}`` is replaced by the problem statement.
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

# Default Hub datasets. Each named loader also accepts a local file or folder with the same content.
#: The paper's training set as the authors use it: the English subset of DAPO-Math-17k (the paper's 13.9k problems),
#: the file `dapo-math-17k-eng.parquet` that their `recipe/rpg/prepare_rpg_data_eng.sh` downloads. verl schema:
#: `data_source`, `prompt` (one user message already carrying the paper's prompt), `ability`, `reward_model` (the
#: answer under `ground_truth`) and `extra_info` (`index`, `raw_problem`, `split`); split "train". Default of
#: [`load_dapo_math_17k`] and of the project's math example (`rpg_math.py`).
DAPO_MATH_17K_ENG_ID = "math-dataset/DAPO-17k-Eng"
#: The full DAPO-Math-17k release (English and Chinese problems), verl schema, split "train". It repeats each of its
#: ~17k problems about 100 times (~1.79M rows; BytedTsinghua-SIA/DAPO issue #36), hence `deduplicate=True` in
#: [`load_dapo_math_17k`]; `english_only=True` approximates the English subset. A deduplicated copy with an English-only
#: subset is `open-r1/DAPO-Math-17k-Processed` (config "en"), which also loads here.
DAPO_MATH_17K_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
#: AIME 2024 (30 problems) as the authors evaluate it: the `aime-2024.parquet` of their data scripts, verl schema like
#: [`DAPO_MATH_17K_ENG_ID`], each problem repeated 32 times (for mean@32 in verl; [`load_aime24`] drops the repeats),
#: split "train". The same problems in the plain schema (`problem`, `answer`) are `HuggingFaceH4/aime_2024`.
AIME24_ID = "BytedTsinghua-SIA/AIME-2024"
#: AIME 2025 (30 problems, parts I and II), plain schema (`problem`, `answer`), split "test". An alternative with the
#: same columns is `yentinglin/aime_2025` (split "train").
AIME25_ID = "math-ai/aime25"
#: AMC 2023 (40 problems), plain schema (`question`, `answer`), split "test".
AMC23_ID = "math-ai/amc23"
#: The one data file read from a Hub dataset, for the authors' datasets: exactly the file their scripts download (any
#: other file in the repository is ignored). Pass `data_files=...` to the loaders to read another.
HUB_DATA_FILES = {DAPO_MATH_17K_ENG_ID: "dapo-math-17k-eng.parquet", AIME24_ID: "data/aime-2024.parquet"}

QUESTION_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("reward_model", "answer", "solution")
_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}

_ACCEPTED_SCHEMAS = (
    "Accepted schemas: (a) plain: a question column ('problem' or 'question') and an answer column ('answer' or "
    "'solution'); (b) verl (e.g. DAPO-Math-17k): 'prompt' (a list of chat messages, or a string) and 'reward_model' "
    "(a dict with the answer under 'ground_truth'); a 'prompt' column with an 'answer' or 'solution' column also "
    "works. Rename the columns (e.g. `Dataset.rename_column`) to match one of them."
)
# The paper's prompt around a question, tolerant to small wording and whitespace changes of its two fixed parts.
_TEMPLATE_RE = re.compile(
    r"^\s*Solve the following math problem step by step\..*?\n\s*\n(?P<question>.*?)\n\s*\n\s*"
    r"Remember to put your answer on its own line after[^\n]*\s*$",
    re.DOTALL,
)
# Hiragana, katakana, CJK ideographs and Hangul: the non-English problems of DAPO-Math-17k are Chinese.
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_TEMP_QUESTION = "__rpg_question__"
_FEATURES = Features(
    {
        "prompt": [{"role": Value("string"), "content": Value("string")}],
        "solution": Value("string"),
        _TEMP_QUESTION: Value("string"),
    }
)


def make_prompt(question: str) -> str:
    r"""
    Wraps a problem statement in the paper's prompt ([`PROMPT_TEMPLATE`]).

    Args:
        question (`str`):
            Problem statement.

    Returns:
        `str`: The user message sent to the model.

    Example:
    ```python
    >>> from rpg_trl.math_task.data import make_prompt

    >>> make_prompt("What is 2 + 2?").split("\n\n")[1:]
    ['What is 2 + 2?', 'Remember to put your answer on its own line after "Answer:".']
    ```
    """
    return PROMPT_TEMPLATE.format(question=question)


def strip_prompt_template(text: str) -> str:
    """
    Returns the problem statement inside the paper's prompt, or `text` itself (stripped) if it does not carry it.

    Args:
        text (`str`):
            A user message, e.g. the ``prompt`` content of a DAPO-Math-17k row.

    Returns:
        `str`: The bare problem statement.
    """
    match = _TEMPLATE_RE.match(text)
    return (match.group("question") if match else text).strip()


def _question_text(value, row: int) -> str:
    """Problem statement from a question cell: a string, a message dict or a list of chat messages."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)):
        messages = [message for message in value if isinstance(message, dict)]
        users = [message for message in messages if message.get("role") == "user"]
        value = (users or messages)[-1].get("content") if (users or messages) else None
    if not isinstance(value, str):
        raise ValueError(
            f"Row {row}: the question must be a string or a list of chat messages with a string 'content'; got "
            f"{value!r}."
        )
    return strip_prompt_template(value)


def _answer_text(value, column: str, row: int) -> str:
    """Reference answer from an answer cell (a verl ``reward_model`` dict or a plain value)."""
    if column == "reward_model":
        if not isinstance(value, dict) or value.get("ground_truth") is None:
            raise ValueError(f"Row {row}: 'reward_model' must be a dict with a 'ground_truth' entry; got {value!r}.")
        value = value["ground_truth"]
    if value is None or isinstance(value, (dict, list, tuple)):
        raise ValueError(f"Row {row}: the answer in column {column!r} must be a string or a number; got {value!r}.")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON/Arrow may store integer answers as floats: write 27, not 27.0
    return str(value).strip()


def format_math_dataset(
    dataset: Dataset,
    *,
    max_samples: int | None = None,
    deduplicate: bool = False,
    english_only: bool = False,
    source: str = "dataset",
) -> Dataset:
    """
    Converts a math dataset in one of the accepted schemas (see the module docstring) to TRL's conversational format
    with the paper's prompt.

    Args:
        dataset ([`~datasets.Dataset`]):
            Dataset in the plain or verl schema.
        max_samples (`int`, *optional*):
            Keep only the first `max_samples` problems (after deduplication and filtering).
        deduplicate (`bool`, *optional*, defaults to `False`):
            Keep only the first occurrence of each (question, answer) pair.
        english_only (`bool`, *optional*, defaults to `False`):
            Drop problems whose statement contains Chinese, Japanese or Korean characters (a heuristic for the English
            subset of DAPO-Math-17k used by the paper).
        source (`str`, *optional*, defaults to `"dataset"`):
            Name of the data source, used in error messages.

    Returns:
        [`~datasets.Dataset`]: Columns ``prompt`` (a list with one user message) and ``solution`` (a string); all
        other columns are dropped.

    Raises:
        `ValueError`: If a required column is missing or a row cannot be read.
    """
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0
    ):
        raise ValueError(f"`max_samples` must be a non-negative integer or None; got {max_samples!r}.")
    columns = dataset.column_names
    question_column = next((column for column in QUESTION_COLUMNS if column in columns), None)
    answer_column = next((column for column in ANSWER_COLUMNS if column in columns), None)
    if question_column is None or answer_column is None:
        missing = []
        if question_column is None:
            missing.append("a question column (one of 'problem', 'question', 'prompt')")
        if answer_column is None:
            missing.append("an answer column (one of 'answer', 'solution', 'reward_model')")
        raise ValueError(f"{source} has columns {columns} but is missing {' and '.join(missing)}. {_ACCEPTED_SCHEMAS}")

    if max_samples is not None and not (deduplicate or english_only):
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    if len(dataset) == 0:  # `map` on an empty dataset would drop the output columns
        return Dataset.from_dict({name: [] for name in _FEATURES}, features=_FEATURES).remove_columns(_TEMP_QUESTION)

    def convert(batch, indices):
        questions = [_question_text(value, row) for value, row in zip(batch[question_column], indices)]
        answers = [_answer_text(value, answer_column, row) for value, row in zip(batch[answer_column], indices)]
        return {
            "prompt": [[{"role": "user", "content": make_prompt(question)}] for question in questions],
            "solution": answers,
            _TEMP_QUESTION: questions,
        }

    dataset = dataset.map(convert, batched=True, with_indices=True, remove_columns=columns, features=_FEATURES)

    if deduplicate or english_only:
        seen = set()
        keep = []
        for index, (question, answer) in enumerate(zip(dataset[_TEMP_QUESTION], dataset["solution"])):
            if max_samples is not None and len(keep) >= max_samples:
                break
            if english_only and _CJK_RE.search(question):
                continue
            if deduplicate:
                if (question, answer) in seen:
                    continue
                seen.add((question, answer))
            keep.append(index)
        dataset = dataset.select(keep)
    return dataset.remove_columns(_TEMP_QUESTION)


def _load_raw(name_or_path: str, split: str, **load_dataset_kwargs) -> Dataset:
    """Loads a split from a local file, a local folder or the Hub."""
    path = Path(name_or_path).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in _FILE_BUILDERS:
            raise ValueError(
                f"Unsupported file type {suffix!r} for {str(path)!r}; expected one of {sorted(_FILE_BUILDERS)}."
            )
        # A single file holds a single split, which `datasets` names "train" whatever `split` asks for.
        return load_dataset(_FILE_BUILDERS[suffix], data_files=str(path), split="train", **load_dataset_kwargs)
    if path.is_dir():
        splits = load_dataset(str(path), **load_dataset_kwargs)
        if not isinstance(splits, DatasetDict):
            return splits
        if split in splits:
            return splits[split]
        if len(splits) == 1:  # e.g. a folder holding a single `aime24.parquet`
            return next(iter(splits.values()))
        raise ValueError(f"Folder {str(path)!r} has splits {sorted(splits)}, not the requested split {split!r}.")
    if suffix in _FILE_BUILDERS:
        raise FileNotFoundError(f"No such dataset file: {str(path)!r}.")
    if name_or_path in HUB_DATA_FILES:
        load_dataset_kwargs.setdefault("data_files", HUB_DATA_FILES[name_or_path])
    return load_dataset(name_or_path, split=split, **load_dataset_kwargs)


def load_math_dataset(
    name_or_path: str,
    split: str = "train",
    *,
    max_samples: int | None = None,
    deduplicate: bool = False,
    english_only: bool = False,
    **load_dataset_kwargs,
) -> Dataset:
    """
    Loads a math dataset from the Hub or a local file or folder and formats it with the paper's prompt.

    Args:
        name_or_path (`str`):
            A local ``.parquet``, ``.json`` or ``.jsonl`` file, a local folder of such files, or a Hub dataset id. A
            local path takes precedence over a Hub id of the same name.
        split (`str`, *optional*, defaults to `"train"`):
            Split to load from the Hub or from a folder with several splits; ignored for a single file, and for a
            folder with a single split.
        max_samples (`int`, *optional*):
            Keep only the first `max_samples` problems.
        deduplicate (`bool`, *optional*, defaults to `False`):
            Keep only the first occurrence of each (question, answer) pair.
        english_only (`bool`, *optional*, defaults to `False`):
            Drop problems containing Chinese, Japanese or Korean characters.
        **load_dataset_kwargs:
            Passed to [`datasets.load_dataset`] (e.g. `name` for a dataset config, `revision`, `cache_dir`).

    Returns:
        [`~datasets.Dataset`]: Columns ``prompt`` (a list with one user message) and ``solution`` (a string).

    Raises:
        `ValueError`: If the data has none of the accepted schemas (the message names the missing columns), or if a
            file type is not supported.
        `FileNotFoundError`: If `name_or_path` looks like a data file but does not exist.

    Example:
    ```python
    >>> from rpg_trl.math_task.data import load_math_dataset

    >>> dataset = load_math_dataset("my_problems.jsonl")  # lines like {"problem": "...", "answer": "42"}
    >>> dataset[0]["prompt"][0]["role"], dataset[0]["solution"]
    ('user', '42')
    ```
    """
    raw = _load_raw(name_or_path, split, **load_dataset_kwargs)
    return format_math_dataset(
        raw, max_samples=max_samples, deduplicate=deduplicate, english_only=english_only, source=repr(name_or_path)
    )


def load_dapo_math_17k(
    name_or_path: str = DAPO_MATH_17K_ENG_ID,
    split: str = "train",
    *,
    max_samples: int | None = None,
    deduplicate: bool = True,
    english_only: bool = False,
    **load_dataset_kwargs,
) -> Dataset:
    """
    Loads DAPO-Math-17k, the paper's training set (Sec. 5). See [`load_math_dataset`] for the arguments.

    The default is the English subset the paper trains on (13.9k problems), the authors' own file
    ([`DAPO_MATH_17K_ENG_ID`]). The full release ([`DAPO_MATH_17K_ID`]) repeats each problem about 100 times, so
    duplicates are dropped by default; with it, `english_only=True` approximates the English subset by dropping
    problems with CJK characters.
    """
    return load_math_dataset(
        name_or_path,
        split,
        max_samples=max_samples,
        deduplicate=deduplicate,
        english_only=english_only,
        **load_dataset_kwargs,
    )


def load_aime24(
    name_or_path: str = AIME24_ID,
    split: str = "train",
    *,
    max_samples: int | None = None,
    deduplicate: bool = True,
    **load_dataset_kwargs,
) -> Dataset:
    """
    Loads AIME 2024, an evaluation set of the paper (Sec. 5). See [`load_math_dataset`] for the arguments.

    Duplicates are dropped by default: verl copies of the evaluation sets repeat each problem (e.g. 32 times, for
    mean@32); with TRL, draw repeated samples with `num_generations` instead.
    """
    return load_math_dataset(
        name_or_path, split, max_samples=max_samples, deduplicate=deduplicate, **load_dataset_kwargs
    )


def load_aime25(
    name_or_path: str = AIME25_ID,
    split: str = "test",
    *,
    max_samples: int | None = None,
    deduplicate: bool = True,
    **load_dataset_kwargs,
) -> Dataset:
    """
    Loads AIME 2025, an evaluation set of the paper (Sec. 5). See [`load_aime24`] and [`load_math_dataset`].
    """
    return load_math_dataset(
        name_or_path, split, max_samples=max_samples, deduplicate=deduplicate, **load_dataset_kwargs
    )


def load_amc23(
    name_or_path: str = AMC23_ID,
    split: str = "test",
    *,
    max_samples: int | None = None,
    deduplicate: bool = True,
    **load_dataset_kwargs,
) -> Dataset:
    """
    Loads AMC 2023, an evaluation set of the paper (Sec. 5). See [`load_aime24`] and [`load_math_dataset`].
    """
    return load_math_dataset(
        name_or_path, split, max_samples=max_samples, deduplicate=deduplicate, **load_dataset_kwargs
    )
