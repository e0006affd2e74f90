"""REINFORCE++ and REINFORCE++-Baseline (`rpg_research.reinforce_plus_plus`): the advantages against hand computations,
and the trainer end to end on a tiny local model."""

import math
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

from rpg_research.reinforce_plus_plus import (
    KL_ESTIMATORS,
    ReinforcePlusPlusConfig,
    ReinforcePlusPlusTrainer,
    masked_whiten,
    outcome_scores,
    reinforce_plus_plus_advantages,
)
from rpg_trl.testing import PROMPTS, tiny_run_args


def whitened(values):
    """(x − mean) / sqrt(unbiased variance + 1e-8), computed with the standard library."""
    mean, variance = statistics.fmean(values), statistics.variance(values)
    return [(x - mean) / math.sqrt(variance + 1e-8) for x in values]


def test_reinforce_plus_plus_kl_in_reward_by_hand():
    # Two completions of 2 and 1 tokens, scores 1 and 0, k1 = (0.1, 0.2) and (0.3), β = 0.5, γ = 1:
    # token rewards (−0.05, −0.1 + 1) and (−0.15 + 0); returns (0.85, 0.9) and (−0.15); whitened over the 3 tokens.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])  # padding values must not count
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=0.5)
    a, b, c = whitened([0.85, 0.9, -0.15])
    assert adv.flatten().tolist() == pytest.approx([a, b, 0.0, c, 0.0, 0.0], abs=1e-6)


def test_reinforce_plus_plus_discounted_return_by_hand():
    # γ = 0.5, one completion of 3 tokens with score 1, k1 = (0.1, 0.2, 0.3), β = 1: rewards (−0.1, −0.2, 0.7),
    # returns G2 = 0.7, G1 = −0.2 + 0.5·0.7 = 0.15, G0 = −0.1 + 0.5·0.15 = −0.025; a second completion of one token
    # with score −1 and no KL: G = −1.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, -1.0]), mask, kl=kl, kl_coef=1.0, gamma=0.5)
    g0, g1, g2, h = whitened([-0.025, 0.15, 0.7, -1.0])
    assert adv.flatten().tolist() == pytest.approx([g0, g1, g2, h, 0.0, 0.0], abs=1e-6)


def test_reinforce_plus_plus_baseline_by_hand():
    # Groups of 2: rewards (1, 0) and (1, 1) -> scores (0.5, −0.5) and (0, 0); lengths 2, 1, 3, 1; no KL: each token
    # carries its completion's score, and the 7 tokens are whitened together.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    scores = outcome_scores(rewards, 2, "reinforce_plus_plus_baseline")
    assert scores.tolist() == [0.5, -0.5, 0.0, 0.0]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv = reinforce_plus_plus_advantages(scores, mask)
    p, n, z = whitened([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])[1:4]
    assert adv.flatten().tolist() == pytest.approx([p, p, 0, n, 0, 0, z, z, z, z, 0, 0], abs=1e-6)
    # REINFORCE++ keeps the raw reward (no group baseline).
    assert outcome_scores(rewards, 2, "reinforce_plus_plus").tolist() == [1.0, 0.0, 1.0, 1.0]


def test_trl_batch_scaling_is_not_reinforce_plus_plus_baseline():
    """TRL's scale_rewards="batch" divides R − group mean by the batch std of the raw rewards; REINFORCE++-Baseline
    divides by the std of the centred scores. With different group means they differ; with equal group means and
    equal lengths they agree (up to TRL's +1e-4 on the std)."""
    mask = torch.ones(4, 1)
    for rewards, same in (([1.0, 0.0, 1.0, 1.0], False), ([1.0, 0.0, 0.0, 1.0], True)):
        r = torch.tensor(rewards)
        centred = [x - statistics.fmean(rewards[i - i % 2 : i - i % 2 + 2]) for i, x in enumerate(rewards)]
        trl_batch = [c / (statistics.stdev(rewards) + 1e-4) for c in centred]
        ours = reinforce_plus_plus_advantages(outcome_scores(r, 2, "reinforce_plus_plus_baseline"), mask)
        assert (ours.squeeze(1).tolist() == pytest.approx(trl_batch, abs=1e-3)) == same


def test_unscorable_completions_get_zero_scores_and_stay_out_of_the_group_mean():
    scores = outcome_scores(torch.tensor([1.0, float("nan"), 0.0, 0.5]), 2, "reinforce_plus_plus_baseline")
    assert scores.tolist() == [0.0, 0.0, -0.25, 0.25]


def test_kl_estimators_by_hand():
    d = torch.tensor([0.5, -0.2])
    assert KL_ESTIMATORS["k1"](d).tolist() == pytest.approx([0.5, -0.2])
    assert KL_ESTIMATORS["k2"](d).tolist() == pytest.approx([0.125, 0.02])
    assert KL_ESTIMATORS["k3"](d).tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.exp(0.2) - 1 - 0.2])


