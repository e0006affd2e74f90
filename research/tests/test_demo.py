# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests of the addition task (`rpg_research.toy`) and of `rpg-trl demo` (`rpg_research.cli.demo`): the task, the held-out accuracy and an end-to-end `rpg-trl demo` smoke run."""

import json
import math
import random

import pytest
import torch

from rpg_research.cli import main
from rpg_research.cli.demo import DemoArguments
from rpg_research.toy import addition, evaluation
from rpg_trl import RPGConfig


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_splits_are_disjoint_cover_all_problems_and_depend_on_the_seed():
    splits = addition.make_splits(0, num_eval=400, num_rl=1600)
    assert (len(splits.eval), len(splits.rl), len(splits.sft)) == (400, 1600, 8100 - 2000)
    sets = [set(splits.eval), set(splits.rl), set(splits.sft)]
    assert set().union(*sets) == {(a, b) for a in range(10, 100) for b in range(10, 100)}
    assert sum(map(len, sets)) == 8100  # pairwise disjoint
    assert addition.make_splits(0).eval == splits.eval
    assert addition.make_splits(1).eval != splits.eval
    with pytest.raises(ValueError, match="num_eval \\+ num_rl"):
        addition.make_splits(0, num_eval=8000, num_rl=100)


def test_noisy_sum_is_exact_without_noise_and_off_by_one_or_ten_with_noise():
    rng = random.Random(0)
    assert all(addition.noisy_sum(a, b, rng, 0.0) == a + b for a, b in [(10, 10), (57, 38), (99, 99)])
    offsets = {addition.noisy_sum(57, 38, rng, 1.0) - 95 for _ in range(200)}
    assert offsets == {-1, 1, -10, 10}
    assert all(addition.noisy_sum(1, 2, rng, 1.0) >= 0 for _ in range(100))  # 3 - 10 is never produced


def test_sft_dataset_has_half_wrong_labels_and_seventy_percent_easy_rows():
    pairs = addition.make_splits(0).sft
    dataset = addition.build_sft_dataset(pairs, seed=0)
    assert len(dataset) == len(pairs) + round(len(pairs) * 0.7 / 0.3)
    two_digit = [row for row in dataset if len(row["prompt"]) == 6]  # "ab+cd=": the supervised pool only
    assert len(two_digit) == len(pairs)
    assert {tuple(map(int, row["prompt"][:-1].split("+"))) for row in two_digit} == set(pairs)
    wrong = [row for row in two_digit if int(row["completion"]) != eval(row["prompt"][:-1])]
    assert 0.45 < len(wrong) / len(two_digit) < 0.55
    easy = [row for row in dataset if len(row["prompt"]) < 6]
    assert all(min(map(int, row["prompt"][:-1].split("+"))) < 10 for row in easy)


def test_addition_reward_matches_the_number_only():
    rewards = addition.addition_reward(["57", "057", "58", "", "5 7x"], ["57"] * 5)
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_addition_reward_digits_agree_with_math_verify():
    # The digits-only fast path against math-verify itself (the answer line it reads), on every completion of up to
    # three digits, with leading zeros, each against its own value and against another sum.
    from rpg_trl.math_task.rewards import accuracy_reward

    completions = [str(i) for i in range(1000)] + [f"0{i}" for i in range(100)] + ["00", "007", "0198"]
    solutions = [str(int(c)) if k % 2 == 0 else str(20 + k % 179) for k, c in enumerate(completions)]
    expected = accuracy_reward([f"Answer: {c}" for c in completions], solutions)
    assert addition.addition_reward(completions, solutions) == expected
    assert 0 < sum(expected) < len(expected)


