"""`rpg-trl bench-kl-variance`: its exact KL of a Markov chain, its per-completion gradients and its report, checked
against enumeration of every completion of a short chain (float64)."""

import itertools
import json

import numpy as np
import pytest
import torch

from rpg_research.cli import main
from rpg_research.cli.bench_kl_variance import (
    ESTIMATES,
    KLVarianceArguments,
    estimate_of,
    exact_kl,
    markov_policies,
    per_completion_gradients,
)


VOCAB, LENGTH = 3, 3


def enumerated(logits):
    """Every completion of LENGTH tokens, (N, LENGTH), and its log-probability under the chain of `logits`, written as
    explicit loops over the softmax rows (row VOCAB is the first token's)."""
    ys = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    log_rows = torch.log_softmax(logits, -1)
    log_p = []
    for y in ys.tolist():
        previous, total = VOCAB, logits.new_zeros(())
        for token in y:
            total = total + log_rows[previous, token]
            previous = token
        log_p.append(total)
    return ys, torch.stack(log_p)


def policies(anchor):
    args = KLVarianceArguments(vocab_size=VOCAB, lengths=[LENGTH], theta_shift=0.5, old_shift=0.5, batch_size=2,
                               num_completions=4, group_size=2)  # fmt: skip
    return markov_policies(args, anchor, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_exact_kl_and_its_gradient_equal_the_enumerated_ones(anchor):
    theta, _, ref = policies(anchor)
    z = theta.clone().requires_grad_(True)
    ys, log_p = enumerated(z)
    _, log_q = enumerated(ref)
    by_enumeration = (log_p.exp() * (log_p - log_q)).sum()
    (expected,) = torch.autograd.grad(by_enumeration, z)
    z2 = theta.clone().requires_grad_(True)
    value = exact_kl(z2, ref, LENGTH)
    (got,) = torch.autograd.grad(value, z2)
    assert value.item() == pytest.approx(by_enumeration.item(), rel=1e-12)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kl_to_go", ["log_ratio", "k3"])
@pytest.mark.parametrize("divergence", ["urkl", "rkl"])
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_per_completion_gradients_average_to_the_exact_gradient_under_the_sampling_policy(
    anchor, divergence, kl_to_go
):
    # Σ_y π_old(y)·g(y) over every completion is ∇KL(π_θ‖π_ref): the gradients are assembled right and unbiased.
    theta, old, ref = policies(anchor)
    ys, log_old = enumerated(old)
    grads = per_completion_gradients(theta, old, ref, ys, divergence, kl_to_go, anchor, chunk=5)
    mean = (log_old.exp()[:, None] * grads).sum(0)
    z = theta.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(exact_kl(z, ref, LENGTH), z)
    assert exact.norm() > 1e-2
    np.testing.assert_allclose(mean.numpy(), exact.flatten().numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("divergence", ["urkl", "rkl"])
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_the_exact_per_position_kl_gradients_average_to_the_exact_gradient(anchor, divergence):
    # kl_estimate="vocabulary" at the sequence level: the direct term added in the previous token's row, the KL-to-go
    # on the score; over every completion, weighted by π_old, the exact ∇KL(π_θ‖π_ref) (float64, no kernel here).
    theta, old, ref = policies(anchor)
    ys, log_old = enumerated(old)
    grads = per_completion_gradients(theta, old, ref, ys, divergence, "log_ratio", anchor, kl_estimate="vocabulary")
    mean = (log_old.exp()[:, None] * grads).sum(0)
    z = theta.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(exact_kl(z, ref, LENGTH), z)
    np.testing.assert_allclose(mean.numpy(), exact.flatten().numpy(), rtol=1e-9, atol=1e-12)


def test_the_command_writes_its_report_and_the_k3_estimate_varies_less(tmp_path):
    out = tmp_path / "kl_variance"
    status = main(["bench-kl-variance", "--lengths", "32", "--divergences", "urkl", "--anchors", "reference",
                   "--num_completions", "512", "--output_dir", str(out)])  # fmt: skip
    assert status == 0
    report = json.loads((out / "results.json").read_text())
    rows = {estimate_of(r): r for r in report["rows"]}
    assert set(rows) == set(ESTIMATES)
    unbiased = [e for e in ESTIMATES if e[0] == "sequence" and e[2] == "exact"]
    assert len(unbiased) == 5
    for key in unbiased:  # within 4 standard errors
        assert rows[key]["relative_bias"] < 4 * rows[key]["bias_standard_error"], key
    k3, sampled = rows[("sequence", "k3", "exact", "sample", "none")], rows[ESTIMATES[0]]
    assert k3["relative_variance"] < sampled["relative_variance"]
    # Each position's exact KL varies less than its sampled estimate, and the baseline lowers the KL-to-go's noise.
    token = rows[("token", "log_ratio", "exact", "sample", "none")]
    assert (
        rows[("token", "log_ratio", "exact", "vocabulary", "none")]["relative_variance"] < token["relative_variance"]
    )
    exact_to_go = rows[("sequence", "log_ratio", "exact", "vocabulary", "none")]
    baselined = rows[("sequence", "log_ratio", "exact", "vocabulary", "leave_one_out")]
    assert baselined["relative_variance"] < exact_to_go["relative_variance"]
    table = (out / "table.md").read_text()
    assert "sequence, kl_to_go=k3, exact" in table and "token level, exact, exact per-position KL" in table
    assert (out / "kl_variance.png").stat().st_size > 0


def test_bad_arguments_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="`divergences` must be one or more of"):
        KLVarianceArguments(divergences=["ufkl"])
    with pytest.raises(ValueError, match="`group_size` must be an integer >= 2 that divides num_completions"):
        KLVarianceArguments(group_size=3)
    with pytest.raises(ValueError, match="`batch_size` must be an even integer"):
        KLVarianceArguments(batch_size=3)
    with pytest.raises(ValueError, match="`num_completions` must be at least 2 × batch_size"):
        KLVarianceArguments(num_completions=100, batch_size=64)
    assert main(["bench-kl-variance", "--lengths", "1"]) == 2
