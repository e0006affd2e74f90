"""kl_estimate="vocabulary": each position's KL computed exactly over the vocabulary (rpg_trl.losses.vocabulary), in the
loss and in RPGTrainer, against float64 computations from both models' full logits."""

import math

import numpy as np
import pytest
import torch

from rpg_trl.trl_release import require_trl


try:
    require_trl("1.16.0", "kl_estimate='vocabulary'")
except ImportError as exc:  # TRL's tiled divergence kernel and fused LM head are new in TRL 1.16 (.ci/trl_floor)
    pytest.skip(str(exc), allow_module_level=True)

import rpg_trl.losses.vocabulary_kernel as vocabulary_kernel  # noqa: E402
from rpg_trl import RPGConfig, RPGTrainer  # noqa: E402
from rpg_trl.losses import DIVERGENCES, ESTIMATORS, rpg_loss, rpg_per_token_loss  # noqa: E402
from rpg_trl.losses import vocabulary as vocab  # noqa: E402
from rpg_trl.testing.models import build_char_tokenizer  # noqa: E402

from helpers.tiny_runs import PROMPTS, count_sevens, loss_and_grad, make_trainer, tiny_run_args  # noqa: E402


BETA = 0.3


def exact_kl(policy_logits, anchor_logits, direction):
    """KL per row from full logits, float64: KL(p‖q) (reverse) or KL(q‖p) (forward), p the policy's."""
    log_p = torch.log_softmax(policy_logits.double(), -1)
    log_q = torch.log_softmax(anchor_logits.double(), -1)
    if direction == "reverse":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def transform(logits, temperature, scale, softcap):
    logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize(
    ("vocabulary", "temperature", "scale", "softcap", "bias"),
    [(11, 1.0, 1.0, None, False), (40_000, 0.7, 1.0, None, True), (50, 1.3, 0.5, 3.0, True)],
)
def test_position_kl_and_its_gradient_equal_float64_full_logits(
    direction, vocabulary, temperature, scale, softcap, bias
):
    """The tiled KL (TRL's kernel; 40,000 words span two of its vocabulary tiles) and its gradient with respect to the
    policy's hidden states, head weight and bias equal those of the KL of float64 softmaxes of the full logits (with the
    temperature, logit scale and soft-capping of the head), on the active positions, and 0 elsewhere."""
    g = torch.Generator().manual_seed(0)
    B, T, H = 3, 4, 6
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    anchor_hidden = hidden + 0.5 * torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocabulary, H, generator=g, dtype=torch.float64) / 2
    anchor_weight = weight + 0.3 * torch.randn(vocabulary, H, generator=g, dtype=torch.float64)
    b = torch.randn(vocabulary, generator=g, dtype=torch.float64) if bias else None
    anchor_b = None if b is None else b + 0.2
    mask = torch.ones(B, T)
    mask[0, 2:] = 0
    mask[2, 1:] = 0
    upstream = torch.rand(B, T, generator=g, dtype=torch.float64)  # a weight per position, as the loss gives

    def reference():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        bb = None if b is None else b.clone().requires_grad_(True)
        logits = h @ w.T + (0 if bb is None else bb)
        anchor_logits = anchor_hidden @ anchor_weight.T + (0 if anchor_b is None else anchor_b)
        kl = exact_kl(
            transform(logits, temperature, scale, softcap), transform(anchor_logits, temperature, scale, softcap),
            direction,
        ) * mask  # fmt: skip
        (kl * upstream).sum().backward()
        return kl.detach(), [h.grad, w.grad] + ([] if bb is None else [bb.grad])

    def tiled():
        h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
        bb = None if b is None else b.float().requires_grad_(True)
        kl = vocab.position_kl(
            h, (w, bb), anchor_hidden.float(), (anchor_weight.float(), None if anchor_b is None else anchor_b.float()),
            mask, direction, temperature=temperature, logit_scale=scale, final_logit_softcapping=softcap,
        )  # fmt: skip
        (kl * upstream).sum().backward()
        return kl.detach(), [h.grad, w.grad] + ([] if bb is None else [bb.grad])

    expected, expected_grads = reference()
    actual, grads = tiled()
    assert actual.dtype == torch.float32 and actual.shape == (B, T)
    assert torch.all(actual[mask == 0] == 0) and expected.abs().max() > 0.05
    np.testing.assert_allclose(actual.double(), expected, rtol=2e-4, atol=2e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got.double() - want).norm() <= 1e-4 * want.norm() + 1e-7


