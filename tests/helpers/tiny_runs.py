"""What the tests that train a tiny local Qwen3 on CPU share: the prompts and the settings of a short, quiet run, the
trainer and the off-policy batch of the library's testing package (`rpg_trl.testing.runs`, importable from here too),
and the checks and assets of the library's own tests."""

import logging

import torch

# The tiny runs of the library's testing package, which the tests import from here (research/tests from there).
from rpg_trl.testing.runs import (  # noqa: F401
    PROMPTS,
    count_sevens,
    fixed_inputs,
    make_trainer,
    policy_logps,
    quiet_cpu_args,
    save_math_assets,
    tiny_run_args,
)


def sevens_unless_even(completions, prompts, **kwargs):
    """Constant (zero-variance) reward for prompts starting with an even digit, the count of '7's otherwise: the groups
    of even prompts have no signal (dynamic sampling drops them)."""
    return [0.0 if int(p[0]) % 2 == 0 else c.count("7") / 8 for p, c in zip(prompts, completions)]


def logged(trainer, key):
    """Every logged value of `key`, in order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def rpg_warnings(caplog):
    """The warnings that `rpg_trl` logged, as captured by pytest's `caplog`."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("rpg_trl") and r.levelno == logging.WARNING]


def assert_close_in_norm(actual, expected, ulps=64, dtype=None, what="tensor"):
    """`actual` equals `expected` up to floating-point rounding, on any CPU: ‖actual − expected‖ ≤ ulps · eps · ‖expected‖,
    with eps the machine epsilon of `dtype` (default: `expected`'s dtype). The bound is relative to the norm of the
    whole tensor, so entries near zero, whose value depends on the order in which the CPU's kernels sum, cannot fail
    it (an elementwise relative tolerance does); a missing or wrong term of the loss is orders of magnitude above it."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    eps = torch.finfo(dtype or expected.dtype).eps
    error = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert error <= ulps * eps * scale, f"{what}: |actual - expected| = {error:.3e} > {ulps} * {eps:.2e} * {scale:.3e}"


def loss_and_grad(trainer, inputs, accumulation_steps=1, with_logps_grad=False):
    """The training loss of `trainer._compute_loss` on `inputs` and the flattened gradient it gives; with
    `with_logps_grad`, also the gradient of the loss with respect to the policy's per-token log-probs (B, T): the part
    of the gradient that the loss itself decides, before the model's backward pass, which is the same code for any
    two trainers of the same model."""
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation_steps
    seen = []
    compute_logps = trainer._get_per_token_logps_and_entropies

    def keep_logps(*args, **kwargs):
        logps, *rest = compute_logps(*args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
            seen.append(logps)
        return (logps, *rest)

    trainer._get_per_token_logps_and_entropies = keep_logps
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    if not with_logps_grad:
        return loss.detach(), grads
    assert len(seen) == 1, f"expected one differentiable log-prob computation, got {len(seen)}"
    return loss.detach(), grads, seen[0].grad
