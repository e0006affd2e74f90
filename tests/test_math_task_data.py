# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests for rpg_trl.math_task.data on small local files in the plain and verl (DAPO-Math-17k) schemas."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from datasets import Dataset

import rpg_trl.math_task.data as data
from rpg_trl.math_task.data import (
    AIME24_ID,
    DAPO_MATH_17K_ENG_ID,
    DAPO_MATH_17K_ID,
    HUB_DATA_FILES,
    PROMPT_TEMPLATE,
    format_math_dataset,
    load_aime24,
    load_aime25,
    load_amc23,
    load_dapo_math_17k,
    load_math_dataset,
    make_prompt,
    strip_prompt_template,
)
from rpg_trl.math_task.rewards import accuracy_reward


# The paper's prompt, written out by hand (the paper's Sec. 5 and Appendix H), around the question "What is 1 + 1?".
EXPECTED_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 1 + 1?\n\nRemember to put your "
    'answer on its own line after "Answer:".'
)
HEADER = "Solve the following math problem step by step."


def dapo_row(question, answer, index=0):
    """A row as in the DAPO-Math-17k release: the user message already carries the paper's prompt."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": EXPECTED_PROMPT.replace("What is 1 + 1?", question)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(index)},
    }


def authors_row(question, answer, index=0, data_source="math_dapo"):
    """A row of the authors' files (their README's table: `dapo-math-17k-eng.parquet`, `aime-2024.parquet`): the
    prompt written by their `generate_prompt`, `extra_info` with the repeat index, the bare problem and a null split."""
    pre_q = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    )
    post_q = '\n\nRemember to put your answer on its own line after "Answer:".'
    return {
        "data_source": data_source,
        "prompt": [{"content": pre_q + question + post_q, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index, "raw_problem": question, "split": None},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def user_content(example):
    assert len(example["prompt"]) == 1 and example["prompt"][0]["role"] == "user"
    return example["prompt"][0]["content"]


def test_make_prompt_is_the_paper_prompt():
    assert make_prompt("What is 1 + 1?") == EXPECTED_PROMPT
    assert PROMPT_TEMPLATE.format(question="What is 1 + 1?") == EXPECTED_PROMPT
    # Braces in a question are not format fields.
    assert "Find {x | x > 0}." in make_prompt("Find {x | x > 0}.")


def test_strip_prompt_template():
    assert strip_prompt_template(EXPECTED_PROMPT) == "What is 1 + 1?"
    two_paragraphs = "Let $f(x) = x^2$.\n\nCompute $f(3)$."
    assert strip_prompt_template(make_prompt(two_paragraphs)) == two_paragraphs
    assert strip_prompt_template("  Just a question?  ") == "Just a question?"


def test_plain_parquet(tmp_path):
    path = write_parquet(
        tmp_path / "aime.parquet",
        [
            {"id": 0, "problem": "What is 1 + 1?", "solution": "One plus one is \\boxed{2}.", "answer": "2"},
            {"id": 1, "problem": "What is 2 + 3?", "solution": "Two plus three is \\boxed{5}.", "answer": "5"},
        ],
    )
    dataset = load_math_dataset(path)
    assert dataset.column_names == ["prompt", "solution"]
    assert len(dataset) == 2
    assert user_content(dataset[0]) == EXPECTED_PROMPT
    # With both columns, `answer` (the final answer) is used rather than the worked `solution`.
    assert list(dataset["solution"]) == ["2", "5"]


def test_plain_jsonl_with_question_column_and_integer_answers(tmp_path):
    path = write_jsonl(
        tmp_path / "amc.jsonl",
        [
            {"question": "What is 1 + 1?", "answer": 2},
            {"question": "What is 3 * 3?", "answer": 9.0},
            {"question": "What is 5 / 2?", "answer": 2.5},
        ],
    )
    dataset = load_math_dataset(path)
    assert user_content(dataset[0]) == EXPECTED_PROMPT
    # The mixed column is stored as floats; integral values are written back as integers.
    assert list(dataset["solution"]) == ["2", "9", "2.5"]


def test_plain_json_with_solution_column(tmp_path):
    path = tmp_path / "problems.json"
    path.write_text(json.dumps([{"problem": "What is 1 + 1?", "solution": "2"}]))
    dataset = load_math_dataset(str(path))
    assert user_content(dataset[0]) == EXPECTED_PROMPT
    assert list(dataset["solution"]) == ["2"]


def test_verl_parquet_applies_the_template_exactly_once(tmp_path):
    path = write_parquet(tmp_path / "dapo.parquet", [dapo_row("What is 1 + 1?", "2"), dapo_row("Find $x$.", "-3", 1)])
    dataset = load_dapo_math_17k(path)
    assert dataset.column_names == ["prompt", "solution"]
    assert user_content(dataset[0]) == EXPECTED_PROMPT
    for example in dataset:
        assert user_content(example).count(HEADER) == 1
        assert user_content(example).count("Remember to put your answer") == 1
    assert list(dataset["solution"]) == ["2", "-3"]


def test_verl_prompt_without_template_and_with_system_message(tmp_path):
    row = {
        "prompt": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 1 + 1?"},
        ],
        "reward_model": {"ground_truth": "2", "style": "rule"},
    }
    dataset = load_math_dataset(write_parquet(tmp_path / "verl.parquet", [row]))
    # Only the user question is kept, wrapped in the paper's prompt (the system message is dropped).
    assert dataset[0]["prompt"] == [{"role": "user", "content": EXPECTED_PROMPT}]


def test_prompt_string_with_solution_column(tmp_path):
    # e.g. open-r1/DAPO-Math-17k-Processed: a bare question string in `prompt`, the answer in `solution`.
    path = write_jsonl(tmp_path / "processed.jsonl", [{"prompt": "What is 1 + 1?", "solution": "2"}])
    dataset = load_math_dataset(path)
    assert dataset[0]["prompt"] == [{"role": "user", "content": EXPECTED_PROMPT}]
    assert list(dataset["solution"]) == ["2"]


def test_output_can_be_reloaded(tmp_path):
    first = load_math_dataset(write_parquet(tmp_path / "dapo.parquet", [dapo_row("What is 1 + 1?", "2")]))
    first.to_parquet(str(tmp_path / "formatted.parquet"))
    second = load_math_dataset(str(tmp_path / "formatted.parquet"))
    assert second[0] == first[0] == {"prompt": [{"role": "user", "content": EXPECTED_PROMPT}], "solution": "2"}


def test_deduplicate_and_max_samples(tmp_path):
    pairs = [("Q1?", "1"), ("Q1?", "1"), ("Q2?", "2"), ("Q1?", "1"), ("Q3?", "3")]
    rows = [dapo_row(question, answer) for question, answer in pairs]
    path = write_parquet(tmp_path / "dapo.parquet", rows)
    assert list(load_math_dataset(path)["solution"]) == ["1", "1", "2", "1", "3"]
    assert list(load_dapo_math_17k(path)["solution"]) == ["1", "2", "3"]
    assert list(load_dapo_math_17k(path, deduplicate=False)["solution"]) == ["1", "1", "2", "1", "3"]
    assert list(load_dapo_math_17k(path, max_samples=2)["solution"]) == ["1", "2"]
    assert list(load_math_dataset(path, max_samples=2)["solution"]) == ["1", "1"]
    for empty in (load_math_dataset(path, max_samples=0), load_dapo_math_17k(path, max_samples=0)):
        assert len(empty) == 0 and empty.column_names == ["prompt", "solution"]
    with pytest.raises(ValueError, match="max_samples"):
        load_math_dataset(path, max_samples=-1)


def test_english_only(tmp_path):
    rows = [dapo_row("What is 1 + 1?", "2"), dapo_row("求 1 + 1 的值。", "2"), dapo_row("What is 2 + 2?", "4")]
    path = write_parquet(tmp_path / "dapo.parquet", rows)
    assert len(load_dapo_math_17k(path)) == 3
    assert list(load_dapo_math_17k(path, english_only=True)["solution"]) == ["2", "4"]


def test_folder_with_a_single_split(tmp_path):
    folder = tmp_path / "aime25"
    folder.mkdir()
    write_parquet(folder / "aime25.parquet", [{"problem": "What is 1 + 1?", "answer": "2"}])
    # load_aime25 asks for the "test" split; a folder holding one file has only one split, which is used.
    dataset = load_aime25(str(folder))
    assert user_content(dataset[0]) == EXPECTED_PROMPT
    assert list(dataset["solution"]) == ["2"]


def test_folder_with_named_splits(tmp_path):
    folder = tmp_path / "splits"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"problem": "What is 1 + 1?", "answer": "2"}])
    write_jsonl(folder / "test.jsonl", [{"problem": "What is 2 + 2?", "answer": "4"}])
    assert list(load_math_dataset(str(folder), split="test")["solution"]) == ["4"]
    assert list(load_math_dataset(str(folder), split="train")["solution"]) == ["2"]
    with pytest.raises(ValueError, match="validation"):
        load_math_dataset(str(folder), split="validation")


def test_named_loaders_on_local_files(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"problem": "What is 1 + 1?", "answer": "2"}])
    amc = write_jsonl(tmp_path / "amc.jsonl", [{"question": "What is 1 + 1?", "answer": 2.0}])
    for loader, path, solution in [(load_aime24, plain, "2"), (load_aime25, plain, "2"), (load_amc23, amc, "2")]:
        dataset = loader(path)
        assert dataset[0] == {"prompt": [{"role": "user", "content": EXPECTED_PROMPT}], "solution": solution}


def test_wrong_schema_names_the_missing_columns(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"text": "What is 1 + 1?", "label": "2"}])
    with pytest.raises(ValueError) as excinfo:
        load_math_dataset(path)
    message = str(excinfo.value)
    assert "'text'" in message and "'label'" in message  # the columns found
    for column in ("'problem'", "'question'", "'answer'", "'solution'", "'reward_model'"):
        assert column in message
    assert "Accepted schemas" in message


def test_missing_answer_column_only(tmp_path):
    path = write_jsonl(tmp_path / "questions.jsonl", [{"problem": "What is 1 + 1?"}])
    with pytest.raises(ValueError, match="missing an answer column"):
        load_math_dataset(path)


def test_bad_reward_model_cell(tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [{"prompt": "What is 1 + 1?", "reward_model": {"style": "rule"}}])
    with pytest.raises(ValueError, match="ground_truth"):
        load_math_dataset(path)


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_math_dataset(str(tmp_path / "missing.parquet"))
    csv = tmp_path / "data.csv"
    csv.write_text("problem,answer\nWhat is 1 + 1?,2\n")
    with pytest.raises(ValueError, match="Unsupported file type"):
        load_math_dataset(str(csv))


def test_hub_ids_and_splits(monkeypatch):
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return Dataset.from_list([{"problem": "What is 1 + 1?", "answer": "2"}])

    monkeypatch.setattr(data, "load_dataset", fake_load_dataset)
    load_dapo_math_17k()
    load_dapo_math_17k(DAPO_MATH_17K_ID, english_only=True)
    load_aime24()
    load_aime24(data_files="other.parquet")
    load_aime25()
    load_amc23(revision="main")
    assert calls == [
        # The authors' files: exactly those their data scripts download (recipe/rpg/prepare_rpg_data_eng.sh).
        ("math-dataset/DAPO-17k-Eng", {"split": "train", "data_files": "dapo-math-17k-eng.parquet"}),
        ("BytedTsinghua-SIA/DAPO-Math-17k", {"split": "train"}),
        ("BytedTsinghua-SIA/AIME-2024", {"split": "train", "data_files": "data/aime-2024.parquet"}),
        ("BytedTsinghua-SIA/AIME-2024", {"split": "train", "data_files": "other.parquet"}),
        ("math-ai/aime25", {"split": "test"}),
        ("math-ai/amc23", {"split": "test", "revision": "main"}),
    ]


def test_authors_files_load_with_their_schema(monkeypatch, tmp_path):
    """The authors' English DAPO-Math-17k file and AIME 2024 copy, in their schema (their README's table), served by
    a stand-in for the Hub that reads local parquet files: the prompts come out exactly as the authors wrote them,
    the answers from `reward_model.ground_truth`, verl's other columns dropped, AIME's 32 repeats merged."""
    english = [authors_row("What is 1 + 1?", "2", 0), authors_row("Let $x^2 = 9$ and $x < 0$. Find $x$.", "-3", 1)]
    aime = [
        authors_row(q, a, k) for q, a in [("Find $2^{10}$.", "1024"), ("Find $7 \\cdot 11$.", "77")] for k in range(32)
    ]
    files = {
        DAPO_MATH_17K_ENG_ID: write_parquet(tmp_path / "dapo-math-17k-eng.parquet", english),
        AIME24_ID: write_parquet(tmp_path / "aime-2024.parquet", aime),
    }
    local_load_dataset = data.load_dataset

    def hub(path, split, data_files):
        assert data_files == HUB_DATA_FILES[path]  # the one file of the repository the authors download
        return local_load_dataset("parquet", data_files=files[path], split=split)

    monkeypatch.setattr(data, "load_dataset", hub)
    train = load_dapo_math_17k()  # the default: the authors' English file
    assert train.column_names == ["prompt", "solution"]
    assert [example["prompt"] for example in train] == [
        [{"role": "user", "content": row["prompt"][0]["content"]}] for row in english
    ]
    assert user_content(train[0]) == EXPECTED_PROMPT
    assert list(train["solution"]) == ["2", "-3"]
    evaluation = load_aime24()
    assert len(evaluation) == 2 and list(evaluation["solution"]) == ["1024", "77"]
    assert user_content(evaluation[1]) == aime[32]["prompt"][0]["content"]
    assert len(load_aime24(deduplicate=False)) == 64


def test_format_in_memory_dataset_and_score_it():
    dataset = format_math_dataset(Dataset.from_list([dapo_row("What is 1 + 1?", "2")]))
    completions = [[{"role": "assistant", "content": "1 + 1 = 2.\nAnswer: 2"}]]
    assert accuracy_reward(completions, dataset["solution"]) == [1.0]


@pytest.mark.parametrize(
    "recipe",
    [
        p
        for p in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
        if "rpg_math.py" in p.read_text()
    ],
    ids=lambda p: p.stem,
)
def test_recipes_train_on_the_authors_english_file(recipe):
    """The recipes of examples/rpg_math.py (the paper's runs)."""
    config = yaml.safe_load(recipe.read_text())
    assert config["train_dataset"] == DAPO_MATH_17K_ENG_ID and config["english_only"] is False
    assert config["eval_datasets"][0] == "aime24"  # load_aime24: the authors' AIME24_ID