def test_tiling_over_positions_and_words_changes_nothing(monkeypatch):
    """Tiles of 3 positions × 4 words (the kernel's tile sizes, set small) give the KL and gradients of one tile that
    holds every position and word."""

    g = torch.Generator().manual_seed(1)
    hidden, anchor = torch.randn(2, 7, 5, generator=g), torch.randn(2, 7, 5, generator=g)
    weight, anchor_weight = torch.randn(13, 5, generator=g), torch.randn(13, 5, generator=g)
    mask = torch.ones(2, 7)
    mask[1, 5:] = 0

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        kl = vocab.position_kl(h, (w, None), anchor, (anchor_weight, None), mask, "reverse")
        (kl * torch.arange(14.0).view(2, 7)).sum().backward()
        return kl.detach(), h.grad, w.grad

    whole = run()
    monkeypatch.setattr(vocabulary_kernel, "TOKEN_TILE", 3)
    monkeypatch.setattr(vocabulary_kernel, "VOCABULARY_TILE", 4)
    pieces = run()
    for a, b in zip(whole, pieces, strict=True):  # up to the float32 rounding of matrix products of other shapes
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_bf16_states_and_head_give_a_finite_kl_close_to_float32():
    g = torch.Generator().manual_seed(2)
    hidden, anchor = torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 16, generator=g)
    weight, anchor_weight = torch.randn(300, 16, generator=g) / 4, torch.randn(300, 16, generator=g) / 4
    mask = torch.ones(4, 6)
    full = vocab.position_kl(hidden, (weight, None), anchor, (anchor_weight, None), mask, "forward")
    h, w = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    half = vocab.position_kl(h, (w, None), anchor.bfloat16(), (anchor_weight.bfloat16(), None), mask, "forward")
    half.sum().backward()
    assert torch.isfinite(half).all() and torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()
    np.testing.assert_allclose(half.detach().float().numpy(), full.numpy(), rtol=0.05, atol=0.02)


# A tabular policy over a vocabulary of 4 tokens: the "hidden state" of a position is the one-hot of its prefix, the head
# is the table of logits, so the kernel's KL is the table's KL; completions are fixed (the KL's value and gradient do not
# depend on which token was sampled at a position, only on the prefix).
V = 4


def tabular(seed, positions, scale=1.0):
    return torch.tensor(np.random.default_rng(seed).normal(scale=scale, size=(positions, V)), dtype=torch.float32)


