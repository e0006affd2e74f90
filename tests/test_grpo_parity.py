"""Drop-in parity with TRL's `GRPOTrainer`: where an RPG setting coincides with a GRPO setting, the loss, the gradient,
the metrics and the state are GRPOTrainer's on the same batch or the same run (the expected values come from TRL)."""

import json
import math

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from helpers.tiny_runs import (
    assert_close_in_norm,
    fixed_inputs,
    logged,
    loss_and_grad,
    make_trainer,
    policy_logps,
)


#: RPG settings whose loss is GRPO's PPO clip (+ TRL's bias-corrected k3 when beta > 0): the differentiable estimator,
#: RPG-URKL toward the reference model, and a dual-clip bound too far to act.
COINCIDING_RPG = dict(estimator="differentiable", divergence="urkl", clip_c=1e9)


def _pair(model_dir, tmp_path, loss_type, beta, rpg_only=None, **shared):
    shared = dict(epsilon=0.2, epsilon_high=0.28, scale_rewards="group", loss_type=loss_type, **shared)
    grpo = make_trainer(model_dir, tmp_path / "g", GRPOTrainer, GRPOConfig, beta=beta, **shared)
    anchor = dict(kl_anchor="reference") if beta else {}
    rpg = make_trainer(model_dir, tmp_path / "r", beta=beta, **anchor, **COINCIDING_RPG, **(rpg_only or {}), **shared)
    for p_g, p_r in zip(grpo.model.parameters(), rpg.model.parameters()):
        assert torch.equal(p_g, p_r)
    return grpo, rpg