def test_heldout_accuracy_is_reproducible_and_leaves_the_global_rng_alone():
    model, tokenizer = addition.build_model(seed=0)
    pairs = addition.make_splits(0, num_eval=20).eval
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = evaluation.heldout_accuracy(model, tokenizer, pairs, num_samples=2, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    assert evaluation.heldout_accuracy(model, tokenizer, pairs, num_samples=2, seed=7) == first
    assert 0.0 <= first <= 1.0
    assert model.training is False or model.training is True  # restored, whatever it was


def test_demo_arguments_reject_bad_values_naming_them(capsys):
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1; got 0"):
        DemoArguments(steps=0)
    assert main(["demo", "--steps", "0"]) == 2
    assert "`steps`" in capsys.readouterr().err


def test_demo_end_to_end_smoke(tmp_path):
    output_dir = tmp_path / "demo"
    status = main(
        [
            "demo",
            "--output-dir",
            str(output_dir),
            "--sft-steps",
            "20",
            "--steps",
            "4",
            "--eval-problems",
            "16",
            "--eval-every",
            "2",
            "--seed",
            "3",
        ]
    )
    assert status == 0
    summary = json.loads((output_dir / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "greedy_accuracy_before", "greedy_accuracy_after", "seconds"):
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["steps"] == 4 and summary["sft_steps"] == 20 and summary["seed"] == 3
    # 20 steps cannot teach addition: the readiness check adds the 3 extra rounds of 2 * 20 // 3 = 13 steps.
    assert (summary["sft_rounds"], summary["sft_steps_total"]) == (4, 20 + 3 * 13)
    assert 0.0 <= summary["sft_check_greedy_accuracy"] < 0.7
    assert summary["seconds"] > 0
    assert summary["config"]["rl"]["max_steps"] == 4
    assert summary["config"]["rl"]["divergence"] == "urkl"
    # Every setting of RPG's that shapes the result, e.g. the KL weight outside the trust region and the KL level.
    assert summary["config"]["rl"]["kl_clip_mode"] == RPGConfig.__dataclass_fields__["kl_clip_mode"].default
    assert summary["config"]["rl"]["kl_level"] == "token" and "kl_importance_weight" in summary["config"]["rl"]
    assert summary["config"]["demo"]["output_dir"] == str(output_dir)
    assert [point["step"] for point in summary["accuracy_curve"]] == [0, 2, 4]
    assert summary["accuracy_curve"][0]["accuracy"] == summary["accuracy_before"]
    png = (output_dir / "curves.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    state = json.loads((output_dir / "rpg" / "trainer_state.json").read_text())
    assert any("heldout/accuracy" in entry for entry in state["log_history"])
    assert any("reward" in entry for entry in state["log_history"])
    assert (output_dir / "sft" / "config.json").is_file()


def test_token_kl_to_reference_is_the_mean_exact_kl_over_the_policys_own_completion_tokens():
    # Recomputed one completion at a time, without padding: the same samples (same seed), each prompt without its left
    # padding and each completion cut after its end token, both models run on it alone, and the KL over the whole
    # vocabulary summed at each completion position, then averaged over all completion tokens.
    from transformers import GenerationConfig

    model, tokenizer = addition.build_model(seed=0)
    reference, _ = addition.build_model(seed=1)
    pairs = addition.make_splits(0, num_eval=12).eval[:6]
    measured = evaluation.token_kl_to_reference(model, reference, tokenizer, pairs, num_samples=2, seed=5)
    model.eval()
    reference.eval()
    inputs = tokenizer([addition.prompt_of(a, b) for a, b in pairs], return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=addition.MAX_COMPLETION_LENGTH,
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        num_return_sequences=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        output = model.generate(**inputs, generation_config=config)
    prompt_length = inputs["input_ids"].shape[1]
    total, count = 0.0, 0
    with torch.no_grad():
        for row, attention in zip(output, inputs["attention_mask"].repeat_interleave(2, dim=0)):
            prompt = row[:prompt_length][attention.bool()]
            completion = row[prompt_length:].tolist()
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
            ids = torch.cat([prompt, torch.tensor(completion, dtype=row.dtype)]).unsqueeze(0)
            p = torch.log_softmax(model(ids).logits[0].double(), -1)
            q = torch.log_softmax(reference(ids).logits[0].double(), -1)
            for position in range(len(prompt) - 1, len(prompt) - 1 + len(completion)):
                total += float((p[position].exp() * (p[position] - q[position])).sum())
                count += 1
    assert count > len(pairs)
    assert measured == pytest.approx(total / count, rel=1e-4)
    assert measured > 0.01
    assert evaluation.token_kl_to_reference(model, model, tokenizer, pairs, num_samples=2) == pytest.approx(
        0, abs=1e-6
    )


def test_device_switch_builds_the_training_arguments_of_each_device(monkeypatch):
    """One switch chooses the device: the CPU in float32, or CUDA with bf16 autocast, in the supervised and the RL
    arguments alike (built here without a GPU: transformers' check that one is there is skipped)."""
    import transformers

    from rpg_research.toy import training

    assert training.device_training_kwargs() == {"use_cpu": True, "bf16": False}
    assert training.device_training_kwargs("cuda") == {"use_cpu": False, "bf16": True}
    with pytest.raises(ValueError, match="`device` must be one of \\('cpu', 'cuda'\\); got 'tpu'"):
        training.device_training_kwargs("tpu")
    monkeypatch.setattr(transformers.TrainingArguments, "_validate_args", lambda self: None)
    for device, (use_cpu, bf16) in (("cpu", (True, False)), ("cuda", (False, True))):
        rl = training.rpg_config("out", steps=2, seed=0, learning_rate=1e-3, device=device)
        sft = training.sft_config("out", steps=2, seed=0, device=device)
        assert (rl.use_cpu, rl.bf16, sft.use_cpu, sft.bf16) == (use_cpu, bf16, use_cpu, bf16)
        assert isinstance(rl, RPGConfig) and rl.max_steps == 2


def test_demo_device_reaches_the_warm_start_and_the_rl_phase(monkeypatch, tmp_path, capsys):
    """`rpg-trl demo --device cuda` trains the warm start and RPG on CUDA; without a GPU it stops at once, naming the
    fix."""
    from rpg_research.cli import demo
    from rpg_research.toy import training, warm_start

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="`device` is 'cuda' but torch .* finds no CUDA GPU here; use `--device cpu`"):
        DemoArguments(device="cuda")
    assert main(["demo", "--device", "tpu"]) == 2 and "`device` must be one of" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}

    class Stop(Exception):
        pass

    def fake_warm_start(splits, output_dir, *, device, **kwargs):
        seen["warm_start"] = device
        model, tokenizer = addition.build_model(seed=0)
        return model, tokenizer, warm_start.WarmStartReport(steps=0, rounds=0, check_accuracy=None)

    def fake_rpg_config(output_dir, *, device, **kwargs):
        seen["rl"] = device
        raise Stop

    monkeypatch.setattr(warm_start, "warm_start", fake_warm_start)
    monkeypatch.setattr(training, "rpg_config", fake_rpg_config)
    with pytest.raises(Stop):
        demo.run_demo(DemoArguments(device="cuda", output_dir=str(tmp_path), eval_problems=4))
    assert seen == {"warm_start": "cuda", "rl": "cuda"}