def onehot_states(B, T):
    return torch.eye(B * T).view(B, T, B * T)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_normalised_and_unnormalised_divergences_coincide_over_the_vocabulary(anchor, estimator):
    """Over a normalised vocabulary UKL = KL at every position: urkl and rkl give the same loss and gradient with
    kl_estimate="vocabulary", and so do ufkl and fkl (at both KL levels)."""
    B, T = 3, 4
    hidden = onehot_states(B, T)
    logps = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    old = logps + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    ref = None if anchor == "sampling" else logps + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    adv, mask = torch.tensor([1.0, -0.5, 0.2]), torch.ones(B, T)
    theta, anchor_table = tabular(0, B * T), tabular(1, B * T)

    def run(divergence, level):
        z, lp = theta.clone().requires_grad_(True), logps.clone().requires_grad_(True)
        direction = "forward" if divergence in ("fkl", "ufkl") else "reverse"
        kl = vocab.position_kl(hidden, (z.T, None), hidden, (anchor_table.T, None), mask, direction)
        loss, metrics = rpg_loss(
            lp, old, adv, mask, ref_logps=ref, position_kl=kl, divergence=divergence, estimator=estimator,
            beta=BETA, kl_level=level, kl_estimate="vocabulary",
        )  # fmt: skip
        loss.backward()
        return loss.detach(), z.grad, lp.grad, metrics["kl"], metrics["kl/sequence"]

    for level in ("token", "sequence"):
        for normalised, unnormalised in (("rkl", "urkl"), ("fkl", "ufkl")):
            for a, b in zip(run(normalised, level), run(unnormalised, level), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def enumerated_kl_gradients(divergence, anchor, policy, level, kl_estimate, clip=False, baseline="none"):
    """E_{y∼π_old}[∇ loss] over every completion of a tabular policy (vocabulary {0, 1, 2}, 2 tokens, no EOS), with
    A = 0 (the KL alone), and the gradient of β·D between whole completions by float64 autograd of the enumerated D.
    With a baseline, over every pair of completions of one prompt (a group of 2: each one's baseline is the other's)."""
    vocabulary, length = 3, 2
    single = [(a, b) for a in range(vocabulary) for b in range(vocabulary)]
    ys = single if baseline == "none" else [y for pair in zip(single * 9, sorted(single * 9)) for y in pair]
    # prefix index: () -> 0, (a,) -> 1 + a
    rng = np.random.default_rng(7)

    def table(scale):
        return torch.tensor(rng.normal(scale=scale, size=(1 + vocabulary, vocabulary)), dtype=torch.float64)

    theta = table(1.0)
    old_table = theta.clone() if policy == "on-policy" else table(1.0)
    ref_table = table(1.0) if anchor == "reference" else old_table
    anchor_table = ref_table
    prefix = torch.tensor([[0, 1 + y[0]] for y in ys])  # (N, 2) prefix index per position

    def token_logps(tab, seqs=ys):
        log_p = torch.log_softmax(tab, -1)
        index = torch.tensor([[0, 1 + y[0]] for y in seqs])
        return torch.stack([log_p[index[:, t], torch.tensor([y[t] for y in seqs])] for t in range(length)], -1)

    N = len(ys)
    old_lp, ref_lp = token_logps(old_table), token_logps(ref_table)
    p_old = torch.exp(old_lp.sum(-1))
    groups = None
    if baseline != "none":  # row 2k and 2k + 1 are a pair, drawn with probability p(y)·p(y'); each row counts 1/2
        groups = torch.arange(N) // 2
        p_old = p_old.view(-1, 2).prod(-1).repeat_interleave(2) / 2
    mask = torch.ones(N, length, dtype=torch.float64)
    z = theta.clone().requires_grad_(True)
    kwargs = dict(divergence=divergence, beta=BETA, clip=clip, kl_level=level, kl_estimate=kl_estimate)
    kwargs.update(kl_to_go_baseline=baseline, groups=groups)
    position = None
    if kl_estimate == "vocabulary":
        hidden = torch.nn.functional.one_hot(prefix, 1 + vocabulary).float()  # (N, 2, 4)
        direction = "forward" if divergence in ("fkl", "ufkl") else "reverse"
        position = vocab.position_kl(
            hidden, (z.T.float(), None), hidden, (anchor_table.T.float(), None), mask, direction
        )
    per_token, _ = rpg_per_token_loss(
        token_logps(z), old_lp, torch.zeros(N, dtype=torch.float64), mask,
        ref_logps=None if anchor == "sampling" else ref_lp, position_kl=position, **kwargs,
    )  # fmt: skip
    (p_old * per_token.sum(-1)).sum().backward()

    w = z.detach().clone().requires_grad_(True)
    log_p, log_q = token_logps(w, single).sum(-1), token_logps(ref_table, single).sum(-1)
    if divergence in ("fkl", "ufkl"):
        D = (torch.exp(log_q) * (log_q - log_p)).sum()
    else:
        D = (torch.exp(log_p) * (log_p - log_q)).sum()
    (BETA * D).backward()
    return z.grad, w.grad


@pytest.mark.parametrize("anchor", ["sampling", "reference"])
@pytest.mark.parametrize("policy", ["on-policy", "off-policy"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_sequence_level_vocabulary_kl_is_unbiased_by_enumeration(divergence, policy, anchor):
    """kl_level="sequence" from the exact per-position KLs (direct term through each position's distribution, the
    KL-to-go on the score): its expected gradient under π_old is the gradient of β·D between whole completions, on-
    and off-policy, with a reference and with the sampling policy as the anchor (the kernel's float32 rounding)."""
    got, expected = enumerated_kl_gradients(divergence, anchor, policy, "sequence", "vocabulary")
    if policy == "off-policy" or anchor == "reference":
        assert expected.abs().max() > 1e-3
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("kl_estimate", ["sample", "vocabulary"])
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
@pytest.mark.parametrize("divergence", ["rkl", "urkl"])
def test_the_leave_one_out_baseline_of_the_kl_to_go_is_unbiased_by_enumeration(divergence, anchor, kl_estimate):
    """kl_to_go_baseline="leave_one_out" in groups of two: over every pair of completions the expected gradient is still
    the gradient of β·D between whole completions (off-policy, both anchors, both estimates of each position's KL)."""
    got, expected = enumerated_kl_gradients(
        divergence, anchor, "off-policy", "sequence", kl_estimate, baseline="leave_one_out"
    )
    plain, _ = enumerated_kl_gradients(divergence, anchor, "off-policy", "sequence", kl_estimate)
    assert expected.abs().max() > 1e-3
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(plain.numpy(), expected.numpy(), rtol=1e-4, atol=2e-6)


def test_the_baseline_is_the_mean_over_the_other_completions_of_the_prompt():
    from rpg_trl.losses.baseline import leave_one_out_mean

    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    active = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    groups = torch.tensor([4, 4, 4, 9])
    # Row 0: (3 + 5)/2 and 6 (row 1 is inactive at t = 1); row 1 at its inactive t = 1, the others' (2 + 6)/2; row 3 is
    # alone in its group.
    expected = torch.tensor([[4.0, 6.0], [3.0, 4.0], [2.0, 2.0], [0.0, 0.0]])
    torch.testing.assert_close(leave_one_out_mean(values, active, groups), expected, rtol=0, atol=0)


@pytest.mark.parametrize("anchor", ["sampling", "reference"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_token_level_vocabulary_kl_is_the_expectation_of_the_sampled_one(divergence, anchor):
    """Rao-Blackwell: at kl_level="token", the expected gradient of the vocabulary estimate under π_old equals that of
    the sampled estimate (each position's KL is the sampled estimate's expectation given its prefix), off-policy."""
    exact, _ = enumerated_kl_gradients(divergence, anchor, "off-policy", "token", "vocabulary")
    sampled, _ = enumerated_kl_gradients(divergence, anchor, "off-policy", "token", "sample")
    assert sampled.abs().max() > 1e-3
    np.testing.assert_allclose(exact.numpy(), sampled.numpy(), rtol=1e-4, atol=2e-6)


def test_the_loss_asks_for_position_kl_exactly_when_the_estimate_is_over_the_vocabulary():
    logps, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="needs `position_kl`"):
        rpg_loss(logps, logps, adv, mask, kl_estimate="vocabulary")
    with pytest.raises(ValueError, match="kl_estimate='vocabulary'"):
        rpg_loss(logps, logps, adv, mask, position_kl=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        rpg_loss(logps, logps, adv, mask, kl_estimate="vocabulary", position_kl=torch.zeros(2, 4))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(kl_estimate="exactly"), "kl_estimate"),
        (dict(kl_estimate="vocabulary", kl_clip_mode="clipped"), "kl_clip_mode='clipped'"),
        (dict(kl_estimate="vocabulary", kl_level="sequence", kl_to_go="k3"), "kl_to_go='k3'"),
        (dict(kl_estimate="vocabulary", use_bias_correction_kl=False), "use_bias_correction_kl=False"),
    ],
)
def test_config_refuses_what_the_vocabulary_estimate_cannot_honour(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        RPGConfig(output_dir=str(tmp_path), use_cpu=True, **fields)


def test_the_asynchronous_config_refuses_the_vocabulary_estimate(tmp_path):
    from helpers.trl_release import async_trl_missing

    if async_trl_missing():
        pytest.skip(async_trl_missing())
    from rpg_trl.async_rpg import AsyncRPGConfig

    with pytest.raises(ValueError, match="not available with AsyncRPGTrainer"):
        AsyncRPGConfig(output_dir=str(tmp_path), use_cpu=True, kl_estimate="vocabulary")


def test_a_head_that_peft_trains_is_refused_at_construction(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="not a torch.nn.Linear"):
        lora_trainer(
            tiny_model_dir,
            tmp_path,
            LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        )


def lora_trainer(model_dir, tmp_path, peft_config, **overrides):
    args = RPGConfig(**tiny_run_args(tmp_path, kl_estimate="vocabulary", **overrides))
    return RPGTrainer(
        model_dir, count_sevens, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer(),
        peft_config=peft_config,
    )  # fmt: skip


# In RPGTrainer: the batch from GRPOTrainer's own generation and scoring, the loss's KL against float64 forward passes.


def float64_copy(model_dir, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in state.items()})
    return model


def completion_logits(model, batch, temperature):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -T - 1 : -1]
    return logits / temperature


def token_logps_of(logits, batch):
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def perturb(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def labelled_positions_only(monkeypatch):
    """TRL's fused head as on a device with Triton: it hands its kernel the labelled positions only (on the CPU, every
    position of the shifted sequence). Only the layout changes: the kernels stay torch's."""
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)


@pytest.mark.parametrize("layout", ["every position", "labelled only"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
@pytest.mark.parametrize("divergence", ["urkl", "fkl"])
def test_trainer_kl_term_and_logged_kl_equal_float64_full_logits(
    tiny_model_dir, tmp_path, monkeypatch, divergence, anchor, level, layout
):
    """RPGTrainer with kl_estimate="vocabulary", off-policy (the policy moved after generation, as by an optimizer
    step): the gradient of the loss's KL term (the loss at β minus the loss at β = 0) and the logged `kl` and
    `kl/sequence` equal the float64 values from full forward passes of the policy, π_old and the anchor (logits divided
    by the temperature; float32, without the bf16 autocast that RPGConfig's default turns on where the CPU has bf16),
    whichever positions TRL's fused head hands its kernel."""
    if layout == "labelled only":
        labelled_positions_only(monkeypatch)
    temperature = 0.7
    trainer = make_trainer(
        tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_anchor=anchor, divergence=divergence, kl_level=level,
        beta=BETA, loss_type="bnpo", steps_per_generation=2, temperature=temperature, rpg_clip=False, bf16=False,
    )  # fmt: skip
    if anchor == "reference":
        perturb(trainer.ref_model, 1)
    old_state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:16]])
    assert batch["rpg_anchor_hidden_states"].shape[:2] == batch["completion_ids"].shape
    perturb(trainer.model, 2)  # π_θ ≠ π_old, as after an optimizer step
    trainer.state.global_step += 1

    _, with_kl = loss_and_grad(trainer, batch)
    logged = {key: trainer._metrics["train"][key][-1] for key in ("kl", "kl/sequence")}
    trainer.rpg_beta = 0.0
    _, without_kl = loss_and_grad(trainer, batch)
    kl_gradient = with_kl - without_kl

    policy = float64_copy(tiny_model_dir, trainer.model.state_dict())
    old = float64_copy(tiny_model_dir, old_state)
    anchor_model = float64_copy(tiny_model_dir, trainer.ref_model.state_dict()) if anchor == "reference" else old
    mask = batch["completion_mask"].double()
    with torch.no_grad():
        old_logits = completion_logits(old, batch, temperature)
        anchor_logits = completion_logits(anchor_model, batch, temperature)
    logits = completion_logits(policy, batch, temperature)
    direction = "forward" if divergence == "fkl" else "reverse"
    kl = exact_kl(logits, anchor_logits, direction) * mask
    # The prefix weights of the sequence level: W<t = Π_{s<t} π_θ/π_old (reverse), R<t = Π_{s<t} π_anchor/π_old.
    log_w = (token_logps_of(logits, batch) - token_logps_of(old_logits, batch)) * mask
    log_r = (token_logps_of(anchor_logits, batch) - token_logps_of(old_logits, batch)) * mask
    log_before = (log_w if direction == "reverse" else log_r).cumsum(-1) - (log_w if direction == "reverse" else log_r)
    weights = torch.exp(log_before) if level == "sequence" else torch.ones_like(kl)
    objective = BETA * (weights * kl).sum() / mask.sum()
    policy.zero_grad()
    objective.backward()
    expected = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])

    assert expected.norm() > 1e-4
    assert (kl_gradient.double() - expected).norm() <= 2e-4 * expected.norm()
    assert logged["kl"] == pytest.approx((kl.sum() / mask.sum()).item(), rel=1e-4)
    whole = (torch.exp(log_before) * kl).sum(-1)
    assert logged["kl/sequence"] == pytest.approx(whole.mean().item(), rel=1e-4)