def _assert_same(grpo, rpg, inputs, accumulation_steps=1):
    """The two trainers' losses on `inputs`, the gradients of the losses with respect to the per-token log-probs (what
    the loss decides: exact), and the parameter gradients (the same model backward pass applied to those)."""
    loss_g, grad_g, logps_grad_g = loss_and_grad(grpo, inputs, accumulation_steps, with_logps_grad=True)
    loss_r, grad_r, logps_grad_r = loss_and_grad(rpg, inputs, accumulation_steps, with_logps_grad=True)
    # Elementwise float32 arithmetic and short sums: equal to a few float32 units of the tensor's norm on any CPU.
    # (Measured: under 1 unit; β off by 0.1 % moves them by ~23 and ~180 units.)
    assert_close_in_norm(loss_r, loss_g, ulps=8, what="loss")
    assert_close_in_norm(logps_grad_r, logps_grad_g, ulps=16, what="gradient w.r.t. the per-token log-probs")
    # The parameter gradient sums per-token terms of both signs through the model; how a CPU's kernels (AVX2, AVX-512
    # or none) order those sums moves it by up to ~1e-5 of its norm (measured over ATEN_CPU_CAPABILITY=default and
    # avx2), so it gets 2^10 float32 units; a wrong or missing term of the loss moves it by orders of magnitude more.
    assert_close_in_norm(grad_r, grad_g, ulps=2**10, what="parameter gradient")


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo", "luspo"])
def test_loss_type_normalisers_and_masks_equal_grpo_trainer(tiny_model_dir, tmp_path, loss_type):
    """TRL's normaliser of every loss_type, with and without TRL's credit-assignment masks (which act on the policy
    term only, while β·KL acts on every token), on an off-policy batch with the KL term toward a reference."""
    grpo, rpg = _pair(tiny_model_dir, tmp_path, loss_type, beta=0.1)
    inputs = fixed_inputs(grpo, spread=0.2)  # inside the trust region: RPG's clipped KL weight is w itself
    _assert_same(grpo, rpg, inputs)
    _assert_same(grpo, rpg, inputs, accumulation_steps=2)
    for trainer in (grpo, rpg):
        trainer.top_entropy_quantile = 0.5
    _assert_same(grpo, rpg, inputs)
    for trainer in (grpo, rpg):
        trainer.top_entropy_quantile = 1.0
        trainer.off_policy_mask_threshold = 0.004
    # The off-policy mask drops some sequences (negative advantage, sequence KL above the threshold) and keeps others.
    grpo.model.eval()
    logps = policy_logps(
        grpo, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
    )
    kept = grpo.get_off_policy_mask(
        inputs["advantages"].unsqueeze(1), logps, inputs["old_per_token_logps"], inputs["completion_mask"], 0.004
    )
    assert 0 < kept.sum() < kept.numel()
    _assert_same(grpo, rpg, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_ppo_clip_equals_grpo_trainer_outside_the_trust_region(tiny_model_dir, tmp_path, loss_type):
    # β = 0: RPG's differentiable reward term with an unreachable dual-clip bound is PPO's clip, clipping included.
    grpo, rpg = _pair(tiny_model_dir, tmp_path, loss_type, beta=0.0)
    _assert_same(grpo, rpg, fixed_inputs(grpo, spread=0.6))
    assert rpg._metrics["train"]["clip_ratio/region_mean"][-1] > 0.1  # the clip acts on this batch
    # The clip metrics GRPOTrainer logs, logged alike (RPG reduces them on the device and copies them to the host
    # at once; GRPOTrainer with one `.item()` each and TRL's `nanmin`/`nanmax`).
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert rpg._metrics["train"][key][-1] == pytest.approx(grpo._metrics["train"][key][-1], rel=1e-6), key
    for key in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert rpg._metrics["train"][key][-1] == grpo._metrics["train"][key][-1], key
    assert grpo._metrics["train"]["clip_ratio/high_max"][-1] > 0  # a completion with high-clipped tokens


@pytest.mark.filterwarnings("ignore::rpg_trl.losses.KLSignWarning")  # the "clipped" reading at the end
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_exact_kl_weight_equals_grpo_trainer_bias_corrected_k3_outside_the_trust_region(
    tiny_model_dir, tmp_path, loss_type
):
    # kl_clip_mode="exact" takes the KL term at the unclipped w on every token, as TRL adds `use_bias_correction_kl`'s
    # w·k3 after its clip: with ratios far outside the trust region the loss and the gradient are GRPOTrainer's. So
    # does the default, "truncated", while every w ≤ clip_c (here w ≤ e^0.6). Algorithm 1's reading ("clipped") is not:
    # it is a different loss there.
    inputs = None
    for mode in ("exact", "truncated"):
        grpo, rpg = _pair(tiny_model_dir, tmp_path / mode, loss_type, beta=0.1, rpg_only={"kl_clip_mode": mode})
        assert rpg.loss_spec.kl_clip_mode == mode and grpo.args.use_bias_correction_kl
        inputs = inputs or fixed_inputs(grpo, spread=0.6)
        _assert_same(grpo, rpg, inputs)
        assert rpg._metrics["train"]["clip_ratio/region_mean"][-1] > 0.1  # the clip acts on this batch
    rpg.loss_spec = rpg.loss_spec.replace(kl_clip_mode="clipped")
    with pytest.raises(AssertionError, match="gradient"):
        _assert_same(grpo, rpg, inputs)


def _docs_gspo_batch():
    """The batch of docs/trl_options.md (`importance_sampling_level`): 64 completions of 6 tokens, log w and log r
    (a separate reference) drawn within ±0.3 of log π_old, A = 0; float64 (`tests/test_losses.py::wide_ratio_batch`,
    seed 3, spread 0.3)."""
    g = np.random.default_rng(3)
    old = -g.uniform(0.5, 3.0, size=(64, 6))
    lp = old + g.uniform(-0.3, 0.3, size=(64, 6))
    ref = old + g.uniform(-0.3, 0.3, size=(64, 6))
    return lp, old, ref


def _gradient_on_given_logps(trainer, lp, old, ref):
    """∂loss/∂log π_t of `trainer._compute_loss` (TRL's own code for `GRPOTrainer`) when the policy's per-token
    log-probs are `lp`: the model's forward pass is replaced by a float64 leaf tensor, so the loss is evaluated
    exactly on the given batch. A = 0: the gradient is the KL term's alone."""
    b, t = lp.shape
    logps = torch.tensor(lp, requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros(b, t).double(), None)
    inputs = {
        "prompt_ids": torch.full((b, 2), 3),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.full((b, t), 3),
        "completion_mask": torch.ones(b, t, dtype=torch.long),
        "advantages": torch.zeros(b, dtype=torch.float64),
        "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref),
        "num_items_in_batch": torch.tensor(b * t),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    try:
        trainer._compute_loss(trainer.model, inputs).backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    return logps.grad.numpy()


def test_grpo_trainer_sequence_level_kl_gradient_is_each_tokens_own_plus_a_shared_push_down(tiny_model_dir, tmp_path):
    # docs/trl_options.md, `importance_sampling_level`: under GSPO's ratio s = exp(mean_t log w_t), TRL 1.16 weights
    # its bias-corrected k3 by s, so ∂loss/∂log π_t = β/N · s · [(1 − π_ref/π)_t + mean_t' k3_t']: the token's own k3
    # gradient (no mean log r in it), plus a push-down that the whole sequence shares. On the docs' batch that moves
    # 17 of the 384 tokens away from the reference (where the push-down outweighs the token's own pull up).
    # RPGTrainer's KL keeps each token's own weight: urkl's gradient moves all 384 toward it.
    lp, old, ref = _docs_gspo_batch()
    shared = dict(beta=0.2, importance_sampling_level="sequence", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    grpo = make_trainer(tiny_model_dir, tmp_path / "g", GRPOTrainer, GRPOConfig, **shared)
    assert grpo.args.use_bias_correction_kl
    grad = _gradient_on_given_logps(grpo, lp, old, ref)
    s = np.exp((lp - old).mean(-1, keepdims=True))
    k3 = np.exp(ref - lp) - (ref - lp) - 1
    expected = 0.2 / lp.size * s * ((1 - np.exp(ref - lp)) + k3.mean(-1, keepdims=True))
    np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=0)
    away = np.sign(-grad) != np.sign(ref - lp)
    assert away.sum() == 17
    # The tokens that move away are below the reference (their own term pulls them up) in sequences whose shared
    # push-down is the larger.
    assert (lp[away] < ref[away]).all()

    rpg = make_trainer(tiny_model_dir, tmp_path / "r", kl_anchor="reference", **COINCIDING_RPG, **shared)
    grad = _gradient_on_given_logps(rpg, lp, old, ref)
    w = np.exp(lp - old)
    np.testing.assert_allclose(grad, 0.2 / lp.size * w * (lp - ref), rtol=1e-10, atol=0)  # urkl: β·w·log ρ / N
    assert (np.sign(-grad) == np.sign(ref - lp)).all()


def test_uncorrected_k3_equals_grpo_trainer_without_bias_correction(tiny_model_dir, tmp_path):
    # GRPO's `use_bias_correction_kl=False` is honoured: RPG switches to its uncorrected-k3 ablation.
    shared = dict(epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False, beta=0.1)
    grpo = make_trainer(tiny_model_dir, tmp_path / "g", GRPOTrainer, GRPOConfig, **shared)
    rpg = make_trainer(tiny_model_dir, tmp_path / "r", kl_anchor="reference", **COINCIDING_RPG, **shared)
    assert rpg.args.kl_importance_weight is False
    _assert_same(grpo, rpg, fixed_inputs(grpo, spread=0.6))


def test_dr_grpo_is_not_the_sequence_mean_of_token_sums(tiny_model_dir, tmp_path):
    # Dr. GRPO divides by batch size × max_completion_length (8 here), not by the batch size: a factor 8 apart.
    rpg = make_trainer(tiny_model_dir, tmp_path / "a", loss_type="dr_grpo", **COINCIDING_RPG)
    luspo = make_trainer(tiny_model_dir, tmp_path / "b", loss_type="luspo", **COINCIDING_RPG)
    inputs = fixed_inputs(rpg, spread=0.2)
    loss_dr, _ = loss_and_grad(rpg, inputs)
    loss_lu, _ = loss_and_grad(luspo, inputs)
    assert rpg.args.max_completion_length == 8
    assert loss_dr.item() == pytest.approx(loss_lu.item() / 8, rel=1e-6)


# ================================================================================================ entropy bonus
_SAME_RUN = dict(beta=0.0, epsilon_high=0.28, scale_rewards="group", steps_per_generation=2, max_steps=3)


def _same_run_pair(model_dir, tmp_path, **overrides):
    # Built and trained one after the other, so that each run starts from the same seeded RNG state.
    grpo = make_trainer(model_dir, tmp_path / "g", GRPOTrainer, GRPOConfig, **{**_SAME_RUN, **overrides})
    grpo.train()
    rpg = make_trainer(model_dir, tmp_path / "r", **COINCIDING_RPG, **{**_SAME_RUN, **overrides})
    rpg.train()
    return grpo, rpg


def _assert_same_logs(grpo, rpg, keys):
    for key in keys:
        got, expected = logged(rpg, key), logged(grpo, key)
        assert len(got) == len(expected) > 0, key
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), key


def test_static_entropy_bonus_logs_as_grpo_trainer(tiny_model_dir, tmp_path):
    grpo, rpg = _same_run_pair(tiny_model_dir, tmp_path, entropy_coef=0.01)
    _assert_same_logs(grpo, rpg, ["entropy_coef", "policy_loss", "entropy", "loss"])
    assert logged(rpg, "entropy_coef") == [0.01] * 3


@pytest.mark.parametrize("accumulation", [1, 2])
def test_adaptive_entropy_controller_follows_grpo_trainer(tiny_model_dir, tmp_path, accumulation):
    # entropy_target far above the tiny model's entropy: the coefficient rises by delta at every optimizer step.
    settings = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.0,
        entropy_coef_delta=0.01,
        entropy_target=100.0,
        gradient_accumulation_steps=accumulation,
        per_device_train_batch_size=8 // accumulation,
        steps_per_generation=2 * accumulation,
    )
    grpo, rpg = _same_run_pair(tiny_model_dir, tmp_path, **settings)
    _assert_same_logs(grpo, rpg, ["entropy_coef", "policy_loss", "loss"])
    assert logged(rpg, "entropy_coef") == pytest.approx([0.01, 0.02, 0.03])
    assert rpg.entropy_coef == pytest.approx(0.03) and math.isfinite(rpg._last_world_entropy)