def test_masked_whiten_over_processes_equals_the_global_batch():
    # Two processes holding the same half: summing each statistic over processes doubles it, and the result must be
    # the whitening of the concatenated batch.
    values = torch.tensor([[0.3, -1.2, 2.0], [0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    both = masked_whiten(torch.cat([values, values]), torch.cat([mask, mask]))
    half = masked_whiten(values, mask, reduce=lambda t: 2 * t)
    assert torch.allclose(half, both[:2], atol=1e-6)
    assert masked_whiten(torch.tensor([[3.0]]), torch.tensor([[1]])).item() == 0.0  # one token: centred, var 0


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="scores"):
        reinforce_plus_plus_advantages(torch.zeros(2, 1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gamma"):
        reinforce_plus_plus_advantages(torch.zeros(2), torch.ones(2, 3), gamma=1.5)


def test_trainer_requires_its_config(tiny_model_dir, tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="ReinforcePlusPlusConfig"):
        ReinforcePlusPlusTrainer(
            tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), GRPOConfig(str(tmp_path), use_cpu=True)
        )


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_trainer_advantages_are_the_whitened_scores(tiny_model_dir, tmp_path, estimator):
    """Without KL (β = 0) every token of a completion carries its score; the advantages are those scores whitened over
    the batch's tokens, recomputed here from the completions' rewards with the standard library."""
    args = ReinforcePlusPlusConfig(**tiny_run_args(tmp_path, beta=0.0, advantage_estimator=estimator))
    trainer = ReinforcePlusPlusTrainer(tiny_model_dir, length_reward, args=args, train_dataset=PROMPTS)
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:2] for _ in range(4)])
    mask = batch["completion_mask"]
    lengths = mask.sum(1).tolist()
    texts = trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    rewards = [float(len(t)) for t in texts]
    if estimator == "reinforce_plus_plus_baseline":
        rewards = [r - statistics.fmean(rewards[i - i % 4 : i - i % 4 + 4]) for i, r in enumerate(rewards)]
    tokens = [r for r, n in zip(rewards, lengths) for _ in range(int(n))]
    expected = iter(whitened(tokens))
    adv = batch["advantages"]
    assert adv.shape == mask.shape
    for i, n in enumerate(lengths):
        for t in range(mask.shape[1]):
            assert adv[i, t].item() == pytest.approx(next(expected) if t < n else 0.0, abs=1e-5)
    assert "rfpp_scores" not in batch and "rfpp_kl" not in batch


def test_trainer_trains_with_the_kl_in_the_reward(tiny_model_dir, tmp_path):
    """β > 0 with kl_penalty='reward': a reference model is loaded, the loss has no k3 term (TRL's `kl` metric is the
    token mean of k1 logged at generation), and off-policy steps (steps_per_generation=2) train."""
    args = ReinforcePlusPlusConfig(**tiny_run_args(tmp_path, beta=0.1, steps_per_generation=2, max_steps=2))
    trainer = ReinforcePlusPlusTrainer(tiny_model_dir, length_reward, args=args, train_dataset=PROMPTS)
    assert trainer.ref_model is not None and trainer.kl_in_reward
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    logs = [log for log in trainer.state.log_history if "kl" in log]
    assert logs and all(math.isfinite(log["kl"]) for log in logs)
    assert trainer.beta == 0.1  # restored after each loss computation


def test_trainer_puts_k1_to_the_reference_in_the_reward(tiny_model_dir, tmp_path):
    """On-policy (TRL keeps no old log-probs): the trainer recomputes log π_old and subtracts β·(log π_old − log π_ref)
    per token; checked against log-probs computed here from the two models."""
    args = ReinforcePlusPlusConfig(**tiny_run_args(tmp_path, beta=0.5, bf16=False))  # fp32, as the check below
    trainer = ReinforcePlusPlusTrainer(tiny_model_dir, length_reward, args=args, train_dataset=PROMPTS)
    with torch.no_grad():  # move the policy away from the reference so that k1 is not 0
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS["prompt"][:2] for _ in range(4)])
    assert "old_per_token_logps" not in batch  # on-policy: the trainer had to recompute π_old itself
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    num_completion = batch["completion_ids"].shape[1]

    def logps(model):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -num_completion - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)

    k1 = logps(trainer.model) - logps(trainer.ref_model)
    mask = batch["completion_mask"]
    assert (k1 * mask).abs().max() > 1e-3
    texts = trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    scores = torch.tensor([float(len(t)) for t in texts])
    expected = reinforce_plus_plus_advantages(scores, mask, kl=k1, kl_coef=0.5)
    assert torch.allclose(batch["advantages"], expected, atol=1e-4)
    assert not torch.allclose(batch["advantages"], reinforce_plus_plus_advantages(scores, mask), atol=1e-3)


# ------------------------------------------------------------------------------------------------------ configuration
COMMON = dict(output_dir="unused", use_cpu=True, report_to="none")

#: (fields, the start of the message: the field it names in backticks, then what it says)
INVALID_CONFIGS = [
    (dict(advantage_estimator="rloo"), "`advantage_estimator` must be one of"),
    (dict(kl_penalty="both"), "`kl_penalty` must be one of ['reward', 'loss']"),
    (dict(kl_estimator="k4"), "`kl_estimator` must be one of ['k1', 'k2', 'k3']"),
    (dict(gamma=1.5), "`gamma` must be a number in [0, 1]; got 1.5"),
    (dict(dynamic_sampling_max_rounds=0), "`dynamic_sampling_max_rounds` must be"),
    (dict(multi_objective_aggregation="normalize_then_sum"), "`multi_objective_aggregation`"),
]