def test_on_policy_sampling_anchor_has_no_kl_and_no_kl_gradient(tiny_model_dir, tmp_path):
    """Every step on freshly generated data with kl_anchor="sampling": GRPOTrainer skips π_old's scoring, π_old = π_θ,
    and each position's KL is exactly 0, with no gradient (the loss at β equals the loss at β = 0)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_anchor="sampling", beta=BETA)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:8]])
    assert "rpg_anchor_hidden_states" not in batch and batch.get("old_per_token_logps") is None
    loss, grads = loss_and_grad(trainer, batch)
    assert trainer._metrics["train"]["kl"][-1] == 0.0
    trainer.rpg_beta = 0.0
    loss_0, grads_0 = loss_and_grad(trainer, batch)
    assert torch.equal(loss, loss_0) and torch.equal(grads, grads_0)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_the_kernel_equals_trls_log_prob_and_divergence_kernels(direction, softcap):
    """The one-pass kernel's log-probs and entropies (and their gradients) equal TRL's chunked log-prob kernel's, and
    its KL (and gradient) TRL's chunked divergence kernel's, on 40,000 words (three of its vocabulary tiles)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    g = torch.Generator().manual_seed(3)
    N, H, V, temperature, scale = 9, 8, 40_000, 0.8, 1.5
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 3
    anchor, anchor_weight = (
        hidden + 0.3 * torch.randn(N, H, generator=g),
        weight + 0.1 * torch.randn(V, H, generator=g),
    )
    bias = torch.randn(V, generator=g) / 5
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.rand(3, N, generator=g)

    def run(compute):
        h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        outputs = compute(h, w, b)
        sum(u * o for u, o in zip(upstream, outputs, strict=True)).sum().backward()
        return [o.detach() for o in outputs], [h.grad, w.grad, b.grad]

    def fused(h, w, b):
        return vocabulary_kernel.LogProbKLFunction.apply(
            h, w, b, targets, anchor, anchor_weight, None, direction == "reverse", (scale, softcap, 1 / temperature)
        )

    def trl_kernels(h, w, b):
        log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
            h, w, b, targets, temperature, 32768, softcap, scale, ("log_probs", "entropy")
        )
        kl, _ = ChunkedDivergenceFunction.apply(
            h, w, b, anchor, anchor_weight, None, 1.0 if direction == "reverse" else 0.0, temperature,
            scale, softcap, scale, softcap,
        )  # fmt: skip
        return log_probs, entropy, kl

    (ours, our_grads), (theirs, their_grads) = run(fused), run(trl_kernels)
    assert theirs[2].min() > 1e-3  # the two heads differ
    for a, b in zip(ours + our_grads, theirs + their_grads, strict=True):
        assert (a - b).norm() <= 1e-5 * b.norm()


