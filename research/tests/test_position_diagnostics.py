"""The diagnostics by position of `rpg-trl bench-algos` (rpg_research.cli.position_diagnostics): each recorded number
against a direct computation, and, on real training steps, against the trainers' own logged metrics (RPGTrainer's
largest importance weight, GRPOTrainer's clipped fraction), with the loss unchanged by the wrapper."""

import math

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from rpg_research.cli.bench_tasks import bench_task
from rpg_research.cli.position_diagnostics import (
    GRADIENT_KEYS,
    PositionDiagnostics,
    format_gradients_table,
    kl_gradient_diagnostics,
    summarize_gradients,
    summarize_positions,
)
from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.testing.runs import PROMPTS, count_sevens, fixed_inputs, make_trainer, tiny_run_args


def _batch():
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 2
    old = logps + torch.randn(3, 6, generator=generator, dtype=torch.float64) * 0.6
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    return logps, {
        "old_per_token_logps": old,
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -1.0, -0.5], dtype=torch.float64),
    }


def _expected(logps, inputs, start, stop, *, epsilon_low, epsilon_high, clip_c, dual):
    """The numbers of one group, computed token by token with numpy (no code of the module)."""
    log_w, clipped, s = [], [], []
    old, mask, adv = inputs["old_per_token_logps"], inputs["completion_mask"], inputs["advantages"]
    c = clip_c
    for b in range(logps.shape[0]):
        length = int(mask[b].sum())
        token_log_w = [float(logps[b, t] - old[b, t]) for t in range(length)]
        # urkl anchored to the sampling policy: M_t = max over t' >= t of the prefix ratio W<=t'.
        prefix = np.cumsum(token_log_w)
        for t in range(start, min(stop, length)):
            lw, a, w = token_log_w[t], float(adv[b]), math.exp(token_log_w[t])
            log_w.append(lw)
            region = (a < 0 and w < 1 - epsilon_low) or (a > 0 and w > 1 + epsilon_high)
            clipped.append(region or (dual and a < 0 and w > c))
            s.append(min(1.0, c / math.exp(max(prefix[t:]))))
    return np.array(log_w), np.array(clipped, dtype=float), np.array(s)


@pytest.mark.parametrize("dual", [True, False])
def test_each_number_is_the_direct_computation(dual):
    from rpg_trl.losses import RPGLossSpec

    logps, inputs = _batch()
    groups = (("a", 0, 2), ("b", 2, 6))
    spec = RPGLossSpec(divergence="urkl", kl_level="sequence", clip_c=1.5)
    diagnostics = PositionDiagnostics(groups)
    settings = dict(epsilon_low=0.2, epsilon_high=0.28, clip_c=1.5)
    diagnostics.record(logps, inputs, **settings, dual_clip=dual, spec=spec, reference=False)
    diagnostics.record(logps, inputs, **settings, dual_clip=dual, spec=spec, reference=False)  # a second, equal step
    summary = diagnostics.summary()
    for name, start, stop in groups:
        log_w, clipped, s = _expected(logps, inputs, start, stop, **settings, dual=dual)
        got = summary[name]
        assert got["steps"] == 2
        assert got["log_w_p05"] == pytest.approx(np.quantile(log_w, 0.05), abs=1e-9)
        assert got["log_w_p95"] == pytest.approx(np.quantile(log_w, 0.95), abs=1e-9)
        assert got["log_w_max"] == pytest.approx(log_w.max(), abs=1e-9)
        assert got["log_w_min"] == pytest.approx(log_w.min(), abs=1e-9)
        assert got["clipped"] == pytest.approx(clipped.mean(), abs=1e-12)
        assert got["s_p50"] == pytest.approx(np.quantile(s, 0.5), abs=1e-9)
        assert got["s_p05"] == pytest.approx(np.quantile(s, 0.05), abs=1e-9)
        assert got["s_below_1"] == pytest.approx((s < 1).mean(), abs=1e-12)
    # The batch has tokens in the dual-clip region only if the test means something there.
    assert dual is False or any(
        float(inputs["advantages"][b]) < 0
        and math.exp(float(logps[b, t] - inputs["old_per_token_logps"][b, t])) > 1.5
        and inputs["completion_mask"][b, t]
        for b in range(3)
        for t in range(6)
    )


