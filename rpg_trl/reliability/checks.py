# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Checks of what enters a run: datasets without prompts, bad prompt rows, over-long sequences.

* **Datasets** ([`check_prompt_column`]): a training or evaluation dataset without a `prompt` column is refused when
  the trainer is built, instead of a `KeyError` at the first generation.
* **Rows** ([`check_prompt_rows`]): a row whose prompt is empty, None, not a string, malformed chat messages, or text
  the tokenizer cannot encode (it raises, or gives no token, or only its unknown token) is refused with a `ValueError`
  naming the row, the column and what is allowed: every row of a map-style dataset when the trainer is built (batched
  tokenizer calls, a progress bar for long datasets), each row of an iterable dataset as it arrives, through a checked
  map that only the dataloader reads ([`iterable_rows_checked`]): the trainer keeps the user's dataset objects. TRL
  would fail on the row only when it is sampled, with an error that names no row.
* **Long prompts**: TRL 1.16 has no `max_prompt_length` and never truncates prompts; one warning, when the trainer is
  built ([`LongPromptReport`]) or else at the first batch ([`check_sequence_length`]), says when a prompt plus
  `max_completion_length` exceeds the model's `max_position_embeddings`, the setting that bounds it.
"""

from __future__ import annotations

from contextlib import contextmanager

from transformers.utils import logging


logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------------- datasets
def check_prompt_column(dataset, split: str = "train") -> None:
    """Raise a `ValueError` if `dataset` (a `datasets` map-style dataset, a dict of them, or None) lacks a `prompt`
    column. Datasets whose columns are unknown (e.g. some iterable datasets) pass."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            check_prompt_column(part, f"{split} ({name!r})")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" in columns:
        return
    raise ValueError(
        f"The {split} dataset has no 'prompt' column (its columns: {list(columns)}). RPGTrainer, like GRPOTrainer, "
        "generates completions for the 'prompt' of each row: a string, or a list of chat messages "
        "[{'role': 'user', 'content': ...}]. Rename the column that holds the prompts, e.g. "
        "`dataset.rename_column('question', 'prompt')`, or build the dataset with "
        "`rpg_trl.math_task.format_math_dataset`."
    )


# ---------------------------------------------------------------------------------------------------- long prompts
def check_sequence_length(trainer, inputs: dict) -> None:
    """Warn once if a prompt plus `max_completion_length` exceeds the model's `max_position_embeddings` (TRL 1.16
    neither truncates prompts nor checks this)."""
    if getattr(trainer, "_warned_sequence_length", False) or "prompt_mask" not in inputs:
        return
    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    prompt_length = int(inputs["prompt_mask"].sum(dim=1).max().item()) if inputs["prompt_mask"].numel() else 0
    if prompt_length + trainer.max_completion_length > limit:
        trainer._warned_sequence_length = True
        logger.warning(
            f"A prompt of {prompt_length} tokens plus max_completion_length = {trainer.max_completion_length} exceeds "
            f"the model's max_position_embeddings = {limit}. {_LENGTH_ADVICE} (Reported once.)"
        )


# ---------------------------------------------------------------------------------------------------- prompt rows
#: Rows read, checked and tokenized per batch by [`check_prompt_rows`] (one tokenizer call per batch).
ROW_CHECK_BATCH_SIZE = 1000
#: A map-style dataset longer than this shows a progress bar while its rows are checked.
ROW_CHECK_PROGRESS_MIN_ROWS = 10_000

#: What a row's prompt may be, as the errors of [`check_prompt_rows`] say it.
ALLOWED_PROMPTS = (
    "a non-empty string, or a non-empty list of chat messages {'role': str, 'content': str or list of content "
    "parts}, with text that the tokenizer can encode: the tokenizer does not raise on it and gives at least one "
    "token that is not its unknown token"
)


