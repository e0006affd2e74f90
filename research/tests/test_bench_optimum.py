"""`rpg-trl bench-optimum`: the closed-form optima, the exact expected RPG gradient at them, and a short end-to-end run
of RPGTrainer that lands on its own objective's optimum (GRPO's uncorrected k3 on the forward one)."""

import math

import pytest
import torch

from rpg_research.cli.bench_optimum import VARIANTS, BenchOptimumArguments
from rpg_research.cli.optima import (
    effective_reward_scale,
    forward_kl_optimum,
    kl_optimum,
    reverse_kl_optimum,
    total_variation,
)
from rpg_trl.losses import PAPER_NAMES, rpg_per_token_loss


# ---- closed forms, checked against hand computations ----------------------------------------------------------------


def test_reverse_optimum_two_tokens_by_hand():
    # π*(1)/π*(0) = π_ref(1)/π_ref(0) · exp((R1 − R0)/β) = e^2 with uniform π_ref, R = (0, 1), β = 0.5.
    probs = reverse_kl_optimum([0.5, 0.5], [0.0, 1.0], 0.5)
    e2 = math.exp(2.0)
    assert probs == pytest.approx([1 / (1 + e2), e2 / (1 + e2)], abs=1e-12)


def test_forward_optimum_two_tokens_by_hand():
    # π(y) = β π_ref(y)/(λ − R(y)): 0.25/λ + 0.25/(λ − 1) = 1  <=>  λ² − 1.5 λ + 0.25 = 0, λ = (1.5 + √1.25)/2 > 1,
    # so π(0) = 0.25/λ = 0.190983..., π(1) = φ/2 = 0.809017... (φ the golden ratio).
    lam = (1.5 + math.sqrt(1.25)) / 2
    probs = forward_kl_optimum([0.5, 0.5], [0.0, 1.0], 0.5)
    assert probs == pytest.approx([0.25 / lam, 0.25 / (lam - 1)], abs=1e-12)
    assert probs[1] == pytest.approx((1 + math.sqrt(5)) / 4, abs=1e-12)


def test_forward_optimum_satisfies_its_lagrange_condition():
    ref = [0.4, 0.3, 0.2, 0.1]
    rewards = [0.0, 0.5, -1.0, 2.0]
    probs = forward_kl_optimum(ref, rewards, 0.3)
    lagrange = [r + 0.3 * p / q for r, p, q in zip(rewards, ref, probs)]  # R + β π_ref/π is the same λ everywhere
    assert max(lagrange) - min(lagrange) < 1e-9
    assert sum(probs) == pytest.approx(1.0, abs=1e-12)


def test_optima_approach_the_reference_for_large_beta_and_the_argmax_for_small():
    ref, rewards = [0.5, 0.3, 0.2], [0.0, 0.2, 1.0]
    for kind in ("reverse", "forward"):
        assert total_variation(kl_optimum(kind, ref, rewards, 1e4), ref) < 1e-3
        assert kl_optimum(kind, ref, rewards, 1e-3)[2] > 0.99


def test_effective_reward_scale_and_total_variation():
    assert effective_reward_scale(8) == 7 / 8
    assert total_variation([0.5, 0.5, 0.0], [0.0, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError, match="num_generations"):
        effective_reward_scale(1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ref_probs=[0.5, 0.6], rewards=[0, 1], beta=1.0), "ref_probs"),
        (dict(ref_probs=[0.5, 0.5], rewards=[0], beta=1.0), "rewards"),
        (dict(ref_probs=[0.5, 0.5], rewards=[0, 1], beta=0.0), "beta"),
    ],
)
def test_optimum_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        forward_kl_optimum(**kwargs)


def test_arguments_reject_bad_values():
    with pytest.raises(ValueError, match="variants"):
        BenchOptimumArguments(variants=["RPG-XKL"])
    with pytest.raises(ValueError, match="multiple of `num_generations`"):
        BenchOptimumArguments(batch_size=12, num_generations=8)
    with pytest.raises(ValueError, match="regimes"):
        BenchOptimumArguments(regimes=[])


def test_variant_names_are_the_paper_names():
    rpg = {name for name, spec in VARIANTS.items() if spec.trainer == "rpg" and spec.family == "corrected"}
    assert rpg == set(PAPER_NAMES.values())
    for name in rpg:
        spec = VARIANTS[name]
        assert PAPER_NAMES[(spec.overrides["divergence"], spec.overrides["estimator"])] == name
        assert spec.objective == ("reverse" if "RKL" in name else "forward")
    uncorrected = {name for name, spec in VARIANTS.items() if spec.family == "uncorrected"}
    assert uncorrected == {"GRPO-k3", "GRPO-k3-REINFORCE", "TRL-GRPO-uncorrected"}


# ---- the exact expected gradient of the RPG loss vanishes at the optimum of its own objective ------------------------

REF = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.07], dtype=torch.float64)
REWARDS = torch.linspace(0.0, 1.0, 6, dtype=torch.float64)
BETA = 0.3