def test_adaptive_entropy_coefficient_survives_a_resume(tiny_model_dir, tmp_path):
    settings = dict(
        **COINCIDING_RPG,
        use_adaptive_entropy=True,
        entropy_coef_delta=0.01,
        entropy_target=100.0,
        save_strategy="steps",
        save_steps=2,
    )
    first = make_trainer(tiny_model_dir, tmp_path, max_steps=2, **settings)
    first.train()
    state = json.loads((tmp_path / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.02)
    resumed = make_trainer(tiny_model_dir, tmp_path, max_steps=3, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert logged(resumed, "entropy_coef")[-1] == pytest.approx(0.03)


# ========================================================================================== reference anchor
@pytest.mark.parametrize(
    "overrides", [dict(sync_ref_model=True), dict(ref_model_sync_kl_threshold=0.1)], ids=["sync", "kl-threshold"]
)
def test_asking_for_a_reference_anchors_the_kl_to_it(tiny_model_dir, tmp_path, overrides):
    trainer = make_trainer(tiny_model_dir, tmp_path, **overrides)
    assert trainer.args.kl_anchor == "reference" and trainer.ref_model is not None
    assert trainer.ref_sync_callback is not None


def test_model_carries_the_variant_tag(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, divergence="ufkl", estimator="differentiable")
    assert {"trl", "rpg", "rpg-ufkl"} <= set(trainer.model.model_tags)


# ================================================================================================ the copied code
def _code_tokens(source: str) -> str:
    """`source` as its code tokens (comments, blank lines and layout left out), one space apart."""
    import io
    import textwrap
    import tokenize

    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    tokens = tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)
    return " ".join(token.string for token in tokens if token.type not in skipped)


def _grpo_normalisers_and_entropy_bonus() -> str:
    """The part of `GRPOTrainer._compute_loss` that `RPGTrainer._aggregate` (the normaliser of each `loss_type`) and
    `RPGTrainer._entropy_bonus` (the static and adaptive entropy coefficient) reproduce: from the choice of the mode
    to the router's auxiliary loss. GRPOTrainer exposes neither as a method, so RPGTrainer holds a copy."""
    import inspect

    source = inspect.getsource(GRPOTrainer._compute_loss)
    start = source.index('mode = "train" if self.model.training else "eval"')
    end = source.index("if self.aux_loss_enabled:", start)
    return "        " + source[start:end]


#: The digest of `_grpo_normalisers_and_entropy_bonus()`'s code tokens, the same in every TRL release of setup.cfg's
#: window (1.14.2, 1.15.0, 1.16.0).
GRPO_NORMALISERS_AND_ENTROPY_DIGEST = "7b39e629cdad6aab6bc0ac37b76c30a40e840c74888161e9fb34bc81c10a8ed6"


def test_the_copied_normalisers_and_entropy_controller_are_trls_code():
    """RPGTrainer's `_aggregate` and `_entropy_bonus` copy GRPOTrainer's normalisers and entropy controller (not
    exposed as methods). When TRL changes that code, this digest changes: compare the new code with `_aggregate` and
    `_entropy_bonus`, bring them in line (the parity tests above and below check the behaviour), then record the new
    digest."""
    import hashlib

    code = _code_tokens(_grpo_normalisers_and_entropy_bonus())
    for expected in ('loss_type in [ "grpo" , "sapo" ]', 'loss_type == "bnpo"', 'loss_type == "dr_grpo"'):
        assert expected in code  # the extraction found the normalisers
    assert "self . _entropy_window_stats" in code and "self . _last_world_entropy" in code  # and the controller
    digest = hashlib.sha256(code.encode()).hexdigest()
    assert digest == GRPO_NORMALISERS_AND_ENTROPY_DIGEST, (
        "GRPOTrainer._compute_loss's normalisers or entropy controller changed: review RPGTrainer._aggregate and "
        f"RPGTrainer._entropy_bonus against TRL's code, then set GRPO_NORMALISERS_AND_ENTROPY_DIGEST = {digest!r}."
    )


def test_the_code_digest_sees_a_change_of_trls_code():
    """The digest changes with the code, not with its comments or layout."""
    source = _grpo_normalisers_and_entropy_bonus()
    code = _code_tokens(source)
    commented = source.replace("policy_loss = loss.detach()", "policy_loss = loss.detach()  # a new comment\n", 1)
    assert _code_tokens(commented) == code
    changed = source.replace("mask.sum().clamp(min=1.0)", "mask.sum().clamp(min=2.0)", 1)
    assert changed != source and _code_tokens(changed) != code


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo", "luspo"])
def test_evaluation_loss_equals_grpo_trainer(tiny_model_dir, tmp_path, loss_type):
    """In evaluation (no gradient accumulation, the whole batch at once) each normaliser, with the entropy bonus, gives
    GRPOTrainer's loss on the same batch."""
    grpo, rpg = _pair(tiny_model_dir, tmp_path, loss_type, beta=0.1, entropy_coef=0.01)
    inputs = fixed_inputs(grpo, spread=0.2)
    losses = []
    for trainer in (grpo, rpg):
        trainer.model.eval()
        trainer.current_gradient_accumulation_steps = 2  # not applied in evaluation
        with torch.no_grad():
            losses.append(trainer._compute_loss(trainer.model, inputs))
    assert_close_in_norm(losses[1], losses[0], ulps=8, what="evaluation loss")