def _content_text(content) -> str | None:
    """The text of a message's `content` (a string, or a list of content parts whose `text` entries count), or None if
    `content` is neither."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return None


def prompt_problem(prompt) -> tuple[str | None, str | None]:
    """`(problem, text)`: what is wrong with the structure of `prompt` (None if nothing is), and the text of the prompt
    that the tokenizer must encode (a conversational prompt's message contents, one message a line; None for messages
    whose content parts hold no text, e.g. only images)."""
    if prompt is None:
        return "is None", ""
    if isinstance(prompt, str):
        return (None, prompt) if prompt.strip() else ("is an empty string", "")
    if not isinstance(prompt, (list, tuple)):
        return f"is of type {type(prompt).__name__}, not a string or a list of chat messages", ""
    if not prompt:
        return "is an empty list of chat messages", ""
    texts = []
    for position, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"has message {position} of type {type(message).__name__}, not a dict {{'role', 'content'}}", ""
        if not isinstance(message.get("role"), str):
            return f"has message {position} without a string 'role' (role: {message.get('role')!r})", ""
        text = _content_text(message.get("content"))
        if text is None:
            content = message.get("content")
            return (
                f"has message {position} whose 'content' is of type {type(content).__name__}, not a string or a list",
                "",
            )
        texts.append(text)
    text = "\n".join(texts)
    if text.strip():
        return None, text
    if any(isinstance(message.get("content"), list) and message["content"] for message in prompt):
        return None, None  # content parts without text (e.g. only an image): nothing for the tokenizer to check
    return "is a list of chat messages without any text", ""


def _encoding_problem(ids, unk_id) -> str | None:
    if not ids:
        return "encodes to no token"
    if unk_id is not None and ids.count(unk_id) == len(ids):
        return "encodes to the unknown token only"
    return None


def _check_prompt_batch(prompts, indices, tokenizer, split: str) -> list[int]:
    """Raise the `ValueError` of [`check_prompt_rows`] for the first bad prompt of a batch (`indices`: the rows' indices
    in the dataset); return the token count of each prompt's text."""
    texts = []
    for index, prompt in zip(indices, prompts):
        problem, text = prompt_problem(prompt)
        if problem is not None:
            _raise_row_error(index, prompt, problem, split)
        texts.append(text)
    if tokenizer is None:
        return [0] * len(texts)
    try:
        encoded = tokenizer([text or "" for text in texts], add_special_tokens=False, return_attention_mask=False)[
            "input_ids"
        ]
    except Exception:  # find the row (the tokenizer names no row; TRL would fail on it when it is sampled)
        encoded = []
        for index, prompt, text in zip(indices, prompts, texts):
            try:
                encoded.append(tokenizer(text or "", add_special_tokens=False)["input_ids"])
            except Exception as error:
                _raise_row_error(index, prompt, f"makes the tokenizer raise {type(error).__name__}: {error}", split)
    unk_id = getattr(tokenizer, "unk_token_id", None)
    for index, prompt, text, ids in zip(indices, prompts, texts, encoded):
        problem = None if text is None else _encoding_problem(ids, unk_id)
        if problem is not None:
            _raise_row_error(index, prompt, problem, split)
    return [len(ids) for ids in encoded]


def _raise_row_error(index, prompt, problem: str, split: str):
    shown = repr(prompt)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise ValueError(
        f"Row {index} of the {split} dataset: its 'prompt' column {problem} ({shown}). A prompt must be "
        f"{ALLOWED_PROMPTS}. TRL would fail on this row only when it is sampled, with an error that names no row. Fix "
        "or drop the row, e.g. `dataset.filter(lambda row: ..., with_indices=True)`."
    )