def _field(fragment: str) -> str:
    return re.match(r"`(\w+)", fragment).group(1)


@pytest.mark.parametrize(
    "overrides, fragment", INVALID_CONFIGS, ids=[f"{i:02d}-{_field(m)}" for i, (_, m) in enumerate(INVALID_CONFIGS)]
)
def test_invalid_config_is_rejected_at_construction_naming_the_field(overrides, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ReinforcePlusPlusConfig(**COMMON, **overrides)


def test_every_field_with_a_check_has_a_row_and_the_defaults_are_valid():
    """Every field REINFORCE++ adds to GRPOConfig is refused with a message when invalid (a row above), except the
    dynamic-sampling switch and its metric (a reward function's name, checked by the trainer); the dynamic-sampling
    fields are the library's (`rpg_trl.dynamic_sampling.DynamicSamplingArguments`, as RPGConfig's); the defaults are
    valid."""
    from trl import GRPOConfig

    from rpg_trl.dynamic_sampling import DynamicSamplingArguments

    own_fields = set(ReinforcePlusPlusConfig.__dataclass_fields__) - set(GRPOConfig.__dataclass_fields__)
    assert own_fields - {_field(m) for _, m in INVALID_CONFIGS} == {"dynamic_sampling", "dynamic_sampling_metric"}
    assert issubclass(ReinforcePlusPlusConfig, DynamicSamplingArguments)
    ReinforcePlusPlusConfig(**COMMON)


# --------------------------------------------------- the project's example script: --algorithm rfpp and rfppb
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def rpg_math():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import rpg_math

        yield rpg_math
    finally:
        sys.path.remove(str(EXAMPLES))


def test_the_examples_reinforce_plus_plus_baseline_shares_everything_but_the_loss_with_rpg(rpg_math):
    """The example's REINFORCE++ trainer has RPGTrainer's parts around the loss (the library's mixins), and its
    configuration the dynamic-sampling fields."""
    from rpg_trl.dynamic_sampling import DynamicSamplingMixin
    from rpg_trl.reliability import ReliabilityMixin

    trainer = rpg_math.reinforce_plus_plus_trainer()
    assert issubclass(trainer, ReliabilityMixin) and issubclass(trainer, DynamicSamplingMixin)
    assert issubclass(trainer, ReinforcePlusPlusTrainer) and issubclass(trainer, rpg_math.PerBenchmarkEvalMetrics)
    assert {"dynamic_sampling", "dynamic_sampling_max_rounds", "dynamic_sampling_metric"} <= set(
        ReinforcePlusPlusConfig.__dataclass_fields__
    )


@pytest.mark.parametrize(
    "algorithm, estimator", [("rfpp", "reinforce_plus_plus"), ("rfppb", "reinforce_plus_plus_baseline")]
)
def test_the_examples_reinforce_plus_plus_baselines_train(rpg_math, tmp_path, algorithm, estimator):
    """--algorithm rfpp / rfppb of examples/rpg_math.py: REINFORCE++(-Baseline) with the KL to the initial model in
    the reward, dynamic sampling included (the research package's ReinforcePlusPlusTrainer)."""
    from rpg_trl.testing import no_activation_checkpointing, save_math_assets

    assets = save_math_assets(tmp_path / "assets")
    out = tmp_path / "out"
    flags = {
        "--model_name_or_path": assets["model"],
        "--train_dataset": assets["train"],
        "--eval_datasets": assets["eval"],
        "--output_dir": str(out),
        "--algorithm": algorithm,
        "--num_generations": "4",
        "--steps_per_generation": "2",
        "--per_device_train_batch_size": "8",
        "--max_steps": "1",
        "--max_completion_length": "16",
        "--overlong_buffer": "16",
        "--dynamic_sampling_max_rounds": "3",
        "--learning_rate": "1e-3",
        "--eval_strategy": "no",
        "--epsilon_high": "0.2",
        "--beta": "0.01",
        "--use_cpu": "true",
        "--report_to": "none",
        "--save_strategy": "no",
        "--logging_steps": "1",
        "--disable_tqdm": "true",
        f"--{next(iter(no_activation_checkpointing()))}": "false",  # activation_checkpointing where it exists
    }
    args = rpg_math.make_parser().parse_args_and_config(
        [*(item for pair in flags.items() for item in pair), "--dynamic_sampling"]
    )
    config = rpg_math.baseline_config(args[1], algorithm)
    assert type(config) is ReinforcePlusPlusConfig
    assert (config.advantage_estimator, config.kl_penalty, config.beta) == (estimator, "reward", 0.01)
    assert config.dynamic_sampling and (config.epsilon, config.epsilon_high) == (0.2, 0.2)
    if algorithm == "rfpp":  # one run end to end (both estimators train above, with the trainer alone)
        rpg_math.main(*args)
        assert (out / "model.safetensors").is_file()