@pytest.mark.parametrize("layout", ["every position", "labelled only"])
def test_the_loss_pass_gives_trls_log_probs_and_entropies(tiny_model_dir, tmp_path, monkeypatch, layout):
    """The loss's scoring pass with the KL folded in returns the log-probs and entropies of TRL's own head on the same
    batch (the same model, the KL beside them)."""
    if layout == "labelled only":
        labelled_positions_only(monkeypatch)
    trainer = make_trainer(
        tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_anchor="sampling", beta=BETA, steps_per_generation=2,
        bf16=False,
    )  # fmt: skip
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:16]])
    perturb(trainer.model, 2)
    trainer.state.global_step += 1
    logps, entropies, _, mask = trainer._policy_logps(trainer.model, batch)
    kl = trainer.vocabulary_position_kl(mask)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trl_logps, trl_entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, batch["completion_ids"].size(1), compute_entropy=True
    )
    on = mask.bool()
    assert kl[on].min() > 0 and torch.all(kl[~on] == 0)
    torch.testing.assert_close(logps[on], trl_logps[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies[on], trl_entropies[on], rtol=1e-5, atol=1e-5)


def test_no_optimizer_step_since_pi_old_scored_means_no_kl_and_no_kernel(tiny_model_dir, tmp_path, monkeypatch):
    """kl_anchor="sampling" with π_old's pass made (two micro-steps per generation): until the first optimizer step
    after that pass, π_θ = π_old, so the KL and its gradient are 0 and the kernel does not run; after one, it runs."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_anchor="sampling", beta=BETA, steps_per_generation=2
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:16]])
    assert batch.get("old_per_token_logps") is not None
    calls = []
    kernel = vocabulary_kernel.LogProbKLFunction.apply
    monkeypatch.setattr(
        vocabulary_kernel.LogProbKLFunction, "apply", lambda *a: calls.append(1) or kernel(*a), raising=True
    )
    loss, grads = loss_and_grad(trainer, batch)
    assert trainer._metrics["train"]["kl"][-1] == 0.0 and calls == []
    trainer.rpg_beta = 0.0
    loss_0, grads_0 = loss_and_grad(trainer, batch)
    assert torch.equal(loss, loss_0) and torch.equal(grads, grads_0)
    trainer.rpg_beta = BETA
    perturb(trainer.model, 2)
    trainer.state.global_step += 1
    loss_and_grad(trainer, batch)
    assert calls == [1] and trainer._metrics["train"]["kl"][-1] > 0


def test_a_run_resumed_inside_a_generation_cycle_continues_exactly(tiny_model_dir, tmp_path):
    """A checkpoint after the first of two optimizer steps per generation holds the batch's anchor states and π_old's
    head copy (the head has moved since): the resumed run logs the KLs and losses, and ends with the weights, of the
    uninterrupted one (the first step of each cycle has KL 0, the second one does not)."""
    kwargs = dict(
        kl_estimate="vocabulary", kl_anchor="sampling", beta=BETA, steps_per_generation=2, max_steps=4,
        save_strategy="steps", save_steps=1,
    )  # fmt: skip
    whole = make_trainer(tiny_model_dir, tmp_path / "a", **kwargs)
    whole.train()
    kls = [h["kl"] for h in whole.state.log_history if "kl" in h]
    assert kls[0] == 0.0 and kls[2] == 0.0 and kls[1] > 0 and kls[3] > 0
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for key in ("kl", "loss"):
        expected, got = ({h["step"]: h[key] for h in t.state.log_history if key in h} for t in (whole, resumed))
        assert sorted(got) == [1, 2, 3, 4] and got == pytest.approx(expected, rel=1e-6, abs=1e-9), key
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_sample_estimate_batches_carry_no_hidden_states(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_anchor="reference", beta=BETA, steps_per_generation=2)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:16]])
    assert "rpg_anchor_hidden_states" not in batch


@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_lora_trains_with_the_vocabulary_kl(tiny_model_dir, tmp_path, anchor):
    """LoRA (the reference: the base model, the adapter disabled), off-policy steps: a run of 4 steps whose logged KL is
    finite, >= 0, and > 0 once the adapter has moved (the shared head read live: LoRA leaves it frozen)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = lora_trainer(
        tiny_model_dir, tmp_path, lora, kl_anchor=anchor, beta=BETA, steps_per_generation=2, max_steps=4
    )
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kls) == 4 and all(math.isfinite(k) and k >= 0 for k in kls)
    assert max(kls) > 0
    assert trainer._vocabulary_anchor_heads.get("train") is None  # the frozen head is not copied