class LongPromptReport:
    """Collects the rows whose prompt text, plus `max_completion_length`, exceeds the model's `max_position_embeddings`
    (`limit`), over the datasets that [`check_prompt_rows`] checks; [`warn`] reports them in one warning."""

    def __init__(self, limit: int | None, max_completion_length: int | None):
        self.limit, self.max_completion_length = limit, max_completion_length or 0
        self.count, self.first, self.longest = 0, None, 0

    def add(self, split: str, indices, lengths) -> None:
        if self.limit is None:
            return
        for index, length in zip(indices, lengths):
            if length + self.max_completion_length > self.limit:
                self.count += 1
                self.first = f"row {index} of the {split} dataset" if self.first is None else self.first
                self.longest = max(self.longest, length)

    def warn(self) -> bool:
        """Warn if a row was too long; return whether it warned."""
        if not self.count:
            return False
        others = f", and {self.count - 1} other row(s)" if self.count > 1 else ""
        logger.warning(
            f"A prompt of {self.longest} tokens ({self.first}{others}; the text of a conversational prompt, without "
            f"its chat template) plus max_completion_length = {self.max_completion_length} exceeds the model's "
            f"max_position_embeddings = {self.limit}. {_LENGTH_ADVICE} (Reported once.)"
        )
        return True


_LENGTH_ADVICE = (
    "The setting that bounds a prompt is the model's `config.max_position_embeddings` minus `max_completion_length`: "
    "TRL 1.16's GRPOConfig has no `max_prompt_length` and never truncates prompts, so the model sees positions it "
    "was not trained on, and one such prompt can make a training step many times slower. Filter long prompts out of "
    "the dataset (e.g. `dataset.filter(lambda x: len(tokenizer(x['prompt']).input_ids) <= L)`) or lower "
    "`max_completion_length`."
)


def check_prompt_rows(
    dataset,
    processing_class=None,
    split: str = "training",
    *,
    long_prompts: LongPromptReport | None = None,
    show_progress: bool = True,
):
    """Check the `prompt` of every row of `dataset`; return the dataset to train on.

    A prompt must be a non-empty string, or a non-empty list of chat messages `{"role": str, "content": str | list}`
    (content parts: dicts whose `text` entries are the text), and its text (a conversational prompt's message contents)
    must be encodable by the tokenizer of `processing_class`: the tokenizer must not raise on it and must give at
    least one token, not only its unknown token (special tokens are not added). A row that breaks this raises a
    `ValueError` naming its index, the column and what is allowed.

    * A map-style `datasets.Dataset` (or a dict of datasets): every row is checked now, by batches of
      [`ROW_CHECK_BATCH_SIZE`] (one tokenizer call each), with a progress bar above [`ROW_CHECK_PROGRESS_MIN_ROWS`]
      rows (`show_progress`); the dataset is returned unchanged. With `max_position_embeddings`, the rows whose
      prompt text plus `max_completion_length` exceeds it are counted and reported in one warning.
    * A `datasets.IterableDataset`: returned mapped (`IterableDataset.map`, batched), so that each row is checked as it
      arrives; its index is its position in the stream. A trainer's dataloader reads this map, the trainer keeps the
      dataset itself ([`iterable_rows_checked`]).
    * Anything else (None, a dataset without a `prompt` column, which [`check_prompt_column`] reports): returned as is.
    """
    import datasets

    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return type(dataset)(
            {
                name: check_prompt_rows(
                    part,
                    processing_class,
                    f"{split} ({name!r})",
                    long_prompts=long_prompts,
                    show_progress=show_progress,
                )
                for name, part in dataset.items()
            }
        )
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    tokenizer = tokenizer if callable(tokenizer) else None
    if isinstance(dataset, datasets.IterableDataset):
        if dataset.column_names is not None and "prompt" not in dataset.column_names:
            return dataset

        def check_rows(columns, indices):
            if "prompt" in columns:
                _check_prompt_batch(columns["prompt"], indices, tokenizer, split)
            return {}

        return dataset.map(
            check_rows, batched=True, batch_size=ROW_CHECK_BATCH_SIZE, with_indices=True, features=dataset.features
        )
    if not isinstance(dataset, datasets.Dataset) or "prompt" not in dataset.column_names:
        return dataset
    rows = dataset.select_columns(["prompt"]).with_format(None)
    bar = logging.tqdm(
        total=len(rows),
        desc=f"Checking the prompts of the {split} dataset",
        unit="rows",
        disable=not show_progress or len(rows) <= ROW_CHECK_PROGRESS_MIN_ROWS,
    )
    with bar:
        for start, columns in zip(range(0, len(rows), ROW_CHECK_BATCH_SIZE), rows.iter(ROW_CHECK_BATCH_SIZE)):
            indices = range(start, start + len(columns["prompt"]))
            lengths = _check_prompt_batch(columns["prompt"], indices, tokenizer, split)
            if long_prompts is not None:
                long_prompts.add(split, indices, lengths)
            bar.update(len(indices))
    return dataset


