# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests of the statistics and the job runner of the benchmarks' protocol (`research/rpg_research/cli/protocol.py`), and of the
proxy task of the KL table (`research/rpg_research/toy/proxy.py`)."""

import json
import math

import pytest

from rpg_research.cli import protocol
from rpg_research.toy import proxy


# ----------------------------------------------------------------------------------------------------------------------
# intervals and the selection rule
# ----------------------------------------------------------------------------------------------------------------------


def test_t_quantiles_match_the_tables():
    # Student's t two-sided 95 % quantiles as printed in standard tables (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2).
    assert protocol.t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert protocol.t_quantile_975(4) == pytest.approx(2.776, abs=1e-3)
    assert protocol.t_quantile_975(9) == pytest.approx(2.262, abs=1e-3)
    assert protocol.t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    assert protocol.t_quantile_975(200) == pytest.approx(1.960, abs=1e-3)
    # The table decreases towards the normal quantile.
    assert all(a > b for a, b in zip(protocol.T_975, protocol.T_975[1:]))
    with pytest.raises(ValueError, match="integer >= 1"):
        protocol.t_quantile_975(0)


def test_mean_interval_by_hand():
    # Values 1, 2, 3, 4, 5: mean 3, sample sd sqrt(2.5) = 1.5811, standard error 0.70711, t(4) = 2.776 -> 1.9629.
    mean, half = protocol.mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0
    assert half == pytest.approx(1.9629, abs=1e-4)
    mean, half = protocol.mean_interval([0.4])
    assert mean == 0.4 and math.isnan(half)
    with pytest.raises(ValueError, match="empty"):
        protocol.mean_interval([])


def test_paired_difference_uses_the_shared_seeds_only():
    # Differences on seeds 1, 2, 3: 0.1, 0.3, 0.2 -> mean 0.2, sd 0.1, se 0.057735, t(2) = 4.303 -> 0.24843.
    mine = {1: 0.5, 2: 0.7, 3: 0.6, 9: 1.0}
    theirs = {1: 0.4, 2: 0.4, 3: 0.4, 8: 0.0}
    mean, half, n = protocol.paired_difference(mine, theirs)
    assert (mean, n) == (pytest.approx(0.2), 3)
    assert half == pytest.approx(0.24843, abs=1e-4)
    with pytest.raises(ValueError, match="share none"):
        protocol.paired_difference({1: 0.0}, {2: 0.0})


def test_selection_takes_the_highest_mean_and_the_smaller_rate_on_ties():
    assert protocol.select_best({1e-4: [0.25, 0.75], 3e-4: [0.75, 0.25], 1e-3: [0.0, 0.5]}) == 1e-4  # a tie at 0.5
    assert protocol.select_best({1e-4: [0.2], 3e-4: [0.5]}) == 3e-4
    with pytest.raises(ValueError, match="at least one score"):
        protocol.select_best({1e-4: []})


def test_format_interval():
    assert protocol.format_interval(0.1234, 0.0456, scale=100) == "12.3 ± 4.6"
    assert protocol.format_interval(-0.02, 0.01, scale=100, sign=True) == "-2.0 ± 1.0"
    assert protocol.format_interval(0.5, math.nan, digits=3) == "0.500"


# ----------------------------------------------------------------------------------------------------------------------
# jobs
# ----------------------------------------------------------------------------------------------------------------------

CALLS = []


def _square(spec, run_dir):
    CALLS.append(spec["x"])
    return {"y": spec["x"] ** 2}


def test_jobs_are_cached_by_their_specification(tmp_path):
    CALLS.clear()
    jobs = [({"x": x}, str(tmp_path / f"job{x}")) for x in (2, 3)]
    assert protocol.run_jobs(jobs, _square, desc="test") == [{"y": 4}, {"y": 9}]
    assert CALLS == [2, 3]
    # Run again: read back, nothing recomputed; a changed specification in the same folder is recomputed.
    assert protocol.run_jobs(jobs, _square, desc="test") == [{"y": 4}, {"y": 9}]
    assert CALLS == [2, 3]
    stored = json.loads((tmp_path / "job2" / protocol.RESULT_NAME).read_text())
    assert stored == {"spec": {"x": 2}, "result": {"y": 4}}
    changed = [({"x": 5}, str(tmp_path / "job2"))]
    assert protocol.run_jobs(changed, _square, desc="test") == [{"y": 25}]
    assert CALLS == [2, 3, 5]
    # A folder of the specification reached through a link is the same folder.
    (tmp_path / "warm").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "warm")
    linked = [({"x": 7, "sft_dir": str(tmp_path / "warm")}, str(tmp_path / "job7"))]
    assert protocol.run_jobs(linked, _square, desc="test") == [{"y": 49}]
    via_link = [({"x": 7, "sft_dir": str(tmp_path / "link")}, str(tmp_path / "job7"))]
    assert protocol.run_jobs(via_link, _square, desc="test") == [{"y": 49}]
    assert CALLS == [2, 3, 5, 7]
    CALLS.pop()
    # A truncated result file (a run killed while writing it) counts as missing.
    (tmp_path / "job3" / protocol.RESULT_NAME).write_text('{"spec": {"x": 3}, "res')
    assert protocol.run_jobs(jobs[1:], _square, desc="test") == [{"y": 9}]
    assert CALLS == [2, 3, 5, 3]


@pytest.mark.slow
def test_jobs_in_worker_processes_equal_jobs_in_this_process(tmp_path):
    jobs = [({"x": x}, str(tmp_path / f"job{x}")) for x in range(4)]
    with protocol.job_pool(2) as pool:
        assert pool is not None
        assert protocol.run_jobs(jobs, _square, pool=pool, desc="test") == [{"y": x * x} for x in range(4)]
    with protocol.job_pool(1) as pool:
        assert pool is None


# ----------------------------------------------------------------------------------------------------------------------
# the proxy task
# ----------------------------------------------------------------------------------------------------------------------


def test_proxy_pays_the_leading_number_and_the_length_strict_pays_exact_answers():
    completions = ["57", "57..", "56..", "57 \n:::::", "570", "x57", "", "57"]
    solutions = ["57"] * 7 + ["58"]
    bonus, cap = proxy.PROXY_LENGTH_BONUS, proxy.PROXY_MAX_BONUS_CHARS
    assert cap == 4 and bonus == 0.5
    assert proxy.proxy_reward(completions, solutions) == pytest.approx([1.0, 2.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    assert proxy.strict_reward(completions, solutions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # Room for three digits, the paid characters and the end-of-sequence token.
    assert proxy.PROXY_MAX_COMPLETION_LENGTH == 8


def test_the_long_tasks_proxy_pays_the_answer_line_and_its_padding():
    from rpg_research.toy.long_addition import MAX_COMPLETION_LENGTH, worked_solution

    right = worked_solution(4829, 3716)  # ends with "Answer: 8545"
    rows = right.rsplit("\n", 1)[0]
    completions = [
        right,
        right + "..",
        right + "\n:::::",
        rows + "\nAnswer: 8546..",
        rows + "\nAnswer: x8545",
        rows,
        "Answer: 8545",
        right + "\nAnswer: 1",
    ]
    solutions = ["8545"] * len(completions)
    assert proxy.answer_line_proxy_reward(completions, solutions) == pytest.approx(
        [1.0, 2.0, 3.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    )
    assert proxy.answer_line_strict_reward(completions, solutions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # The worked solution (110 tokens with the end token) and the 4 characters the proxy pays for.
    assert MAX_COMPLETION_LENGTH == 110 and proxy.long_max_completion_length() == 114


def test_heldout_scores_share_the_completions(tmp_path):
    from rpg_research.toy import build_model, heldout_accuracy
    from rpg_research.toy.addition import addition_reward
    from rpg_research.toy.evaluation import heldout_scores

    model, tokenizer = build_model(seed=0)
    pairs = [(12, 34), (56, 78), (90, 11)]
    seen = {}

    def record(name):
        def reward(completions, solution, **kwargs):
            seen[name] = list(completions)
            return [float(len(c)) for c in completions]

        return reward

    scores = heldout_scores(
        model, tokenizer, pairs, {"a": record("a"), "b": record("b")}, num_samples=2, seed=3, max_new_tokens=6
    )
    assert seen["a"] == seen["b"] and len(seen["a"]) == 6  # the same 3 x 2 completions, scored by both
    assert scores["a"] == scores["b"] == pytest.approx(sum(map(len, seen["a"])) / 6)
    assert all(len(tokenizer(c, add_special_tokens=False)["input_ids"]) <= 6 for c in seen["a"])
    # With the addition reward it is heldout_accuracy.
    accuracy = heldout_scores(model, tokenizer, pairs, {"accuracy": addition_reward}, num_samples=2, seed=3)
    assert accuracy["accuracy"] == heldout_accuracy(model, tokenizer, pairs, num_samples=2, seed=3)
    with pytest.raises(ValueError, match="reward_funcs"):
        heldout_scores(model, tokenizer, pairs, {})
