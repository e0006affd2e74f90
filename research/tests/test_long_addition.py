# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests of the long-addition task (`rpg_research.toy.long_addition`), its place among the demo's tasks
(`rpg_research.toy.tasks`) and a smoke run of ``rpg-trl demo --task long_addition``."""

import json
import random

import pytest

from rpg_research.cli import main
from rpg_research.cli.demo import DemoArguments
from rpg_research.toy import long_addition
from rpg_research.toy.models import build_char_tokenizer


# 4829 + 3716 = 8545, worked out by hand: units 9+6=15 (write 5, carry 1), tens 2+1+1=4, hundreds 8+7=15 (write 5,
# carry 1), thousands 4+3+1=8. Each row strikes off the operands' last digit, and the result grows on the left.
HAND_EXAMPLE = "\n".join(
    [
        "4829+3716:9+6+0=15:5...",
        ".482+.371:2+1+1=04:45..",
        "..48+..37:8+7+0=15:545.",
        "...4+...3:4+3+1=08:8545",
        "Answer: 8545",
    ]
)
# 9999 + 9999 = 19998: a carry out of every column, and out of the last one into the answer.
ALL_CARRIES = "\n".join(
    [
        "9999+9999:9+9+0=18:8...",
        ".999+.999:9+9+1=19:98..",
        "..99+..99:9+9+1=19:998.",
        "...9+...9:9+9+1=19:9998",
        "Answer: 19998",
    ]
)


def test_worked_solution_of_hand_examples():
    assert long_addition.worked_solution(4829, 3716) == HAND_EXAMPLE
    assert long_addition.worked_solution(9999, 9999) == ALL_CARRIES
    assert long_addition.worked_solution(1000, 1000).endswith("...1+...1:1+1+0=02:2000\nAnswer: 2000")


def test_a_slip_carries_through_to_the_answer():
    # The tens written 2+1+1=03 instead of 04: the result digit is 3, the carry stays 0, the answer is 8535.
    slipped = long_addition.worked_solution(4829, 3716, slip=(1, -1))
    assert slipped.splitlines()[1] == ".482+.371:2+1+1=03:35.."
    assert slipped.splitlines()[2:] == ["..48+..37:8+7+0=15:535.", "...4+...3:4+3+1=08:8535", "Answer: 8535"]
    # The units written 9+6+0=16: the hundreds and carries are unchanged, the answer is 8546.
    assert long_addition.worked_solution(4829, 3716, slip=(0, 1)).endswith("Answer: 8546")
    # 9+9+1=19 + 1 leaves 0-19: refused, and `noisy_solution` flips such an offset.
    with pytest.raises(ValueError, match="outside 0-19"):
        long_addition.worked_solution(9999, 9999, slip=(2, 1))
    with pytest.raises(ValueError, match="4 digits"):
        long_addition.worked_solution(999, 1000)


def test_completions_are_109_or_110_tokens():
    tokenizer = build_char_tokenizer()
    assert len(tokenizer(HAND_EXAMPLE, add_special_tokens=False)["input_ids"]) + 1 == 109  # + the end token
    assert len(tokenizer(ALL_CARRIES, add_special_tokens=False)["input_ids"]) + 1 == 110
    assert long_addition.MAX_COMPLETION_LENGTH == 110
    prompt = tokenizer(long_addition.prompt_of(9999, 9999), add_special_tokens=False)["input_ids"]
    assert len(prompt) + long_addition.MAX_COMPLETION_LENGTH == long_addition.MAX_LENGTH <= 128


def test_splits_are_disjoint_four_digit_problems_and_depend_on_the_seed():
    splits = long_addition.make_splits(0, num_eval=50, num_rl=100, num_sft=300)
    assert (len(splits.eval), len(splits.rl), len(splits.sft)) == (50, 100, 300)
    pools = [set(splits.eval), set(splits.rl), set(splits.sft)]
    assert sum(map(len, pools)) == 450 and len(set().union(*pools)) == 450
    assert all(1000 <= a <= 9999 and 1000 <= b <= 9999 for pool in pools for a, b in pool)
    assert long_addition.make_splits(0, num_eval=50, num_rl=100, num_sft=300).eval == splits.eval
    assert long_addition.make_splits(1, num_eval=50, num_rl=100, num_sft=300).eval != splits.eval
    with pytest.raises(ValueError, match="`num_rl` must be an integer >= 1"):
        long_addition.make_splits(0, num_rl=0)


def test_sft_dataset_has_the_slipped_fraction_each_off_by_a_power_of_ten():
    pairs = long_addition.make_splits(0, num_eval=10, num_rl=10, num_sft=2000).sft
    dataset = long_addition.build_sft_dataset(pairs, seed=0, slip_rate=0.5)
    offsets = []
    for row, (a, b) in zip(dataset, pairs, strict=True):
        assert row["prompt"] == f"{a}+{b}="
        answer = int(row["completion"].rsplit("Answer: ", 1)[1])
        offsets.append(answer - (a + b))
        assert row["completion"].count("\n") == 4
    wrong = [offset for offset in offsets if offset != 0]
    assert 0.45 < len(wrong) / len(offsets) < 0.55
    assert {abs(offset) for offset in wrong} == {1, 10, 100, 1000}
    default = long_addition.build_sft_dataset(pairs, seed=0)  # SFT_SLIP_RATE = 0.6
    slipped = sum(row["completion"] != long_addition.worked_solution(a, b) for row, (a, b) in zip(default, pairs))
    assert 0.56 < slipped / len(pairs) < 0.64


def test_reward_reads_the_answer_line_and_agrees_with_math_verify():
    from rpg_trl.math_task.rewards import accuracy_reward

    completions = [
        HAND_EXAMPLE,
        long_addition.worked_solution(4829, 3716, slip=(3, 1)),
        HAND_EXAMPLE.replace("Answer: 8545", "Answer: 08545"),
        HAND_EXAMPLE.replace("Answer: 8545", "Answer: 8545.0"),
        HAND_EXAMPLE.replace("Answer: 8545", "Answer:"),
        HAND_EXAMPLE.rsplit("\n", 1)[0],  # no answer line: the rows alone are not scored
        "",
    ]
    solutions = ["8545"] * len(completions)
    expected = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert long_addition.long_addition_reward(completions, solutions) == expected
    assert accuracy_reward(completions, solutions) == expected
    rng = random.Random(0)
    pairs = long_addition.make_splits(2, num_eval=40, num_rl=1, num_sft=1).eval
    batch = [long_addition.noisy_solution(a, b, rng, 0.5) for a, b in pairs]
    sums = [str(a + b) for a, b in pairs]
    assert long_addition.long_addition_reward(batch, sums) == accuracy_reward(batch, sums)


def test_model_sizes():
    small, _ = long_addition.build_model(0)
    large, _ = long_addition.build_model(0, "large")
    assert 0.4e6 < small.num_parameters() < 0.5e6
    assert large.num_parameters() > 10 * small.num_parameters()
    with pytest.raises(ValueError, match="`size` must be one of"):
        long_addition.build_model(0, "huge")


def test_demo_arguments_take_the_tasks_defaults_and_reject_what_the_task_lacks():
    args = DemoArguments(task="long_addition")
    assert (args.steps, args.sft_steps, args.sft_extra_rounds, args.learning_rate) == (40, 400, 0, 1e-4)
    assert DemoArguments().sft_steps == 1500 and DemoArguments(steps=7).steps == 7
    assert DemoArguments(task="long_addition", model_size="large").model_size == "large"
    with pytest.raises(ValueError, match="`task` must be one of"):
        DemoArguments(task="subtraction")
    with pytest.raises(ValueError, match="`model_size` must be one of \\['small'\\] with `task='addition'`"):
        DemoArguments(model_size="large")
    with pytest.raises(ValueError, match="`sft_extra_rounds` must be 0 with `task='long_addition'`"):
        DemoArguments(task="long_addition", sft_extra_rounds=2)


def test_demo_long_addition_smoke(tmp_path, monkeypatch):
    # The demo's pipeline on the long task, with RL batches cut to 8 completions so that the step stays short.
    from rpg_research.toy import training

    full = training.rl_training_kwargs

    def small_batches(**kwargs):
        return {**full(**kwargs), "per_device_train_batch_size": 8, "num_generations": 4, "steps_per_generation": 1}

    monkeypatch.setattr(training, "rl_training_kwargs", small_batches)
    output_dir = tmp_path / "demo"
    arguments = ["--task", "long_addition", "--output-dir", str(output_dir), "--sft-steps", "2", "--steps", "2"]
    assert main(["demo", *arguments, "--eval-problems", "4", "--eval-samples", "2", "--eval-every", "2"]) == 0
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["config"]["demo"]["task"] == "long_addition"
    assert summary["config"]["rl"]["max_completion_length"] == 110
    assert summary["config"]["model"] == long_addition.MODEL_SIZES["small"]
    assert summary["config"]["warm_start"]["slip_rate"] == long_addition.SFT_SLIP_RATE
    assert "four-digit additions worked out in rows" in summary["accuracy_definition"]
    assert [point["step"] for point in summary["accuracy_curve"]] == [0, 2]
    # An untrained model rarely stops early: its completions are long.
    assert 0 < summary["completion_length_mean"] <= 110