def check_trainer_prompt_rows(trainer) -> None:
    """[`check_prompt_rows`] on a trainer's map-style training and evaluation datasets (those of a dict of evaluation
    datasets included), with the trainer's tokenizer, a progress bar unless `disable_tqdm` (main process only), and one
    warning for the prompts too long for the model's context (which then counts as the run's one length warning,
    [`check_sequence_length`]). The datasets stay the trainer's (the user's objects); the rows of an iterable one are
    checked as they arrive, by the dataloader ([`iterable_rows_checked`])."""
    import datasets

    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    report = LongPromptReport(limit if isinstance(limit, int) else None, trainer.args.max_completion_length)
    show = not trainer.args.disable_tqdm and trainer.accelerator.is_local_main_process
    for attribute, split in (("train_dataset", "training"), ("eval_dataset", "evaluation")):
        dataset = getattr(trainer, attribute, None)
        parts = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
        for name, part in parts:
            if isinstance(part, datasets.IterableDataset):
                continue  # reading it here would consume the stream: its rows are checked as the dataloader reads them
            where = split if name is None else f"{split} ({name!r})"
            check_prompt_rows(part, trainer.processing_class, where, long_prompts=report, show_progress=show)
    if report.warn():
        trainer._warned_sequence_length = True


def rows_checked_as_they_arrive(trainer, dataset, split: str):
    """`dataset` as a dataloader of `trainer` should read it: an iterable dataset as its checked map
    ([`check_prompt_rows`] with the trainer's tokenizer), so that each row is checked as it arrives; anything else as
    is (a map-style dataset was checked when the trainer was built)."""
    import datasets

    if not isinstance(dataset, datasets.IterableDataset):
        return dataset
    return check_prompt_rows(dataset, trainer.processing_class, split)


@contextmanager
def iterable_rows_checked(trainer, attribute: str, split: str, name: str | None = None):
    """While the trainer builds a dataloader from `trainer.<attribute>` (`train_dataset`, or `eval_dataset` and, for a
    dict of evaluation datasets, the one named `name`), an iterable dataset there is swapped for its checked map
    ([`rows_checked_as_they_arrive`]), for the duration of the call only: on exit the attribute holds the user's object
    again, whether the build succeeded or raised.

    GRPOTrainer's `get_train_dataloader` and `get_eval_dataloader` read the attribute, shuffle an iterable dataset and
    repeat each row for its group of completions: the map is applied before that, so a bad row is named by its position
    in the stream (not in the repeated stream) and checked once, and afterwards the map lives only inside the
    dataloader. The user's dataset, or dict of datasets, stays the trainer's (TRL's contract: `trainer.train_dataset is
    train_dataset`, `trainer.eval_dataset is eval_dataset`)."""
    held = getattr(trainer, attribute, None)
    if name is not None and isinstance(held, dict):
        checked = rows_checked_as_they_arrive(trainer, held.get(name), f"{split} ({name!r})")
        swapped = held if checked is held.get(name) else {**held, name: checked}
    else:
        swapped = rows_checked_as_they_arrive(trainer, held, split)
    if swapped is held:
        yield
        return
    setattr(trainer, attribute, swapped)
    try:
        yield
    finally:
        setattr(trainer, attribute, held)
