# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests for rpg_trl.math_task.rewards. Expected values are written by hand from the answer format of the paper's
prompt."""

import functools
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpg_trl.math_task.rewards import (
    MAX_COMPLETION_CHARS,
    accuracy_reward,
    extract_answer,
    format_reward,
    get_soft_overlong_punishment,
)


# (completion, gold solution, expected reward)
ACCURACY_CASES = [
    pytest.param("We add: 40 + 2 = 42.\nAnswer: 42", "42", 1.0, id="right"),
    pytest.param("We add: 40 + 1 = 41.\nAnswer: 41", "42", 0.0, id="wrong"),
    pytest.param(r"Therefore the total is \boxed{7}.", "7", 1.0, id="boxed"),
    pytest.param(r"Therefore the total is \boxed{8}.", "7", 0.0, id="boxed-wrong"),
    pytest.param("Half of one.\nAnswer: \\frac{1}{2}", "0.5", 1.0, id="latex-fraction-vs-decimal"),
    pytest.param("Answer: $\\frac{1}{2}$.", r"\frac{1}{2}", 1.0, id="dollars-and-full-stop"),
    pytest.param("Answer: 2/4", r"\frac{1}{2}", 1.0, id="unsimplified-fraction"),
    pytest.param("Answer: \\dfrac{3}{4}", "0.75", 1.0, id="dfrac"),
    pytest.param("Answer: 3\\sqrt{3}", r"3\sqrt3", 1.0, id="surd"),
    pytest.param("Answer: 3\\sqrt{3}", "3", 0.0, id="surd-is-not-its-coefficient"),
    pytest.param("**Answer:** 42", "42", 1.0, id="markdown-bold"),
    pytest.param("answer: 42", "42", 1.0, id="lower-case-marker"),
    pytest.param("Answer:\n\n42", "42", 1.0, id="answer-on-next-line"),
    pytest.param("Answer: \\boxed{42}", "42", 1.0, id="boxed-on-answer-line"),
    pytest.param("First try. Answer: 3\nOn reflection:\nAnswer: 5", "5", 1.0, id="last-answer-line-wins"),
    pytest.param("First try. Answer: 3\nOn reflection:\nAnswer: 5", "3", 0.0, id="earlier-answer-ignored"),
    pytest.param("So \\boxed{3}.\nAnswer: 5", "5", 1.0, id="answer-line-beats-boxed"),
    pytest.param("So \\boxed{3}.\nAnswer: 5", "3", 0.0, id="boxed-ignored-when-answer-line"),
    pytest.param("The answer is clearly 42", "42", 0.0, id="no-final-answer"),
    pytest.param("", "42", 0.0, id="empty"),
    pytest.param("Answer: 42", 42, 1.0, id="integer-gold"),
    pytest.param("Answer: 42", r"Adding gives $40 + 2$, so the answer is \boxed{42}.", 1.0, id="worked-solution-gold"),
    pytest.param("Answer: 1,000", "1000", 1.0, id="thousands-separator"),
    pytest.param("Answer: [0,1)", "[0,1)", 1.0, id="interval"),
    pytest.param("Answer: 42", "", None, id="empty-gold"),
    pytest.param("Answer: 42", "}{", None, id="unparsable-gold"),
    pytest.param("Answer: 42", None, None, id="missing-gold"),
]


@pytest.mark.parametrize("completion, gold, expected", ACCURACY_CASES)
def test_accuracy_reward_table(completion, gold, expected):
    assert accuracy_reward([completion], [gold]) == [expected]


def test_accuracy_reward_conversational():
    completions = [
        [{"role": "assistant", "content": "Answer: 42"}],
        [{"role": "assistant", "content": "Answer: 41"}],
        # The last *assistant* message is scored, not a later tool message.
        [{"role": "assistant", "content": "Answer: 42"}, {"role": "tool", "content": "Answer: 0"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "Answer: 42"}]}],
    ]
    assert accuracy_reward(completions, ["42"] * 4) == [1.0, 0.0, 1.0, 1.0]


def test_accuracy_reward_garbage_inputs_score_zero():
    completions = [None, 17, [], [{"role": "assistant"}], "\\boxed{", "Answer: }{", "Answer: \\frac{", "\x00\x01"]
    assert accuracy_reward(completions, ["42"] * len(completions)) == [0.0] * len(completions)


def test_accuracy_reward_huge_completions_are_fast():
    huge_without_answer = "x" * 1_000_000
    huge_with_answer = "blah " * 200_000 + "\nAnswer: 42"
    huge_one_line = "Answer: " + "9" * 1_000_000
    start = time.perf_counter()
    rewards = accuracy_reward([huge_without_answer, huge_with_answer, huge_one_line], ["42", "42", "42"])
    assert time.perf_counter() - start < 2.0
    assert rewards == [0.0, 1.0, 0.0]


@pytest.mark.slow  # off the main thread the reward scores in a worker process (tests/test_reward_limits.py)
def test_accuracy_reward_in_a_worker_thread():
    # math-verify's signal-based timeouts only work in the main thread; elsewhere the reward scores in a worker process.
    results, errors = [], []

    def worker():
        try:
            results.append(accuracy_reward(["Answer: 42", "Answer: 4"], ["42", "42"]))
        except BaseException as exc:  # surfaced to the main thread below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert errors == []
    assert results == [[1.0, 0.0]]


def test_accuracy_reward_logs_extracted_answers():
    logged = {}
    accuracy_reward(
        ["Answer: 42", "nothing"], ["42", "42"], log_extra=lambda column, values: logged.update({column: values})
    )
    assert logged == {"extracted_answer": ["42", "[no answer]"]}


def test_accuracy_reward_length_mismatch():
    with pytest.raises(ValueError, match="same length"):
        accuracy_reward(["Answer: 1", "Answer: 2"], ["1"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Step 1.\nAnswer: 42", "42"),
        ("Answer: $x^2 + 1$.", "x^2 + 1"),
        ("Answer: \\(\\frac{1}{2}\\)", "\\frac{1}{2}"),
        ("**Answer**: 7", "7"),
        ("Answer: Answer: 9", "9"),
        ("so \\boxed{\\frac{a}{b}} and \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("nested \\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("unbalanced \\boxed{12", None),
        ("Answer:   ", None),
        ("no answer at all", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_only_reads_the_tail():
    early = "Answer: 1\n" + "." * (MAX_COMPLETION_CHARS + 10)
    assert extract_answer(early) is None
    assert extract_answer(early + "\nAnswer: 2") == "2"


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("2 + 2 = 4\nAnswer: 4", 1.0),
        ("Answer: 4", 1.0),
        ("2 + 2 = 4\nAnswer: 4\n\n   \n", 1.0),
        ("**Answer:** 4", 1.0),
        ("Answer: 4\nHope this helps!", 0.0),
        ("answer: 4", 0.0),
        ("Answer:", 0.0),
        ("The result is \\boxed{4}", 0.0),
        ("", 0.0),
        (None, 0.0),
        ([{"role": "assistant", "content": "Reasoning\nAnswer: 4"}], 1.0),
        ([{"role": "assistant", "content": "Answer: 4, I think"}], 1.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


def test_soft_overlong_punishment_values():
    # L_max = 20, L_cache = 4: no punishment up to 16 tokens, then (16 - |y|) / 4, then -1 beyond 20 tokens.
    reward = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=4)
    lengths = [0, 10, 16, 17, 18, 19, 20, 21, 100]
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert reward(completion_ids=[[1] * n for n in lengths]) == pytest.approx(expected)


def test_soft_overlong_punishment_paper_setting():
    # The paper's 2K setting: buffer 512, so punishment starts after 1536 tokens; 1792 is half-way: -256 / 512.
    reward = get_soft_overlong_punishment(max_completion_len=2048, soft_punish_cache=512)
    assert reward(completion_ids=[[0] * 1536, [0] * 1792, [0] * 2048, [0] * 2049]) == pytest.approx(
        [0.0, -0.5, -1.0, -1.0]
    )


def test_soft_overlong_punishment_without_buffer():
    reward = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=0)
    assert reward(completion_ids=[[0] * 8, [0] * 9]) == [0.0, -1.0]


@pytest.mark.parametrize(
    "max_completion_len, soft_punish_cache", [(0, 0), (-5, 1), (10, 11), (10, -1), (10.0, 2), (10, True)]
)
def test_soft_overlong_punishment_rejects_bad_arguments(max_completion_len, soft_punish_cache):
    with pytest.raises(ValueError):
        get_soft_overlong_punishment(max_completion_len, soft_punish_cache)


# Random text, and random strings of the tokens that drive answer extraction and LaTeX parsing.
_TOKENS = [
    "Answer:",
    "answer :",
    "**",
    "\\boxed{",
    "\\frac",
    "\\sqrt",
    "\\text{",
    "\\infty",
    "\\(",
    "\\)",
    "\\",
    "$",
] + ["{", "}", "^", "_", "/", ".", ",", "=", "-", "(", ")", "[", "]", "\n", " ", "x", "1", "2", "42", "0.5"]
_TRICKY_TEXT = st.text() | st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=_TRICKY_TEXT, gold=st.sampled_from(["42", r"\frac{1}{2}", "x^2", "}{"]))
def test_random_text_never_raises(completion, gold):
    answer = extract_answer(completion)
    assert answer is None or (isinstance(answer, str) and answer == answer.strip() and answer)
    (reward,) = accuracy_reward([completion], [gold])
    assert reward in (0.0, 1.0) if gold != "}{" else reward is None
    assert format_reward([completion])[0] in (0.0, 1.0)


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(), number=st.integers(min_value=0, max_value=10**9))
def test_final_answer_line_is_always_found(prefix, number):
    assert extract_answer(f"{prefix}\nAnswer: {number}") == str(number)


# ----------------------------------------------------------------------------------------- the authors' reward scale
#: The recipes of examples/rpg_math.py (the paper's runs and their LoRA versions), whose reward functions are
#: [accuracy_reward, overlong punishment] (and format_reward if asked for).
RECIPES = [
    path
    for path in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    if "examples/rpg_math.py" in path.read_text()
]
#: Completions, in group order, of two prompts of the tiny model's alphabet, and their solutions.
PLANNED = {"2+2=": ["Answer: 4", "   Answer: 4", "Answer: 5", "4"], "1+2=": ["Answer: 3"] * 3 + ["Answer: 3 "]}
SOLUTIONS = {"2+2=": "4", "1+2=": "3"}
#: The authors' rewards (their verl reward manager: DAPO's score, +1 if correct else -1, plus the overlong penalty
#: min(-(length - (L - buffer)) / buffer, 0)) by hand, for L = 12, buffer = 4; lengths 9, 12, 9, 1 and 9, 9, 9, 10:
#: (1 - 1/4, 1 - 1, -1 - 1/4, -1 + 0) and (1 - 1/4) x 3, 1 - 2/4.
AUTHORS_REWARDS = [[0.75, 0.0, -1.25, -1.0], [0.75, 0.75, 0.75, 0.5]]
#: Their advantages with the paper's scale_rewards="none": reward - group mean (means -0.375 and 0.6875).
AUTHORS_ADVANTAGES = [1.125, 0.375, -0.875, -0.625, 0.0625, 0.0625, 0.0625, -0.1875]
#: The same without the overlong penalty: the group means of (1, 1, -1, -1) and (1, 1, 1, 1) are 0 and 1.
AUTHORS_ACCURACY_ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]


@functools.lru_cache(maxsize=None)
def _scoring_trainer(model_dir, scale_rewards, reward_weights):
    """An RPGTrainer on the tiny model whose generations are PLANNED (TRL's `rollout_func` hook), with
    examples/rpg_math.py's reward functions of the recipes: [accuracy_reward, overlong punishment]."""
    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.testing import build_char_tokenizer

    from helpers.tiny_runs import quiet_cpu_args

    tokenizer = build_char_tokenizer()

    def planned_rollout(prompts, trainer):
        seen = {}
        completion_ids = []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            completion_ids.append(tokenizer(PLANNED[prompt][k], add_special_tokens=False)["input_ids"])
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    args = RPGConfig(
        **quiet_cpu_args(
            tempfile.mkdtemp(prefix="reward-scale-"),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=12,
            scale_rewards=scale_rewards,
            reward_weights=list(reward_weights),
        )
    )
    rewards = [accuracy_reward, get_soft_overlong_punishment(12, 4)]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    dataset = Dataset.from_dict({"prompt": list(PLANNED), "solution": list(SOLUTIONS.values())})
    trainer = RPGTrainer(
        model_dir, rewards, args=args, train_dataset=dataset, processing_class=tokenizer, rollout_func=planned_rollout
    )
    trainer.model.train()
    return trainer


def _advantages(model_dir, scale_rewards, reward_weights):
    trainer = _scoring_trainer(model_dir, scale_rewards, tuple(reward_weights))
    inputs = [{"prompt": p, "solution": SOLUTIONS[p]} for p in PLANNED for _ in range(4)]
    return trainer._generate_and_score_completions(inputs)["advantages"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_weight_the_rewards_to_the_authors_scale(recipe):
    config = yaml.safe_load(recipe.read_text())
    assert config["overlong_buffer"] > 0 and not config.get("format_reward", False)  # rewards: [accuracy, overlong]
    assert config["reward_weights"] == [2.0, 1.0]


#: The recipes whose advantages are TRL's group-relative ones: RPG and the GRPO / DAPO baselines.
GROUP_ADVANTAGE_RECIPES = [p for p in RECIPES if yaml.safe_load(p.read_text())["algorithm"] in ("rpg", "grpo", "dapo")]


@pytest.mark.parametrize("recipe", GROUP_ADVANTAGE_RECIPES, ids=lambda p: p.stem)
def test_recipes_reproduce_the_authors_advantages(recipe, tiny_model_dir):
    """With `reward_weights: [2.0, 1.0]` the trainer's reward is 2·accuracy + overlong = the authors' ±1 score +
    overlong + 1, and a constant cancels in every group-relative advantage: the paper recipes (group mean only) give
    the authors' advantages exactly, the baselines (divided by the group std) up to the std's epsilon (TRL 1e-4,
    verl 1e-6)."""
    config = yaml.safe_load(recipe.read_text())
    advantages = _advantages(tiny_model_dir, config["scale_rewards"], config["reward_weights"])
    expected = torch.tensor(AUTHORS_ADVANTAGES)
    if config["scale_rewards"] == "none":
        torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
    else:
        assert config["scale_rewards"] == "group"
        std = torch.tensor(AUTHORS_REWARDS).std(dim=1).repeat_interleave(4)  # unbiased, as verl's torch.std
        torch.testing.assert_close(advantages, expected / (std + 1e-6), rtol=1e-3, atol=0)


def test_accuracy_one_zero_gives_half_the_authors_advantage(tiny_model_dir):
    """accuracy_reward scores 1/0, the authors +1/-1 = 2·(1/0) - 1: the group-mean advantage of 1/0 is exactly half
    of theirs (so beta and the overlong penalty would weigh twice as much), and weight 2 restores it."""
    half = _advantages(tiny_model_dir, "none", [1.0, 0.0])
    torch.testing.assert_close(2 * half, torch.tensor(AUTHORS_ACCURACY_ADVANTAGES), rtol=0, atol=0)
    torch.testing.assert_close(
        _advantages(tiny_model_dir, "none", [2.0, 0.0]), torch.tensor(AUTHORS_ACCURACY_ADVANTAGES), rtol=0, atol=0
    )


def test_without_math_verify_the_rewards_import_and_accuracy_is_refused_naming_the_math_extra(monkeypatch):
    """math-verify is the `math` extra's (setup.cfg): without it, the rewards module imports, the rewards that do not
    compare answers work, and `accuracy_reward` raises an ImportError naming the extra before scoring anything. The
    module is loaded anew from its file (as its worker processes load it) while importing math_verify fails."""
    import importlib.util
    import sys

    from rpg_trl.math_task import rewards

    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises ImportError
    spec = importlib.util.spec_from_file_location("_rewards_without_math_verify", rewards.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.format_reward(["Work.\nAnswer: 42"]) == [1.0]
    assert module.extract_answer("Answer: 42") == "42"
    with pytest.raises(ImportError) as refused:
        module.accuracy_reward(["Answer: 42"], ["42"])
    assert str(refused.value) == (
        'accuracy_reward compares answers with math-verify, which is not installed: `pip install "rpg_trl[math]"` '
        "(math-verify>=0.8)."
    )
    assert rewards.accuracy_reward(["Answer: 42"], ["42"]) == [1.0]  # the installed module is untouched