def test_a_training_head_is_copied_at_generation_for_the_sampling_anchor(tiny_model_dir, tmp_path):
    """Full fine-tuning trains the head: π_old's head is the one at generation, copied then (the loss after an optimizer
    step reads the copy, not the moved head)."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_anchor="sampling", beta=BETA, steps_per_generation=2
    )
    trainer.model.train()
    trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:16]])
    weight, bias = trainer._vocabulary_anchor_heads["train"]
    head = trainer.model.get_output_embeddings().weight
    assert torch.equal(weight, head) and weight.data_ptr() != head.data_ptr() and not weight.requires_grad


def test_the_trainer_labels_each_completion_by_its_prompt_for_the_baseline(tiny_model_dir, tmp_path, monkeypatch):
    """kl_to_go_baseline="leave_one_out" in RPGTrainer: the loss gets one label per prompt (the completions of a group
    share it), and trains; without the baseline it gets none."""
    import rpg_trl.trainer as trainer_module

    seen = []
    loss_function = trainer_module.rpg_per_token_loss

    def keep_groups(*args, groups=None, **kwargs):
        seen.append(groups)
        return loss_function(*args, groups=groups, **kwargs)

    monkeypatch.setattr(trainer_module, "rpg_per_token_loss", keep_groups)
    trainer = make_trainer(
        tiny_model_dir, tmp_path, kl_estimate="vocabulary", kl_level="sequence", kl_clip_mode="exact",
        kl_to_go_baseline="leave_one_out", beta=BETA, steps_per_generation=2,
    )  # fmt: skip
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:4] for _ in range(4)])
    loss, grads = loss_and_grad(trainer, batch)
    groups, prompts = seen[-1], batch["prompt_ids"]
    assert groups.shape == (16,) and len(set(groups.tolist())) == 4
    for i in range(16):
        for j in range(16):
            assert (groups[i] == groups[j]) == torch.equal(prompts[i], prompts[j])
    assert torch.isfinite(loss) and torch.isfinite(grads).all()
    plain = make_trainer(tiny_model_dir, tmp_path / "plain", kl_estimate="vocabulary", beta=BETA)
    plain.model.train()
    loss_and_grad(plain, plain._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:8]]))
    assert seen[-1] is None