def test_groups_are_checked_and_token_level_runs_record_no_truncation():
    with pytest.raises(ValueError, match="start < stop"):
        PositionDiagnostics([("empty", 3, 3)])
    with pytest.raises(ValueError, match="is empty"):
        PositionDiagnostics([])
    logps, inputs = _batch()
    diagnostics = PositionDiagnostics([("all", 0, 6), ("past the end", 6, 9)])
    diagnostics.record(
        logps, inputs, epsilon_low=0.2, epsilon_high=0.2, clip_c=math.inf, dual_clip=False, spec=None, reference=False
    )
    summary = diagnostics.summary()
    assert "past the end" not in summary and "s_p50" not in summary["all"]
    rows = summarize_positions([{"algorithm": "X", "positions": summary}, {"algorithm": "Y"}], "algorithm")
    assert [(row["algorithm"], row["positions"], row["s_p50"]) for row in rows] == [("X", "all", None)]


def _train(trainer_class, config_class, tiny_model_dir, tmp_path, attach, **overrides):
    args = config_class(
        **tiny_run_args(tmp_path, steps_per_generation=4, max_steps=4, warmup_steps=0, learning_rate=3e-2, **overrides)
    )
    trainer = trainer_class(model=tiny_model_dir, reward_funcs=count_sevens, args=args, train_dataset=PROMPTS)
    diagnostics = PositionDiagnostics([("all", 0, 8)]).attach(trainer) if attach else None
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return steps, diagnostics


def test_rpg_trainer_steps_match_its_logged_weights_and_keep_their_loss(tiny_model_dir, tmp_path):
    steps, diagnostics = _train(RPGTrainer, RPGConfig, tiny_model_dir, tmp_path / "a", True, kl_level="sequence")
    plain, _ = _train(RPGTrainer, RPGConfig, tiny_model_dir, tmp_path / "b", False, kl_level="sequence")
    # The extra backward passes of the gradient diagnostics change neither the loss nor the updates.
    assert [entry["loss"] for entry in steps] == [entry["loss"] for entry in plain]
    assert [entry["grad_norm"] for entry in steps] == [entry["grad_norm"] for entry in plain]
    # One record per step (4 steps per generation batch: only the first follows a refresh of π_old), and the loss's
    # diagnostics equal those the trainer logs.
    gradient_steps = diagnostics.gradient_steps
    assert [step["after_refresh"] for step in gradient_steps] == [True, False, False, False]
    for key, metric in GRADIENT_KEYS.items():
        if metric is not None:
            assert [step[key] for step in gradient_steps] == pytest.approx([e[metric] for e in steps], rel=1e-5)
    # On-policy, anchored to π_old, the KL term has no gradient: no cosine, a ratio of 0.
    assert math.isnan(gradient_steps[0]["kl_grad_cosine"]) and gradient_steps[0]["kl_reward_grad_ratio"] == 0
    later = gradient_steps[1:]
    assert all(-1 <= step["kl_grad_cosine"] <= 1 and step["kl_reward_grad_ratio"] > 0 for step in later)
    summary = diagnostics.gradient_summary()
    assert summary["steps"] == 4 and summary["refreshes"] == 1
    assert math.isnan(summary["kl_grad_cosine/after_refresh"])  # no finite value to average
    assert summary["kl_grad_cosine/later"] == pytest.approx(sum(step["kl_grad_cosine"] for step in later) / 3)
    assert summary["kl_reward_grad_ratio/later"] == pytest.approx(sum(s["kl_reward_grad_ratio"] for s in later) / 3)
    rows = summarize_gradients([{"arm": "RPG", "kl_gradient": summary}, {"arm": "no KL"}], "arm")
    assert [row["arm"] for row in rows] == ["RPG"] and "RPG" in format_gradients_table(rows, "arm", "caption")
    recorded = diagnostics.steps["all"]
    assert len(recorded["log_w_max"]) == 4
    logged_max = [entry["importance_weight/max"] for entry in steps]
    assert [math.exp(v) for v in recorded["log_w_max"]] == pytest.approx(logged_max, rel=1e-5)
    assert max(logged_max) > 1.01  # the policy moved within the generation batch: the comparison means something
    assert all(0 < value <= 1 for value in recorded["s_p05"])


