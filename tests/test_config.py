"""The configurations (`rpg_trl/config.py`, `AsyncRPGConfig`, `ReinforcePlusPlusConfig`): the paper's defaults, the
values derived when the configuration is built, and one table of the invalid values and combinations that each refuses
when it is built, with a message that names the field (docs/guarantees.md, "What is checked at configuration time")."""

import re
import warnings
from unittest.mock import PropertyMock, patch

import pytest
from trl import GRPOConfig

from rpg_trl import RPGConfig
from rpg_trl.config import OnPolicyKLWarning, RPGLossArguments
from rpg_trl.reinforce_plus_plus import ReinforcePlusPlusConfig

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
    # the loss fields shared with the asynchronous trainer's configuration (RPGLossArguments)
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
    (AsyncRPGConfig, dict(importance_weight_warning_threshold=1.0), "`importance_weight_warning_threshold` must be"),
    (AsyncRPGConfig, dict(kl_target=0.1), "`kl_target` (the adaptive KL coefficient) is not available with AsyncRPG"),
    (AsyncRPGConfig, dict(kl_horizon=100.0), "`kl_horizon` sets the adaptive KL coefficient, which only acts with"),
    (AsyncRPGConfig, dict(kl_beta_min=1e-6), "`kl_beta_min` sets the adaptive KL coefficient, which only acts with"),
    (AsyncRPGConfig, dict(kl_beta_max=1.0), "`kl_beta_max` sets the adaptive KL coefficient, which only acts with"),
    # REINFORCE++ (a baseline of the paper)
    (ReinforcePlusPlusConfig, dict(advantage_estimator="rloo"), "`advantage_estimator` must be one of"),
    (ReinforcePlusPlusConfig, dict(kl_penalty="both"), "`kl_penalty` must be one of ['reward', 'loss']"),
    (ReinforcePlusPlusConfig, dict(kl_estimator="k4"), "`kl_estimator` must be one of ['k1', 'k2', 'k3']"),
    (ReinforcePlusPlusConfig, dict(gamma=1.5), "`gamma` must be a number in [0, 1]; got 1.5"),
    (ReinforcePlusPlusConfig, dict(dynamic_sampling_max_rounds=0), "`dynamic_sampling_max_rounds` must be"),
    (ReinforcePlusPlusConfig, dict(multi_objective_aggregation="normalize_then_sum"), "`multi_objective_aggregation`"),
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
        (ReinforcePlusPlusConfig, GRPOConfig, {"dynamic_sampling", "dynamic_sampling_metric"}),
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
