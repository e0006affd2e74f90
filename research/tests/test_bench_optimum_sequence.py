"""Tests of `rpg-trl bench-optimum --completion_length 2` (`rpg_research.cli.bench_optimum_sequence`): the tree of
completions, the exact fixed points (kl_level="sequence" lands on the closed-form optimum over completions, "token" does
not) and a short training run of each level."""

import math

import pytest
import torch

from rpg_research.cli.bench_optimum import BenchOptimumArguments
from rpg_research.cli.bench_optimum_sequence import (
    FIXED_POINTS,
    SEQUENCE_VARIANTS,
    Tree,
    completion_reward,
    exact_fixed_point,
)
from rpg_research.cli.optima import kl_optimum, total_variation


def test_the_tree_holds_every_completion_once_and_its_probabilities_sum_to_one():
    tree = Tree(vocab_size=4, eos=1, length=3)
    # 1 completion ends at the first token, 3·1 at the second, and 3·3·4 reach three tokens.
    assert len(tree.completions) == 1 + 3 + 36 == len(set(tree.completions))
    assert len(tree.prefixes) == 1 + 3 + 9
    table = torch.log_softmax(torch.randn(len(tree.prefixes), 4, dtype=torch.float64), -1)
    assert sum(tree.probabilities(table)) == pytest.approx(1.0, abs=1e-12)
    y = (2, 3, 1)  # the probability of one completion by hand: three conditionals
    by_hand = table[tree.index[()], 2] + table[tree.index[(2,)], 3] + table[tree.index[(2, 3)], 1]
    assert tree.probabilities(table)[tree.completions.index(y)] == pytest.approx(math.exp(by_hand.item()))


def test_rewards_read_the_completion_text_without_the_end_token():
    tokens = ["<pad>", "</s>", ":", "A", "Q", "a", "b"]
    assert completion_reward((5, 6), tokens, eos=1) == 1.0
    assert completion_reward((6, 6), tokens, eos=1) == 0.5
    assert completion_reward((5, 1), tokens, eos=1) == 0.0 and completion_reward((1,), tokens, eos=1) == 0.0


def _small_problem():
    """A random reference over completions of up to 2 tokens of a 4-token vocabulary, and a non-additive reward."""
    tree = Tree(vocab_size=4, eos=1, length=2)
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(len(tree.prefixes), 4, generator=g, dtype=torch.float64) * 1.5, -1)
    rewards = [1.0 if y == (2, 3) else 0.5 if y == (3, 3) else 0.0 for y in tree.completions]
    return tree, ref, rewards


@pytest.mark.parametrize("divergence", ["fkl", "ufkl", "rkl", "urkl"])
def test_the_exact_sequence_level_fixed_point_is_the_closed_form_optimum(divergence):
    tree, ref, rewards = _small_problem()
    beta = 0.2
    kind = "reverse" if divergence in ("rkl", "urkl") else "forward"
    optimum = kl_optimum(kind, tree.probabilities(ref), rewards, beta)
    probs, residual = exact_fixed_point(
        tree, ref, rewards, beta=beta, overrides={"divergence": divergence, "kl_level": "sequence"}, steps=400
    )
    assert residual < 1e-5
    assert total_variation(probs, optimum) < 1e-4
    # The per-token KL weighting has another fixed point on this problem (measured: 0.18 forward, 0.07 reverse).
    token, residual = exact_fixed_point(
        tree, ref, rewards, beta=beta, overrides={"divergence": divergence, "kl_level": "token"}, steps=400
    )
    assert residual < 1e-5 and total_variation(token, optimum) > 0.05


def test_variants_name_their_level_and_their_fixed_point():
    assert len(SEQUENCE_VARIANTS) == 8 * 2 + 3
    for name, spec in SEQUENCE_VARIANTS.items():
        assert name.endswith(f"({spec.level})") and spec.fixed_point in FIXED_POINTS
        if spec.trainer == "rpg" and spec.family == "corrected":
            assert spec.fixed_point == f"{spec.overrides['divergence']}/{spec.level}"
    assert SEQUENCE_VARIANTS["TRL-GRPO (token)"].fixed_point == "urkl/token"
    assert SEQUENCE_VARIANTS["TRL-GRPO-uncorrected (token)"].fixed_point == "k3/token"


def test_arguments_check_the_completion_length_and_the_variant_names():
    with pytest.raises(ValueError, match="completion_length"):
        BenchOptimumArguments(completion_length=4)
    with pytest.raises(ValueError, match="variants"):
        BenchOptimumArguments(completion_length=2, variants=["RPG-FKL"])  # one-token names need a level here
    assert BenchOptimumArguments(completion_length=2).variants == list(SEQUENCE_VARIANTS)


@pytest.mark.slow
def test_training_lands_on_the_optimum_with_sequence_kl_and_on_the_token_fixed_point_without(tmp_path):
    """A short run of RPG-REINFORCE-FKL at both levels on the benchmark's task: the sequence level ends near the
    optimum over completions; the token level ends near its own exact fixed point, far from that optimum."""
    from tqdm.auto import tqdm

    from rpg_research.cli.bench_optimum_sequence import build_sequence_task, train_sequence_variant
    from rpg_research.toy import cpu_session

    names = ["RPG-REINFORCE-FKL (sequence)", "RPG-REINFORCE-FKL (token)"]
    args = BenchOptimumArguments(
        output_dir=str(tmp_path), completion_length=2, variants=names, steps=100, batch_size=64, eval_every=50
    )
    with cpu_session(1), tqdm(disable=True) as bar:
        task = build_sequence_task(tmp_path / "reference", args)
        token_bias = total_variation(task.fixed_points["fkl/token"]["probs"], task.optima["forward"])
        assert token_bias > 0.15  # the task separates the two levels
        sequence, token = (train_sequence_variant(task, args, v, "on-policy", tmp_path / v, bar) for v in names)
    assert sequence["tv_optimum"] < 0.06, sequence["tv_optimum"]
    assert token["tv_fixed_point"] < 0.08 and token["tv_optimum"] > 0.15, token


def test_command_writes_table_figure_and_json(tmp_path, capsys):
    """`rpg-trl bench-optimum --completion_length 2` end to end on one short run: the table (printed and written), the
    figure, the JSON at `--output-json` with the machine it ran on."""
    import json

    from rpg_research import cli

    output_json = tmp_path / "elsewhere" / "sequence.json"
    argv = ["bench-optimum", "--completion_length", "2", "--output-dir", str(tmp_path / "out")]
    argv += ["--output-json", str(output_json), "--variants", "RPG-URKL (sequence)", "--regimes", "on-policy"]
    argv += ["--steps", "4", "--batch_size", "16"]
    assert cli.main(argv) == 0
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in capsys.readouterr().out and "| RPG-URKL | sequence | reverse-KL |" in table
    assert (tmp_path / "out" / "bench_optimum_sequence.png").exists()
    report = json.loads(output_json.read_text())
    (run,) = report["runs"]
    assert (run["variant"], run["regime"], run["level"]) == ("RPG-URKL (sequence)", "on-policy", "sequence")
    assert sum(run["probs"]) == pytest.approx(1.0) and run["curve"][0]["step"] == 0
    assert report["machine"]["cpu_capability"] and report["task"]["fixed_points"]["urkl/sequence"]["residual"] < 1e-3