def test_grpo_trainer_steps_match_trls_clipped_fraction(tiny_model_dir, tmp_path):
    steps, diagnostics = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path, True, beta=0.0)
    recorded = diagnostics.steps["all"]
    assert recorded["clipped"] == pytest.approx([entry["clip_ratio/region_mean"] for entry in steps], abs=1e-6)
    assert max(recorded["clipped"]) > 0  # some tokens were clipped: the comparison means something
    assert "s_p50" not in recorded


def test_the_long_tasks_groups_are_its_rows():
    from rpg_research.toy.long_addition import MAX_COMPLETION_LENGTH, worked_solution

    groups = bench_task("long_addition").position_groups
    text = worked_solution(4829, 3716)
    lines = text.split("\n")
    for (name, start, stop), line in zip(groups[:-1], lines[:-1], strict=True):
        # Each row group is the row's characters and its line break (one token per character).
        assert text[start:stop] == line + "\n", name
    assert groups[-1][1:] == (4 * 24, MAX_COMPLETION_LENGTH) and text[groups[-1][1] :] == "Answer: 8545"


def _direct_kl_sequence_weights(logps, old):
    """K_t = Σ_{t'≥t} W≤t'·log w_t' (urkl between whole completions, anchored to π_old, unclipped), float64, row by
    row (no code of rpg_trl.losses)."""
    log_w = (logps - old).detach().double()
    weights = torch.zeros_like(log_w)
    for b in range(log_w.shape[0]):
        prefix = torch.cumsum(log_w[b], 0)
        for t in range(log_w.shape[1]):
            weights[b, t] = sum(math.exp(prefix[s]) * log_w[b, s] for s in range(t, log_w.shape[1]))
    return weights


def test_kl_gradient_numbers_are_the_direct_computation(tiny_model_dir, tmp_path):
    """The half-batch cosine and the gradient-norm ratio on a tiny model, against gradients computed from fresh
    forward passes of each half with the closed-form weights: the KL term's β·K_t·∇log π_θ and the reward term's
    w·A·∇log π_θ, summed per completion and averaged over the completions (loss_type="luspo")."""
    beta = 0.3
    trainer = make_trainer(tiny_model_dir, tmp_path, beta=beta, kl_level="sequence", loss_type="luspo", rpg_clip=False)
    trainer.model.double()
    inputs = fixed_inputs(trainer, spread=0.4)
    inputs["completion_mask"][:, :] = 1  # full rows: the closed form needs no mask
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"].double()
    inputs["advantages"] = inputs["advantages"].double()
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]

    def logps_of(rows):
        ids = torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows]], dim=1)
        mask = torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], dim=1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].size(1)
        )
        return logps

    def flat(loss):
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, parameters, allow_unused=False)])

    def kl_gradient(rows):
        logps = logps_of(rows)
        weights = _direct_kl_sequence_weights(logps, inputs["old_per_token_logps"][rows])
        return flat((beta * weights * logps).sum(-1).mean())

    def reward_gradient(rows):
        logps = logps_of(rows)
        w = torch.exp(logps - inputs["old_per_token_logps"][rows])
        return flat(-(w * inputs["advantages"][rows, None]).sum(-1).mean())

    trainer.model.train()
    first, second = kl_gradient(slice(0, 4)), kl_gradient(slice(4, 8))
    expected_cosine = float(first @ second / (first.norm() * second.norm()))
    expected_ratio = float(kl_gradient(slice(None)).norm() / reward_gradient(slice(None)).norm())

    def aggregate(per_token_loss, fmask):
        return trainer._aggregate(per_token_loss, fmask, inputs, "eval")[0]

    numbers = kl_gradient_diagnostics(
        trainer.model.parameters(), logps_of(slice(None)), inputs, trainer.loss_spec, aggregate
    )
    assert first.norm() > 0 and second.norm() > 0 and abs(expected_cosine) < 0.999  # not degenerate
    assert numbers["kl_grad_cosine"] == pytest.approx(expected_cosine, rel=1e-9, abs=1e-12)
    assert numbers["kl_reward_grad_ratio"] == pytest.approx(expected_ratio, rel=1e-9)
