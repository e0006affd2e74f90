"""The configurations (`rpg_trl/config.py`, `AsyncRPGConfig`): the paper's defaults, the
values derived when the configuration is built, and one table of the invalid values and combinations that each refuses
when it is built, with a message that names the field (docs/guarantees.md, "What is checked at configuration time")."""

import math
import re
import warnings
from unittest.mock import PropertyMock, patch

import pytest
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

import rpg_trl.config
import rpg_trl.dynamic_sampling
import rpg_trl.kl_control
from rpg_trl import RPGConfig
from rpg_trl.config import KLControlArguments, OnPolicyKLWarning, RPGLossArguments
from rpg_trl.dynamic_sampling import DynamicSamplingArguments
from rpg_trl.reliability.config import ReliabilityArguments
from rpg_trl.testing import build_char_tokenizer
from rpg_trl.testing.runs import PROMPTS, count_sevens, tiny_run_args

from helpers.trl_release import async_trl_missing, needs_async_trl


if async_trl_missing():  # a TRL older than 1.16: rpg_trl.async_rpg refuses it, and its rows skip (needs_async_trl)

    class AsyncRPGConfig:
        """Stands in for the asynchronous trainer's configuration in the rows that name it."""

    AsyncGRPOConfig = AsyncRPGConfig
else:
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from rpg_trl.async_rpg import AsyncRPGConfig

COMMON = dict(output_dir="unused", use_cpu=True, report_to="none")

