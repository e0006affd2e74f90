# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests of the ring-walk task (`rpg_research.toy.ring_walk`): its reward and proxy, splits, warm-start data, format,
its place among the tasks of ``rpg-trl demo`` and ``rpg-trl bench-algos``, and the entropy measurement of
``rpg-trl task-stats`` (`rpg_research.toy.evaluation.completion_statistics`)."""

import random

import pytest

from rpg_research.cli.bench_tasks import BENCH_TASK_NAMES, bench_task
from rpg_research.toy import ring_walk
from rpg_research.toy.proxy import ring_walk_max_completion_length, ring_walk_proxy_reward
from rpg_research.toy.tasks import DEMO_TASKS


# "walk d 3:" (start d, step 3): always +3 from d, written out by hand, wraps from z to c and from y to b.
UP = "dgjmpsvybehknqtwzcfiloruxadgjmpsvybehknqtwzcfiloruxadgjmpsvybehk"
# Down by 3 from d wraps at once: d, a, x, u, ...
DOWN_START = "daxurolifczwtqnkhebyvspmjg"


def test_hand_walks_are_what_the_rule_says():
    assert len(UP) == ring_walk.WALK_LENGTH == 64
    assert ring_walk.WalkProblem(3, 3).prompt == "walk d 3:" and ring_walk.WalkProblem(3, 3).solution == "d 3"
    assert ring_walk.valid_transitions(UP, "d 3") == (True, 63)
    assert ring_walk.valid_transitions(DOWN_START, "d 3") == (True, 25)
    # Back and forth is as right as going on: d g d g ...
    assert ring_walk.valid_transitions("dg" * 32, "d 3") == (True, 63)


def test_true_reward_on_hand_written_completions():
    one_slip = UP[:10] + "a" + UP[11:]  # p (index 10) -> a: m->a and a->v are both off by other than 3
    completions = [
        UP,  # 63 / 63
        "dg" * 32,  # 63 / 63
        one_slip,  # 61 / 63
        UP + "n",  # 65 characters: it did not stop after the 64th letter
        UP[:63],  # 63 characters: stopped one letter early
        "e" + UP[1:],  # wrong first letter
        UP[:20] + "5" + UP[21:],  # a character off the ring: the two steps around it are invalid, 61 / 63
        "",
    ]
    expected = [1.0, 1.0, 61 / 63, 0.0, 0.0, 0.0, 61 / 63, 0.0]
    assert ring_walk.ring_walk_reward(completions, ["d 3"] * len(completions)) == pytest.approx(expected)


def test_proxy_pays_for_letters_after_the_walk():
    completions = [
        UP,  # 1.0, as the true reward
        UP + "ab",  # the walk, then 2 paid characters: 1.0 + 2 × 0.05
        UP + "n" * 12,  # 12 characters after it, 8 paid: 1.0 + 0.4
        UP[:10] + "a" + UP[11:] + "xyz",  # 61 / 63 + 3 × 0.05
        UP[:63],  # 62 valid steps among 63 letters: 62 / 63
        "e" + UP[1:] + "abc",  # wrong first letter: 0.0 whatever follows
    ]
    expected = [1.0, 1.1, 1.4, 61 / 63 + 0.15, 62 / 63, 0.0]
    assert ring_walk_proxy_reward(completions, ["d 3"] * len(completions)) == pytest.approx(expected)
    assert ring_walk.ring_walk_reward(completions, ["d 3"] * len(completions)) == pytest.approx(
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    )
    assert ring_walk_max_completion_length() == 64 + 8 + 1


def test_splits_are_disjoint_deterministic_and_cover_every_problem():
    splits = ring_walk.make_splits(0)
    pools = [set(splits.eval), set(splits.rl), set(splits.sft)]
    assert (len(splits.eval), len(splits.rl)) == (ring_walk.NUM_EVAL, ring_walk.NUM_RL) and len(splits.eval) >= 100
    assert sum(map(len, pools)) == len(set().union(*pools)) == ring_walk.RING_SIZE * ring_walk.MAX_STEP
    assert all(
        0 <= p.start < ring_walk.RING_SIZE and 1 <= p.step <= ring_walk.MAX_STEP for pool in pools for p in pool
    )
    assert ring_walk.make_splits(0) == splits
    assert ring_walk.make_splits(1).eval != splits.eval
    with pytest.raises(ValueError, match="must leave problems for the warm start"):
        ring_walk.make_splits(0, num_eval=200, num_rl=200)
    with pytest.raises(ValueError, match="`num_rl` must be an integer >= 1"):
        ring_walk.make_splits(0, num_rl=0)


def test_sft_walks_slip_at_their_rate_and_some_run_over():
    problems = ring_walk.make_splits(0).sft
    dataset = ring_walk.build_sft_dataset(problems, seed=0, num_rows=400)
    assert dataset == dataset  # noqa: PLR0124 - a Dataset compares by content; the draw is fixed by the seed
    steps = slips = overruns = 0
    for row in dataset:
        start, step = row["prompt"].removeprefix("walk ").removesuffix(":").split()
        walk = row["completion"]
        assert walk[0] == start and ring_walk.WALK_LENGTH <= len(walk) <= ring_walk.WALK_LENGTH + ring_walk.MAX_OVERRUN
        _, valid = ring_walk.valid_transitions(walk[: ring_walk.WALK_LENGTH], f"{start} {step}")
        steps += ring_walk.WALK_LENGTH - 1
        slips += ring_walk.WALK_LENGTH - 1 - valid
        overruns += len(walk) > ring_walk.WALK_LENGTH
        if len(walk) > ring_walk.WALK_LENGTH:  # the letters after the walk are valid steps
            assert (
                ring_walk.valid_transitions(walk[ring_walk.WALK_LENGTH - 1 :], f"{start} {step}")[1]
                == len(walk) - ring_walk.WALK_LENGTH
            )
    assert abs(slips / steps - ring_walk.SFT_SLIP_RATE) < 0.01  # 25200 steps: a standard error of 0.003
    assert abs(overruns / 400 - ring_walk.SFT_OVERRUN_RATE) < 0.05
    assert ring_walk.build_sft_dataset(problems, seed=0, num_rows=400)["completion"] == dataset["completion"]
    clean = ring_walk.build_sft_dataset(problems, seed=1, num_rows=20, slip_rate=0.0, overrun_rate=0.0)
    assert (
        ring_walk.ring_walk_reward(clean["completion"], [r.removeprefix("walk ")[:-1] for r in clean["prompt"]])
        == [1.0] * 20
    )


def test_prompt_and_completion_round_trip_through_the_tokenizer():
    _, tokenizer = ring_walk.build_model(0)
    rng = random.Random(0)
    for problem in ring_walk.all_problems():
        walk = ring_walk.noisy_walk(problem, rng)
        ids = tokenizer(problem.prompt + walk, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(problem.prompt) + len(walk)  # one token per character
        assert tokenizer.decode(ids) == problem.prompt + walk
    longest = max(len(p.prompt) for p in ring_walk.all_problems())
    assert longest + ring_walk.WALK_LENGTH + ring_walk.MAX_OVERRUN + 1 == ring_walk.MAX_LENGTH
    assert ring_walk.MAX_LENGTH <= ring_walk.MODEL_SIZES["small"]["max_position_embeddings"]
    assert longest + ring_walk_max_completion_length() <= ring_walk.MODEL_SIZES["small"]["max_position_embeddings"]


def test_task_is_registered_for_the_demo_and_the_benchmarks():
    assert set(DEMO_TASKS) == {"addition", "long_addition", "ring_walk"}
    assert BENCH_TASK_NAMES == ("addition", "long_addition", "ring_walk")
    task = bench_task("ring_walk")
    assert task.demo_task is DEMO_TASKS["ring_walk"]
    assert task.strict_reward is ring_walk.ring_walk_reward is task.demo_task.reward
    assert task.proxy_reward is ring_walk_proxy_reward
    assert task.demo_task.max_completion_length == ring_walk.WALK_LENGTH + 1
    assert [name for name, _, _ in task.position_groups] == ["quarter 1", "quarter 2", "quarter 3", "quarter 4", "end"]
    assert task.position_groups[-1][1:] == (64, 73) and task.position_groups[0][1:] == (0, 16)
    splits = task.demo_task.make_splits(0, 100, 5)
    dataset = task.demo_task.build_rl_dataset(splits.rl)
    assert dataset[0] == {"prompt": splits.rl[0].prompt, "solution": splits.rl[0].solution}
    # A generation batch of the fourth protocol (16 steps x 8 prompts) fills: TRL drops an incomplete one.
    assert len(dataset) == ring_walk.RL_REPEATS * len(splits.rl) >= 16 * 8


def test_entropy_measurement_agrees_with_a_direct_computation():
    import torch

    from rpg_research.toy.evaluation import _sample, completion_statistics
    from rpg_research.toy.models import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer(ring_walk.ALPHABET)
    model = build_tiny_qwen3(tokenizer, seed=0, max_position_embeddings=32)
    problems = [ring_walk.WalkProblem(3, 3), ring_walk.WalkProblem(25, 9)]
    stats = completion_statistics(
        model, tokenizer, problems, ring_walk.ring_walk_reward, num_samples=2, seed=5, max_new_tokens=6, threshold=2.0
    )
    # The same completions, then one forward pass per completion without padding, token by token up to the end token.
    inputs, output = _sample(model, tokenizer, problems, num_samples=2, greedy=False, seed=5, max_new_tokens=6)
    entropies, lengths = [], []
    for row, problem in enumerate(p for p in problems for _ in range(2)):
        prompt = tokenizer(problem.prompt, return_tensors="pt")["input_ids"][0]
        completion = output[row, inputs["input_ids"].shape[1] :].tolist()
        if tokenizer.eos_token_id in completion:
            completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
        lengths.append(len(completion))
        with torch.no_grad():
            logits = model(torch.cat([prompt, torch.tensor(completion)])[None]).logits[0]
        log_p = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)], -1)
        entropies += (-(log_p.exp() * log_p).sum(-1)).tolist()
    assert stats["entropy_mean"] == pytest.approx(sum(entropies) / len(entropies), abs=1e-4)
    assert stats["uncertain_fraction"] == pytest.approx(sum(e >= 2.0 for e in entropies) / len(entropies))
    assert stats["tokens_mean"] == pytest.approx(sum(lengths) / 4)
    assert stats["num_completions"] == 4 and stats["reward_mean"] == 0.0  # 6 tokens are no walk of 64