def expected_gradient(probs, old_probs, *, divergence, estimator, kl_importance_weight=True):
    """∇_z of E_{y∼π_old}[loss(y)] for the softmax policy π = softmax(z) at π = `probs`, enumerating the tokens."""
    z = torch.log(probs).clone().requires_grad_(True)
    logps = torch.log_softmax(z, dim=0).unsqueeze(1)  # (K, 1): one completion per token
    per_token, _ = rpg_per_token_loss(
        logps,
        torch.log(old_probs).unsqueeze(1),
        REWARDS,  # advantage = R: the exact expectation needs no baseline
        torch.ones_like(logps),
        ref_logps=torch.log(REF).unsqueeze(1),
        divergence=divergence,
        estimator=estimator,
        beta=BETA,
        kl_importance_weight=kl_importance_weight,
    )
    (old_probs * per_token.squeeze(1)).sum().backward()
    return z.grad


def optimum(kind):
    return torch.tensor(kl_optimum(kind, REF.tolist(), REWARDS.tolist(), BETA), dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["reinforce", "differentiable"])
@pytest.mark.parametrize("divergence", ["fkl", "ufkl", "rkl", "urkl"])
def test_expected_rpg_gradient_vanishes_at_its_own_optimum(divergence, estimator):
    own = "reverse" if divergence in ("rkl", "urkl") else "forward"
    other = "forward" if own == "reverse" else "reverse"
    pi = optimum(own)
    # On-policy (π_old = π_θ), and off-policy with π_old inside the trust region (w in [0.9, 1.1]): the importance-
    # weighted estimate is unbiased for the gradient at π_θ, whatever π_old.
    tilt = torch.tensor([1.1, 0.9, 1.05, 0.95, 1.0, 1.02], dtype=torch.float64)
    for old in (pi, pi * tilt / (pi * tilt).sum()):
        grad = expected_gradient(pi, old, divergence=divergence, estimator=estimator)
        assert grad.abs().max() < 1e-9, (divergence, estimator, grad)
    grad_other = expected_gradient(optimum(other), optimum(other), divergence=divergence, estimator=estimator)
    assert grad_other.abs().max() > 1e-2


@pytest.mark.parametrize("estimator", ["reinforce", "differentiable"])
def test_uncorrected_k3_is_stationary_at_the_forward_optimum(estimator):
    """GRPO's k3 without the importance weight: on-policy its expected gradient is that of β·KL(π_ref‖π_θ), so it
    vanishes at the forward optimum, not at the reverse one that UKL(π_θ‖π_ref) has."""
    for kind, stationary in (("forward", True), ("reverse", False)):
        pi = optimum(kind)
        grad = expected_gradient(pi, pi, divergence="urkl", estimator=estimator, kl_importance_weight=False)
        assert (grad.abs().max() < 1e-9) == stationary, (kind, grad)


# ---- end to end: RPGTrainer on the one-token task ----------------------------------------------------------------


@pytest.mark.slow
def test_trainer_lands_on_its_own_objectives_optimum(tmp_path):
    """A short run of the benchmark: RPG-REINFORCE-URKL (off-policy) ends near the reverse optimum, RPG-FKL
    (on-policy) near the forward one, and GRPO's uncorrected k3 (off-policy) near the forward one, far from the reverse
    optimum it is meant to reach."""
    from tqdm.auto import tqdm

    from rpg_research.cli.bench_optimum import build_task, train_variant
    from rpg_research.toy import cpu_session

    # 60 steps of 48 completions: the distance to the own optimum is 0.02-0.08 over seeds 0-3 (0.015-0.035 after the
    # benchmark's 300 steps of 128), against 0.44 between the optima.
    args = BenchOptimumArguments(output_dir=str(tmp_path), steps=60, batch_size=48, learning_rate=3e-2)
    with cpu_session(1), tqdm(disable=True) as bar:
        task = build_task(tmp_path / "reference", args)
        apart = total_variation(task.optima["reverse"], task.optima["forward"])
        assert apart > 0.35  # the two optima are far apart, so landing near one is meaningful
        for variant, regime, lands_on in (
            ("RPG-REINFORCE-URKL", "off-policy", "reverse"),
            ("RPG-FKL", "on-policy", "forward"),
            ("GRPO-k3", "off-policy", "forward"),
        ):
            run = train_variant(task, args, variant, regime, tmp_path / variant, bar)
            other = "forward" if lands_on == "reverse" else "reverse"
            assert run["tv"][lands_on] < 0.12, (variant, run["tv"])
            assert run["tv"][other] > 0.3, (variant, run["tv"])
            assert run["curve"][0]["step"] == 0 and run["curve"][-1]["step"] == args.steps


def test_command_writes_table_figure_and_json(tmp_path, capsys):
    """`rpg-trl bench-optimum` end to end on one short run: the table (printed and written), the figure and the JSON at
    `--output-json`."""
    import json

    from rpg_research import cli

    output_json = tmp_path / "elsewhere" / "optimum.json"
    argv = ["bench-optimum", "--output-dir", str(tmp_path / "out"), "--output-json", str(output_json)]
    argv += ["--variants", "RPG-URKL", "--regimes", "off-policy", "--steps", "4", "--batch_size", "16"]
    assert cli.main(argv) == 0
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in capsys.readouterr().out and "| RPG-URKL |" in table
    report = json.loads(output_json.read_text())
    (run,) = report["runs"]
    assert (run["variant"], run["regime"], run["objective"]) == ("RPG-URKL", "off-policy", "reverse")
    assert sum(run["probs"]) == pytest.approx(1.0) and set(run["tv"]) >= {"reverse", "forward"}
    assert (tmp_path / "out" / "bench_optimum.png").read_bytes().startswith(b"\x89PNG")
    assert cli.main(["bench-optimum", "--variants", "RPG-XKL"]) == 2  # a clear error, no traceback