# (configuration class, fields, the start of the message: the field it names in backticks, then what it says)
INVALID_CONFIGS = [
    # RPG's own hyperparameters
    (RPGConfig, dict(divergence="js"), "`divergence` must be one of 'fkl', 'ufkl', 'rkl', 'urkl'; got 'js'"),
    (RPGConfig, dict(estimator="ppo"), "`estimator` must be one of 'reinforce', 'differentiable'; got 'ppo'"),
    (RPGConfig, dict(aggregation="sum"), "`aggregation` must be one of 'token-mean'"),
    (RPGConfig, dict(loss_type="cispo"), "`loss_type='cispo'` selects a different surrogate loss"),
    (RPGConfig, dict(loss_type="sapo"), "`loss_type='sapo'` selects a different surrogate loss"),
    (RPGConfig, dict(loss_type="vespo"), "`loss_type='vespo'` selects a different surrogate loss"),
    (RPGConfig, dict(loss_type="grpo", aggregation="token-mean"), "`aggregation='token-mean'` and `loss_type='grpo'`"),
    (RPGConfig, dict(beta=-1.0), "`beta` must be >= 0.0; got -1.0"),
    (RPGConfig, dict(beta=float("nan")), "`beta` must be a finite number; got nan"),
    (RPGConfig, dict(epsilon=-0.1), "`epsilon` must be >= 0.0; got -0.1"),
    (RPGConfig, dict(epsilon=1.0), "`epsilon` must be in [0, 1)"),
    (RPGConfig, dict(epsilon_high=-0.1), "`epsilon_high` must be >= 0.0; got -0.1"),
    (RPGConfig, dict(clip_c=1.0), "`clip_c` must be > 1.0; got 1.0"),
    (RPGConfig, dict(clip_c=1.1), "`clip_c` (the dual-clip bound for negative advantages) must be >= 1 +"),
    (RPGConfig, dict(importance_sampling_level="group"), "`importance_sampling_level` must be one of 'token'"),
    (RPGConfig, dict(kl_importance_weight=False, divergence="rkl"), "`kl_importance_weight=False` is the uncorrected"),
    (RPGConfig, dict(use_bias_correction_kl=False, divergence="fkl"), "`use_bias_correction_kl=False` is the"),
    (RPGConfig, dict(kl_anchor="initial"), "`kl_anchor` must be one of ['sampling', 'reference'] or None"),
    (RPGConfig, dict(kl_anchor="reference", beta=0.0), "`kl_anchor='reference'` with `beta=0`"),
    (RPGConfig, dict(delta=2.0), "`delta` (INTELLECT-2 two-sided clipping) is not used by RPG"),
    (RPGConfig, dict(kl_level="prefix"), "`kl_level` must be one of 'token', 'sequence'; got 'prefix'"),
    (
        RPGConfig,
        dict(kl_clip_mode="w_bar"),
        "`kl_clip_mode` must be one of 'exact', 'truncated', 'clipped', 'stopped'; got 'w_bar'",
    ),
    (RPGConfig, dict(kl_level="sequence", use_bias_correction_kl=False), "`use_bias_correction_kl=False` (GRPO's"),
    (RPGConfig, dict(kl_to_go="k2"), "`kl_to_go` must be one of 'log_ratio', 'k3'; got 'k2'"),
    (RPGConfig, dict(kl_to_go="k3"), "`kl_to_go='k3'` estimates the KL-to-go of each token"),
    (
        RPGConfig,
        dict(kl_to_go="k3", kl_level="sequence", divergence="ufkl"),
        "`kl_to_go='k3'` estimates the KL-to-go of each token (the KL of the tokens after it), which only the reverse "
        "divergences have over whole completions: it needs kl_level='sequence' and divergence in ['rkl', 'urkl']; got "
        "kl_level='sequence', divergence='ufkl'",
    ),
    (RPGConfig, dict(kl_estimate="exact"), "`kl_estimate` must be one of 'sample', 'vocabulary'; got 'exact'"),
    (
        RPGConfig,
        dict(kl_estimate="vocabulary", kl_clip_mode="clipped"),
        "`kl_clip_mode='clipped'` evaluates the sampled token's KL weight at its clipped importance weight",
    ),
    (RPGConfig, dict(kl_to_go_baseline="mean"), "`kl_to_go_baseline` must be one of 'none', 'leave_one_out'"),
    (
        RPGConfig,
        dict(kl_to_go_baseline="leave_one_out", kl_level="sequence"),
        "`kl_to_go_baseline='leave_one_out'` needs the exact KL weights",
    ),
    (RPGConfig, dict(kl_to_go_baseline="leave_one_out"), "`kl_to_go_baseline='leave_one_out'` subtracts a baseline"),
    (RPGConfig, dict(rpg_clip="yes"), "`rpg_clip` must be a bool; got 'yes'"),
    (RPGConfig, dict(importance_weight_warning_threshold=0.5), "`importance_weight_warning_threshold` must be"),
    (RPGConfig, dict(kl_drift_warning="yes"), "`kl_drift_warning` must be True or False; got 'yes'"),
    (RPGConfig, dict(kl_drift_min_kl=-0.1), "`kl_drift_min_kl` must be a finite number >= 0"),
    (RPGConfig, dict(kl_drift_min_kl=float("nan")), "`kl_drift_min_kl` must be a finite number >= 0"),
    (
        RPGConfig,
        dict(main_process_exit_timeout=0),
        "`main_process_exit_timeout` must be a finite number of seconds > 0",
    ),
    # reference sync
    (RPGConfig, dict(sync_ref_model=True, kl_anchor="sampling"), "`sync_ref_model=True` needs a reference model"),
    (
        RPGConfig,
        dict(ref_model_sync_kl_threshold=0.1, kl_anchor="sampling"),
        "`ref_model_sync_kl_threshold` needs a reference model, but `kl_anchor='sampling'`",
    ),
    (
        RPGConfig,
        dict(sync_ref_model=True, beta=0.0),
        "`kl_anchor='reference'` (chosen because `sync_ref_model=True` asks for a reference) with `beta=0`",
    ),
    (
        RPGConfig,
        dict(kl_anchor="reference", ref_model_sync_kl_threshold=0.0),
        "`ref_model_sync_kl_threshold` (κ) must be > 0; got 0.0",
    ),
    (
        RPGConfig,
        dict(kl_anchor="reference", ref_model_sync_kl_threshold=-1.0),
        "`ref_model_sync_kl_threshold` (κ) must be > 0; got -1.0",
    ),
    (RPGConfig, dict(ref_model_sync_kl_ema=1.0), "`ref_model_sync_kl_ema` must be in [0, 1); got 1.0"),
    (RPGConfig, dict(ref_model_sync_steps=0), "`ref_model_sync_steps` must be >= 1"),
    (
        RPGConfig,
        dict(kl_anchor="reference", sync_ref_model=True, ref_model_mixup_alpha=0.0),
        "`ref_model_mixup_alpha` must be in (0, 1]",
    ),
    # the adaptive KL coefficient (KL budget, rpg_trl/kl_control.py)
    (RPGConfig, dict(kl_target=0.0, steps_per_generation=4), "`kl_target` must be a finite number > 0 or None"),
    (RPGConfig, dict(kl_target=float("inf"), steps_per_generation=4), "`kl_target` must be a finite number > 0"),
    (RPGConfig, dict(kl_target=0.1, steps_per_generation=4, beta=0.0), "`kl_target` needs `beta > 0`"),
    (RPGConfig, dict(kl_target=0.1), "`kl_target` with kl_anchor='sampling' needs optimizer steps"),
    (RPGConfig, dict(kl_horizon=100.0), "`kl_horizon` sets the adaptive KL coefficient, which only acts with"),
    (RPGConfig, dict(kl_target=0.1, kl_anchor="reference", kl_horizon=-1.0), "`kl_horizon` must be a finite number"),
    (RPGConfig, dict(kl_target=0.1, kl_anchor="reference", kl_horizon=1.0), "`kl_horizon` must exceed 0.2 × the"),
    (RPGConfig, dict(kl_beta_min=1e-6), "`kl_beta_min` sets the adaptive KL coefficient, which only acts with"),
    (RPGConfig, dict(kl_target=0.1, kl_anchor="reference", kl_beta_min=0.0), "`kl_beta_min` must be a finite number"),
    (
        RPGConfig,
        dict(kl_target=0.1, kl_anchor="reference", kl_beta_min=0.1, kl_beta_max=0.01),
        "`kl_beta_min` (0.1) must be <= `kl_beta_max` (0.01)",
    ),
    (RPGConfig, dict(kl_beta_max=1.0), "`kl_beta_max` sets the adaptive KL coefficient, which only acts with"),
    (RPGConfig, dict(kl_target=0.1, kl_anchor="reference", kl_beta_max=float("nan")), "`kl_beta_max` must be a"),
    (
        RPGConfig,
        dict(kl_target=0.1, kl_anchor="reference", beta=1.0, kl_beta_max=0.5),
        "`beta` (the initial coefficient of the adaptive controller) must lie within [kl_beta_min, kl_beta_max]",
    ),
    # dynamic sampling
    (RPGConfig, dict(dynamic_sampling_max_rounds=0), "`dynamic_sampling_max_rounds` must be an integer >= 1"),
    # sampling, batching and rewards (TRL accepts these and fails, or produces NaN, later)
    (RPGConfig, dict(temperature=0.0), "`temperature` must be a finite number > 0"),
    (RPGConfig, dict(num_iterations=0), "`num_iterations` must be an integer >= 1; got 0"),
    (RPGConfig, dict(steps_per_generation=0), "`steps_per_generation` must be an integer >= 1; got 0"),
    (RPGConfig, dict(max_completion_length=0), "`max_completion_length` must be an integer >= 1; got 0"),
    (RPGConfig, dict(reward_weights=[float("nan")]), "`reward_weights` must be finite numbers"),
    (
        RPGConfig,
        dict(vllm_request_timeout=0),
        "`vllm_request_timeout` must be a finite number of seconds > 0, or None",
    ),
    (RPGConfig, dict(vllm_request_timeout=float("inf")), "`vllm_request_timeout` must be a finite number of seconds"),
    (RPGConfig, dict(reward_timeout=0), "`reward_timeout` must be a finite number of seconds > 0, or None"),
    (RPGConfig, dict(reward_timeout=float("nan")), "`reward_timeout` must be a finite number of seconds > 0, or None"),
    (RPGConfig, dict(scale_rewards="max"), "`scale_rewards` must be 'group', 'batch' or 'none'"),
    (RPGConfig, dict(multi_objective_aggregation="max"), "`multi_objective_aggregation` must be"),
    (RPGConfig, dict(top_entropy_quantile=1.5), "`top_entropy_quantile` must be in (0, 1]"),
    (RPGConfig, dict(entropy_coef=float("inf")), "`entropy_coef` must be a finite number; got inf"),
    (RPGConfig, dict(off_policy_mask_threshold=-1.0), "`off_policy_mask_threshold` (a KL bound) must be"),
    (RPGConfig, dict(top_p=0.0), "`top_p` must be in (0, 1]"),
    # the loss and reliability fields shared with the asynchronous trainer's configuration (RPGLossArguments,
    # ReliabilityArguments)
    (AsyncRPGConfig, dict(divergence="kl"), "`divergence` must be one of"),
    (AsyncRPGConfig, dict(estimator="ppo"), "`estimator` must be one of"),
    (AsyncRPGConfig, dict(clip_c=1.1), "`clip_c` (the dual-clip bound for negative advantages)"),
    (AsyncRPGConfig, dict(beta=-1.0), "`beta` must be >= 0.0"),
    (AsyncRPGConfig, dict(rpg_clip="yes"), "`rpg_clip` must be a bool"),
    (AsyncRPGConfig, dict(kl_drift_warning=1), "`kl_drift_warning` must be True or False"),
    (AsyncRPGConfig, dict(kl_drift_min_kl=float("inf")), "`kl_drift_min_kl` must be a finite number >= 0"),
    (AsyncRPGConfig, dict(main_process_exit_timeout=float("inf")), "`main_process_exit_timeout` must be a finite"),
    (AsyncRPGConfig, dict(vllm_request_timeout=0), "`vllm_request_timeout` must be a finite number of seconds > 0"),
    (AsyncRPGConfig, dict(kl_anchor="reference", beta=0.0), "`kl_anchor='reference'` with `beta=0`"),
    (AsyncRPGConfig, dict(kl_anchor="initial"), "`kl_anchor` must be one of"),
    (AsyncRPGConfig, dict(kl_importance_weight=False, divergence="fkl"), "`kl_importance_weight=False` is the"),
    (AsyncRPGConfig, dict(kl_level="sequence"), "`kl_level='sequence'` is not available with AsyncRPGTrainer"),
    (AsyncRPGConfig, dict(kl_clip_mode="none"), "`kl_clip_mode` must be one of"),
    (AsyncRPGConfig, dict(kl_to_go="k3"), "`kl_to_go='k3'` estimates the KL-to-go of each token"),
    (AsyncRPGConfig, dict(kl_to_go_baseline="leave_one_out"), "`kl_to_go_baseline='leave_one_out'` subtracts a"),
    (AsyncRPGConfig, dict(kl_estimate="vocabulary"), "`kl_estimate='vocabulary'` is not available with AsyncRPG"),
    (AsyncRPGConfig, dict(importance_weight_warning_threshold=1.0), "`importance_weight_warning_threshold` must be"),
    (AsyncRPGConfig, dict(kl_target=0.1), "`kl_target` (the adaptive KL coefficient) is not available with AsyncRPG"),
    (AsyncRPGConfig, dict(kl_horizon=100.0), "`kl_horizon` sets the adaptive KL coefficient, which only acts with"),
    (AsyncRPGConfig, dict(kl_beta_min=1e-6), "`kl_beta_min` sets the adaptive KL coefficient, which only acts with"),
    (AsyncRPGConfig, dict(kl_beta_max=1.0), "`kl_beta_max` sets the adaptive KL coefficient, which only acts with"),
]


def _field(fragment: str) -> str:
    """The field a row's message names first (in backticks)."""
    return re.match(r"`(\w+)", fragment).group(1)


@pytest.mark.parametrize(
    "config_class, overrides, fragment",
    [pytest.param(*row, marks=needs_async_trl) if row[0] is AsyncRPGConfig else row for row in INVALID_CONFIGS],
    ids=[f"{i:02d}-{cls.__name__}-{_field(m)}" for i, (cls, _, m) in enumerate(INVALID_CONFIGS)],
)
def test_invalid_config_is_rejected_at_construction_naming_the_field(config_class, overrides, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        config_class(**COMMON, **overrides)


@pytest.mark.parametrize(
    "config_class, base, exempt",
    [
        # A switch, and a reward function's name (checked against the reward functions by the trainer).
        (RPGConfig, GRPOConfig, {"dynamic_sampling", "dynamic_sampling_metric"}),
        pytest.param(AsyncRPGConfig, AsyncGRPOConfig, set(), marks=needs_async_trl),
    ],
)
def test_every_rpg_field_with_a_check_has_a_row_and_the_defaults_are_valid(config_class, base, exempt):
    own_fields = set(config_class.__dataclass_fields__) - set(base.__dataclass_fields__)
    rows = {_field(m) for cls, _, m in INVALID_CONFIGS if cls is config_class}
    assert own_fields - rows == exempt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RPGConfig's defaults warn that the KL cannot act on policy (tested below)
        config_class(**COMMON)  # the defaults are valid


def test_paper_defaults():
    config = RPGConfig(**COMMON)
    assert (config.divergence, config.estimator, config.kl_anchor) == ("urkl", "reinforce", "sampling")
    assert config.beta == 1e-4 and config.epsilon == 0.2 and config.epsilon_high == 0.28 and config.clip_c == 10.0
    assert config.scale_rewards == "none" and config.aggregation == "token-mean" and config.rpg_clip


@needs_async_trl
def test_async_config_has_rpg_loss_fields_with_paper_defaults():
    config = AsyncRPGConfig(**COMMON)
    assert set(RPGLossArguments.__dataclass_fields__) <= set(AsyncRPGConfig.__dataclass_fields__)
    assert set(ReliabilityArguments.__dataclass_fields__) <= set(AsyncRPGConfig.__dataclass_fields__)
    assert (config.divergence, config.estimator, config.rpg_clip, config.clip_c) == ("urkl", "reinforce", True, 10.0)
    assert (config.beta, config.epsilon, config.epsilon_high) == (1e-4, 0.2, 0.28)
    assert config.kl_anchor == "sampling"  # None resolves to the sampling policy: no reference model


@pytest.mark.parametrize(
    "loss_type, aggregation",
    [
        ("dapo", "token-mean"),
        ("bnpo", "token-mean"),
        ("grpo", "seq-mean-token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
        ("luspo", "seq-mean-token-sum"),
    ],
)
def test_loss_type_chooses_the_aggregation_and_an_explicit_aggregation_the_loss_type(loss_type, aggregation):
    assert RPGConfig(**COMMON, loss_type=loss_type).aggregation == aggregation
    # An explicit aggregation with TRL's default loss_type ("dapo") takes the loss type whose normaliser it uses.
    config = RPGConfig(**COMMON, aggregation=aggregation)
    assert config.aggregation == aggregation
    assert config.loss_type == {"token-mean": "dapo"}.get(aggregation, loss_type)


@pytest.mark.parametrize(
    "overrides, anchor",
    [
        (dict(), "sampling"),
        (dict(sync_ref_model=True), "reference"),
        (dict(ref_model_sync_kl_threshold=0.1), "reference"),
        (dict(kl_anchor="reference"), "reference"),
        (dict(kl_anchor="sampling"), "sampling"),
    ],
)
def test_an_unset_kl_anchor_follows_the_reference_options(overrides, anchor):
    assert RPGConfig(**COMMON, beta=0.05, **overrides).kl_anchor == anchor


def test_valid_sync_config():
    args = RPGConfig(**COMMON, kl_anchor="reference", beta=0.05, ref_model_sync_kl_threshold=0.1)
    assert (args.ref_model_sync_kl_threshold, args.ref_model_sync_kl_ema) == (0.1, 0.9)


def test_trl_uncorrected_kl_switch_is_rpg_kl_importance_weight():
    assert RPGConfig(**COMMON).kl_importance_weight is True
    assert RPGConfig(**COMMON, use_bias_correction_kl=False).kl_importance_weight is False


def test_a_kl_to_the_sampling_policy_that_cannot_act_warns():
    # One optimizer step per generation batch: π_θ = π_old at every step, the KL term has no gradient.
    with pytest.warns(OnPolicyKLWarning, match="the KL does not regularise"):
        RPGConfig(**COMMON, steps_per_generation=2, gradient_accumulation_steps=2)
    for overrides in (
        dict(steps_per_generation=2, gradient_accumulation_steps=1),  # two optimizer steps per generation batch
        dict(steps_per_generation=1, num_iterations=2),  # each batch is used twice
        dict(beta=0.0),  # no KL
        dict(kl_anchor="reference"),  # a reference that does not move with the policy
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            RPGConfig(**COMMON, **overrides)


def test_dynamic_sampling_needs_whole_groups_on_each_process():
    common = dict(COMMON, num_generations=4)
    # Two processes of 2 rows: the global batch holds whole groups, the local batches do not.
    with patch.object(RPGConfig, "world_size", new_callable=PropertyMock, return_value=2):
        with pytest.raises(ValueError, match="multiple of num_generations"):
            RPGConfig(**common, per_device_train_batch_size=2, dynamic_sampling=True)
        RPGConfig(**common, per_device_train_batch_size=2, dynamic_sampling=False)  # TRL's sampling copes


def test_algorithm_1_reading_with_a_reference_model_warns_at_construction():
    # kl_clip_mode="clipped" (the KL weight at the clipped ratio) can push the policy away from a reference that is not
    # the sampling policy: said at construction. Not with the sampling anchor per token (r = 1, urkl: the sign never flips), nor with
    # the other modes, nor without the clip.
    from rpg_trl.losses import KLSignWarning

    with pytest.warns(KLSignWarning, match="anchored to a reference model.*away from its anchor"):
        RPGConfig(**COMMON, kl_anchor="reference", beta=0.1, kl_clip_mode="clipped")
    # With the sampling anchor the per-token urkl weight saturates but keeps its sign; over whole completions (and for
    # rkl's score term) it can flip even there, and says so.
    for level, divergence in (("sequence", "urkl"), ("token", "rkl")):
        with pytest.warns(KLSignWarning, match=f"kl_level='{level}' and the KL anchored to the sampling policy"):
            RPGConfig(
                **COMMON, kl_anchor="sampling", beta=0.1, kl_clip_mode="clipped", kl_level=level, divergence=divergence
            )
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLSignWarning)
        RPGConfig(**COMMON, kl_anchor="sampling", beta=0.1, kl_clip_mode="clipped", steps_per_generation=4)
        RPGConfig(**COMMON, kl_anchor="reference", beta=0.1, kl_clip_mode="clipped", divergence="fkl")
        RPGConfig(**COMMON, kl_anchor="reference", beta=0.1, kl_clip_mode="truncated", kl_level="sequence")
        RPGConfig(**COMMON, kl_anchor="reference", beta=0.1, kl_clip_mode="clipped", rpg_clip=False)
        for mode in ("exact", "truncated", "stopped"):
            config = RPGConfig(**COMMON, kl_anchor="reference", beta=0.1, kl_clip_mode=mode)
            assert config.rpg_loss_spec().kl_clip_mode == mode


# ============================================================================== how the configuration is laid out
#: The headings of `RPGConfig`'s docstring, in order, as TRL's `GRPOConfig` heads its own ("> Parameters that control
#: ..."), and the mixin whose fields each documents (None: fields of `RPGConfig` itself or TRL fields it redeclares).
SECTIONS = {
    "the loss": RPGLossArguments,
    "the KL coefficient": KLControlArguments,
    "the reference model": None,
    "dynamic sampling": DynamicSamplingArguments,
    "reliability": ReliabilityArguments,
}


def _documented_sections(doc: str) -> dict[str, list[str]]:
    """Heading -> the parameter names documented under it, from a TRL-style docstring (`name (`type`, ...):` lines,
    8 spaces in, under `> Parameters that control <heading>` lines)."""
    sections, current = {}, None
    for line in doc.split("Parameters:", 1)[1].splitlines():
        heading = re.match(r" {8}> Parameters that control (.+)$", line)
        entry = re.match(r" {8}(\w+) \(`", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif entry:
            assert current is not None, f"{entry.group(1)} is documented before the first heading"
            current.append(entry.group(1))
    return sections


def test_rpg_config_documents_each_of_its_fields_once_under_a_heading_as_trl_does():
    """The docstring of `RPGConfig` groups its parameters under TRL's "> Parameters that control ..." headings, and
    documents exactly the fields RPG adds or gives another default (derived here from the dataclass fields, not from
    the docstring), each once, each mixin's fields under its own heading."""
    sections = _documented_sections(RPGConfig.__doc__)
    assert list(sections) == list(SECTIONS)
    documented = [name for names in sections.values() for name in names]
    assert len(documented) == len(set(documented)), "a field is documented twice"
    trl = GRPOConfig.__dataclass_fields__
    ours = RPGConfig.__dataclass_fields__
    added = set(ours) - set(trl)
    redeclared = {name for name in trl if ours[name].default != trl[name].default}
    assert redeclared == {"beta", "epsilon_high", "scale_rewards"}  # the paper's defaults (Sec. 5, Appendix H)
    assert set(documented) == added | redeclared
    # Each mixin's fields under its heading, but the loss's KL anchor, which says whether there is a reference model.
    assert "kl_anchor" in sections["the reference model"]
    for heading, mixin in SECTIONS.items():
        if mixin is not None:
            assert set(mixin.__dataclass_fields__) - set(trl) - {"kl_anchor"} <= set(sections[heading]), heading
    assert "reward_timeout" in sections["reliability"]  # RPGTrainer's alone (below), documented with the others


@pytest.mark.parametrize(
    "config_class",
    [RPGConfig, pytest.param(AsyncRPGConfig, marks=needs_async_trl)],
)
def test_the_reliability_fields_are_one_arguments_class_that_both_rpg_configurations_share(config_class):
    """The settings of `rpg_trl.reliability` that both RPG trainers honour are the fields of `ReliabilityArguments`,
    no longer in the loss's mixin, with the same defaults in both configurations; the reward time-out is `RPGConfig`'s
    alone (the asynchronous trainer scores rewards in TRL's rollout worker, without the reward guard)."""
    reliability = ReliabilityArguments.__dataclass_fields__
    assert set(reliability) == {
        "importance_weight_warning_threshold",
        "kl_drift_warning",
        "kl_drift_min_kl",
        "main_process_exit_timeout",
        "vllm_request_timeout",
    }
    assert not set(reliability) & set(RPGLossArguments.__dataclass_fields__)
    assert issubclass(config_class, ReliabilityArguments)
    fields = config_class.__dataclass_fields__
    assert {name: fields[name].default for name in reliability} == {
        "importance_weight_warning_threshold": 100.0,
        "kl_drift_warning": True,
        "kl_drift_min_kl": 0.01,
        "main_process_exit_timeout": 60.0,
        "vllm_request_timeout": 600.0,
    }
    assert ("reward_timeout" in fields) is (config_class is RPGConfig)


def test_each_arguments_class_lives_beside_what_it_configures_and_the_old_import_still_works():
    """Each arguments class is declared beside what it configures: `DynamicSamplingArguments` in
    `rpg_trl.dynamic_sampling` (the research package's REINFORCE++ takes it from there, not from the RPG configuration),
    `KLControlArguments` in `rpg_trl.kl_control`, `ReliabilityArguments` in `rpg_trl.reliability.config`; the old
    imports from `rpg_trl.config` still give those classes."""
    assert DynamicSamplingArguments.__module__ == "rpg_trl.dynamic_sampling"
    assert rpg_trl.config.DynamicSamplingArguments is rpg_trl.dynamic_sampling.DynamicSamplingArguments
    assert ReliabilityArguments.__module__ == "rpg_trl.reliability.config"
    assert KLControlArguments.__module__ == "rpg_trl.kl_control"
    assert rpg_trl.config.KLControlArguments is rpg_trl.kl_control.KLControlArguments
    assert issubclass(RPGConfig, DynamicSamplingArguments)


@needs_async_trl
def test_the_async_command_line_takes_the_kl_budget_flags_and_refuses_them_naming_them(tmp_path):
    """`AsyncRPGConfig` keeps `KLControlArguments`' fields only to refuse them, so that its command line accepts the
    same flags as `RPGConfig`'s: the parser takes each of them and the configuration refuses it, naming it, where an
    unknown flag would stop the parser with a usage error (`SystemExit`) instead."""
    parser = HfArgumentParser(AsyncRPGConfig)
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
    (config,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    assert config.kl_target is None
    for name in KLControlArguments.__dataclass_fields__:
        with pytest.raises(ValueError, match=f"^`{name}`"):
            parser.parse_args_into_dataclasses(args=argv + [f"--{name}", "0.1"], look_for_args_file=False)


#: Values of TRL's own fields that `RPGConfig` refuses although RPG gives the field no new meaning (`_check_trl_values`
#: and, for the reference sync, `_check_reference`): each is kept because TRL builds both its configuration and its
#: trainer with it, and fails later, far from the input, or trains on silently.
TRL_VALUES_RPG_REFUSES = {
    "temperature": 0.0,
    "num_iterations": 0,
    "steps_per_generation": 0,
    "max_completion_length": 0,
    "reward_weights": [math.nan],
    "scale_rewards": "max",
    "multi_objective_aggregation": "max",
    "top_entropy_quantile": 1.5,
    "entropy_coef": math.inf,
    "off_policy_mask_threshold": -1.0,
    "top_p": 0.0,
    "ref_model_sync_steps": 0,
    "ref_model_mixup_alpha": 0.0,
}


def test_every_trl_field_rpg_refuses_a_value_of_is_a_loss_field_or_in_the_table_of_values_trl_takes():
    """Each TRL field that a row of `INVALID_CONFIGS` refuses for `RPGConfig` is either one that RPG's loss or
    reference reads with a meaning of its own, or in the table of values TRL takes (below): a new check of a TRL field
    comes with its proof."""
    trl = set(GRPOConfig.__dataclass_fields__)
    refused = {_field(m) for cls, _, m in INVALID_CONFIGS if cls is RPGConfig} & trl
    rpg_meaning = {
        "beta",
        "epsilon",
        "epsilon_high",
        "loss_type",
        "importance_sampling_level",
        "use_bias_correction_kl",
        "delta",
        "sync_ref_model",
    }
    assert refused == rpg_meaning | set(TRL_VALUES_RPG_REFUSES)


@pytest.mark.parametrize("name", sorted(TRL_VALUES_RPG_REFUSES))
def test_trl_builds_its_config_and_trainer_with_each_value_rpg_refuses_and_rpg_names_the_field(
    tiny_model_dir, tmp_path, name
):
    """Why `RPGConfig` re-checks these TRL fields: `GRPOConfig` and `GRPOTrainer` (TRL 1.16) are both built with the
    value, or fail naming something else (transformers' `max_new_tokens` for `max_completion_length=0`); `RPGConfig`
    refuses it when built, naming the field. Should TRL come to refuse one itself, naming it, this fails and RPG's
    check can go."""
    value = TRL_VALUES_RPG_REFUSES[name]
    overrides = dict(max_steps=1, num_generations=4, per_device_train_batch_size=4, max_completion_length=4)
    if name.startswith("ref_model_"):
        overrides.update(sync_ref_model=True, beta=0.04)  # the sync options act with a reference model only
    overrides[name] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(**tiny_run_args(tmp_path, **overrides))
        try:
            GRPOTrainer(
                tiny_model_dir, count_sevens, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
            )
        except Exception as error:  # noqa: BLE001 - any failure is fine here, as long as it does not name the field
            assert name not in str(error), f"TRL now refuses {name}={value!r} itself: {error}"
        with pytest.raises(ValueError, match=f"`{name}`"):
            RPGConfig(**tiny_run_args(tmp_path, **overrides))
