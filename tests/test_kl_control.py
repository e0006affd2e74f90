"""The adaptive KL coefficient (`kl_target`, `rpg_trl/kl_control.py`): the controller's arithmetic against numbers
computed by hand, its wiring into `RPGTrainer` (the KL it reads, the β the next step's loss uses, the reference sync),
two processes against one, and resuming with its state. The SIGKILL-and-resume test of the exact-resume standard runs
it too (`tests/test_guarantees.py`, scenario "kl-budget"); the invalid configurations are rows of
`tests/test_config.py`; a CPU run that holds the KL near two targets (`rpg-trl kl-budget`) is tested with the research
package (research/tests/test_kl_budget.py)."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.kl_control import AdaptiveKLCallback, AdaptiveKLController

from helpers import kl_control_two_proc
from helpers.ports import free_port
from helpers.tiny_runs import logged, make_trainer, rpg_warnings
from helpers.trl_release import needs_async_trl


ROOT = Path(__file__).resolve().parent.parent


# ==================================================================================================== the controller
def test_controller_follows_a_sequence_computed_by_hand():
    # δ = 0.05, H = 40, 8 samples per step: n/H = 0.2, so β changes by 0.2 × the clipped error (at most ±4%).
    controller = AdaptiveKLController(beta=0.1, target=0.05, horizon=40)
    steps = [
        # (KL, samples, β after): error = clip(KL/δ − 1, −0.2, 0.2), β ← β·(1 + error·n/H)
        (0.1, 8, 0.104),  # error +1 → +0.2: ×1.04
        (0.055, 8, 0.10608),  # error +0.1: ×1.02
        (0.05, 8, 0.10608),  # on target: unchanged
        (0.0, 8, 0.1018368),  # error −1 → −0.2: ×0.96
        (0.045, 8, 0.099800064),  # error −0.1: ×0.98
        (0.1, 16, 0.10778406912),  # twice the samples: ×1.08
        (float("nan"), 8, 0.10778406912),  # no measurement: unchanged
    ]
    for kl, samples, expected in steps:
        assert controller.update(kl, samples) == pytest.approx(expected, rel=1e-12)
    assert controller.num_updates == 6 and controller.last_kl == 0.1


def test_floor_and_ceiling_bound_beta():
    controller = AdaptiveKLController(beta=0.1, target=0.05, horizon=40, beta_min=0.0995, beta_max=0.105)
    # ×1.04 → 0.104; ×1.04 → 0.10816, held at the ceiling 0.105; ×1.04 → 0.105 again; ×0.96 → 0.1008;
    # ×0.96 → 0.096768, held at the floor 0.0995; ×0.96 → 0.0995 again.
    expected = [0.104, 0.105, 0.105, 0.1008, 0.0995, 0.0995]
    for kl, beta in zip([0.1, 0.1, 0.1, 0.0, 0.0, 0.0], expected):
        assert controller.update(kl, 8) == pytest.approx(beta, rel=1e-12)


def test_beta_rises_while_the_kl_is_above_target_and_falls_while_below():
    controller = AdaptiveKLController(beta=1.0, target=0.1, horizon=100)
    betas = [controller.update(kl, 10) for kl in [0.3, 0.2, 0.11, 0.1, 0.09, 0.02, 0.0]]
    assert betas[0] > 1.0 and betas[0] < betas[1] < betas[2]  # above target: rising
    assert betas[3] == betas[2]  # on target
    assert betas[3] > betas[4] > betas[5] > betas[6]  # below: falling


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beta=0.0, target=0.1), "`beta` must be a finite number > 0"),
        (dict(beta=0.1, target=-1.0), "`target` must be a finite number > 0"),
        (dict(beta=0.1, target=0.1, horizon=float("inf")), "`horizon` must be a finite number > 0"),
        (dict(beta=0.1, target=0.1, beta_min=0.2, beta_max=0.1), "`beta_min` (0.2) must be <= `beta_max` (0.1)"),
        (dict(beta=0.1, target=0.1, beta_max=0.05), "`beta` (the initial β) must lie within"),
    ],
)
def test_controller_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AdaptiveKLController(**kwargs)


def test_an_update_that_would_reach_zero_is_an_error_not_a_silent_zero():
    controller = AdaptiveKLController(beta=0.1, target=0.1, horizon=10)
    with pytest.raises(ValueError, match="the horizon must exceed 0.2"):
        controller.update(0.0, 50)  # ×(1 − 0.2·5) = 0
    assert controller.beta == 0.1


def test_callback_state_is_json_and_rebuilds_as_transformers_rebuilds_it():
    callback = AdaptiveKLCallback(beta=0.1, target=0.05, horizon=40, beta_max=1.0, level="sequence")
    callback.controller.update(0.1, 8)
    stored = json.loads(json.dumps(callback.state()))
    assert stored == {
        "args": {"beta": 0.1, "target": 0.05, "horizon": 40.0, "beta_min": None, "beta_max": 1.0, "level": "sequence"},
        "attributes": {"beta": pytest.approx(0.104), "last_kl": 0.1, "num_updates": 1},
    }
    rebuilt = AdaptiveKLCallback.from_state(stored)  # what transformers does with restore_callback_states_...=True
    assert rebuilt.state() == callback.state() and rebuilt.trainer is None
    with pytest.raises(ValueError, match="Unknown KL-controller state"):
        rebuilt.controller.load_attributes({"kl_coef": 1.0})


def test_config_defaults_and_the_horizon_default():
    config = RPGConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert (config.kl_target, config.kl_horizon, config.kl_beta_min, config.kl_beta_max) == (None, None, None, None)
    config = RPGConfig(output_dir="unused", use_cpu=True, report_to="none", kl_target=0.1, kl_anchor="reference")
    assert config.kl_horizon == 10000.0  # verl's and OpenRLHF's default
    # With the sampling anchor the KL acts when several optimizer steps share a generation batch.
    RPGConfig(output_dir="unused", use_cpu=True, report_to="none", kl_target=0.1, steps_per_generation=4)


# ==================================================================================================== in the trainer
@pytest.mark.parametrize("kl_level, controlled", [("token", "kl"), ("sequence", "kl/sequence")])
def test_the_loss_of_each_step_uses_the_beta_the_controller_set_after_the_previous_step(
    tiny_model_dir, tmp_path, kl_level, controlled
):
    """β reaches the loss (every micro-batch of the next step), from the logged KL of the chosen level."""
    import rpg_trl.trainer as trainer_module

    seen = []
    loss = trainer_module.rpg_per_token_loss

    def recording_loss(*args, **kwargs):
        seen.append(args[4].beta)  # the RPGLossSpec the trainer passes
        return loss(*args, **kwargs)

    horizon = 16.0  # 8 samples per step: β moves by up to ±10% a step
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        kl_anchor="reference",
        kl_level=kl_level,
        beta=0.05,
        kl_target=0.01,
        kl_horizon=horizon,
        max_steps=4,
    )
    assert trainer.kl_control_callback is not None and trainer.rpg_beta == 0.05
    with patch.object(trainer_module, "rpg_per_token_loss", recording_loss):
        trainer.train()
    betas, kls = logged(trainer, "beta"), logged(trainer, "kl_control/kl")
    assert betas[0] == 0.05 and len(set(betas)) == 4  # logged every step; moved every step
    assert seen == betas  # one micro-batch per step: the loss used the logged β
    assert kls == pytest.approx(logged(trainer, controlled), rel=1e-6)  # the logged KL of the chosen level
    for beta, next_beta, kl in zip(betas, betas[1:] + [trainer.rpg_beta], kls):
        error = max(-0.2, min(0.2, kl / 0.01 - 1))
        assert next_beta == pytest.approx(beta * (1 + error * 8 / horizon), rel=1e-12)


def test_with_gradient_accumulation_every_micro_batch_of_a_step_uses_its_beta(tiny_model_dir, tmp_path):
    import rpg_trl.trainer as trainer_module

    seen = []
    loss = trainer_module.rpg_per_token_loss

    def recording_loss(*args, **kwargs):
        seen.append(args[4].beta)
        return loss(*args, **kwargs)

    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        kl_anchor="reference",
        beta=0.05,
        kl_target=0.01,
        kl_horizon=16.0,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=2,
    )
    with patch.object(trainer_module, "rpg_per_token_loss", recording_loss):
        trainer.train()
    assert seen[0] == seen[1] != seen[2] == seen[3] != seen[4] == seen[5]  # β changes between steps only
    assert all("beta" in h for h in trainer.state.log_history if "loss" in h)  # at every logging step
    assert [h["step"] for h in trainer.state.log_history if "beta" in h] == [2, 3]


def test_after_a_reference_sync_the_kl_is_zero_and_beta_falls(tiny_model_dir, tmp_path):
    """A sync that copies the policy into the reference (α = 1), on-policy steps: the next step's KL is exactly 0, so
    the controller lowers β by the largest step, ×(1 − 0.2·8/16) = ×0.9."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        kl_anchor="reference",
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=1.0,
        beta=0.05,
        kl_target=0.01,
        kl_horizon=16.0,
        max_steps=5,
    )
    trainer.train()
    assert trainer.ref_sync_callback.sync_history == [2, 4]
    betas, kls = logged(trainer, "beta"), logged(trainer, "kl_control/kl")
    for step in (3, 5):  # the steps after the syncs; betas[s - 1] is the β step s used, kls[s - 1] its KL
        assert abs(kls[step - 1]) < 1e-6
        after = betas[step] if step < len(betas) else trainer.rpg_beta
        assert after == pytest.approx(0.9 * betas[step - 1], rel=1e-12)
    assert kls[1] > 0.01 and betas[2] > betas[1]  # before the first sync the KL to the initial model was above


@pytest.mark.slow
def test_two_processes_reach_the_same_beta_as_one(tiny_model_dir, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), kl_control_two_proc.__file__, tiny_model_dir, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single = kl_control_two_proc.run(tiny_model_dir, tmp_path / "single", world_size=1)

    assert ranks[0] == ranks[1]  # both processes hold the same β, bit for bit, in the controller and in the loss
    assert ranks[0]["controller_beta"] == ranks[0]["loss_beta"]
    assert len(single["beta"]) == 4 and len(set(single["beta"])) == 4 and single["kl"][1] > 0
    # The KL after three updates at learning rate 1.0 carries the order of the float32 sums (one process accumulates,
    # two all-reduce): measured 8.8e-6 relative at the 4th step on an Intel Xeon under ATEN_CPU_CAPABILITY=default,
    # whose KL weight outside the trust region is no longer saturated (kl_clip_mode). A β that the processes did not
    # share moves it by percents.
    assert ranks[0]["kl"] == pytest.approx(single["kl"], rel=3e-5)
    assert ranks[0]["beta"] == pytest.approx(single["beta"], rel=1e-9)
    assert ranks[0]["loss_beta"] == pytest.approx(single["loss_beta"], rel=1e-9)


@pytest.mark.parametrize("restore_flag", [False, True], ids=["state-from-trainer_state", "transformers-restores"])
def test_resume_continues_with_the_saved_beta(tiny_model_dir, tmp_path, restore_flag, caplog):
    kwargs = dict(
        kl_anchor="reference",
        beta=0.05,
        kl_target=0.01,
        kl_horizon=16.0,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        restore_callback_states_from_checkpoint=restore_flag,
    )
    full = make_trainer(tiny_model_dir, tmp_path / "full", **kwargs)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["AdaptiveKLCallback"]
    assert saved["attributes"]["beta"] == logged(full, "beta")[2] != 0.05  # the β that step 3 uses

    resumed = make_trainer(tiny_model_dir, tmp_path / "resumed", **kwargs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    callbacks = [type(cb).__name__ for cb in resumed.callback_handler.callbacks]
    assert callbacks.count("AdaptiveKLCallback") == 1 and resumed.kl_control_callback.trainer is resumed
    for key in ("beta", "kl_control/kl", "loss", "kl"):  # steps 1-2 from the checkpoint's history, then 3-4
        assert logged(resumed, key) == logged(full, key), key
    assert (
        resumed.rpg_beta == full.rpg_beta and resumed.kl_control_callback.state() == full.kl_control_callback.state()
    )

    if restore_flag:
        return
    # A checkpoint without the controller's state (written before it existed): β restarts, with a warning.
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["stateful_callbacks"]["AdaptiveKLCallback"]
    old = tmp_path / "old-checkpoint"
    shutil.copytree(checkpoint, old)
    (old / "trainer_state.json").write_text(json.dumps(state))
    (old / "rpg_checkpoint.json").unlink()  # written before the commit record too: the edited file is not refused
    with caplog.at_level(logging.WARNING):
        restarted = make_trainer(tiny_model_dir, tmp_path / "restarted", **kwargs)
        restarted.train(resume_from_checkpoint=str(old))
    assert any("without the KL controller's state" in m for m in rpg_warnings(caplog))
    assert logged(restarted, "beta")[2] == 0.05  # step 3


@needs_async_trl
def test_async_trainer_refuses_a_kl_target():
    from rpg_trl.async_rpg import AsyncRPGConfig

    with pytest.raises(ValueError, match="not available with AsyncRPGTrainer"):
        AsyncRPGConfig(output_dir="unused", use_cpu=True, report_to="none", kl_target=0.1)


def test_the_trainer_without_a_target_has_no_controller(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    assert trainer.kl_control_callback is None
    assert not any(isinstance(cb, AdaptiveKLCallback) for cb in trainer.callback_handler.callbacks)
    assert isinstance(trainer, RPGTrainer)


def test_the_two_callbacks_fed_a_kl_share_one_base():
    """AdaptiveKLCallback and RefModelSyncCallback: one base (`rpg_trl._kl_callback.KLFedCallback`) feeds the KL to
    their rule, forwards their attributes to it, and refuses to train without a trainer."""
    from rpg_trl._kl_callback import KLFedCallback
    from rpg_trl.ref_sync import RefModelSyncCallback

    control = AdaptiveKLCallback(beta=0.1, target=0.05, horizon=40)
    sync = RefModelSyncCallback(kl_threshold=0.1)
    assert isinstance(control, KLFedCallback) and isinstance(sync, KLFedCallback)
    assert control.rule is control.controller and sync.rule is sync.trigger
    # Sums over units: 0.3 over 3 tokens, then 0.1 over 2; a non-finite sum and an empty micro-batch add nothing.
    for callback in (control, sync):
        for kl_sum, count in ((0.3, 3), (float("nan"), 5), (1.0, 0), (torch.tensor(0.1), torch.tensor(2.0))):
            callback.observe_kl(kl_sum, count)
    assert control.step_kl() == pytest.approx(0.08)
    assert sync.trigger.end_step(1) is None and sync.kl_moving_average == pytest.approx(0.08)  # below κ = 0.1
    sync.kl_threshold = 0.05  # written through to the trigger
    assert sync.trigger.kl_threshold == 0.05 and sync.state()["args"]["kl_threshold"] == 0.05
    control.beta = 0.2
    assert control.controller.beta == 0.2 and control.state()["attributes"]["beta"] == 0.2
    for callback, hint in ((control, "callback.reinstall"), (sync, "callback.bind")):
        with pytest.raises(RuntimeError, match=f"{type(callback).__name__} has no trainer.*{hint}"):
            callback.on_train_begin(None, None, None)


def test_the_two_rules_restore_their_state_and_the_bounds_are_checked_by_one_function():
    """`load_attributes` and the β-bounds check are written once (`rpg_trl._kl_callback`): the controller and the
    reference-sync trigger restore a state through the one function (unknown keys refused, naming each rule; a list
    copied, not shared), and the configuration and the controller refuse the same bounds, each in its own names."""
    from rpg_trl import _kl_callback
    from rpg_trl.kl_control import check_kl_control_arguments
    from rpg_trl.ref_sync.trigger import SyncTrigger

    controller = AdaptiveKLController(beta=0.1, target=0.05)
    controller.load_attributes({"beta": 0.3, "num_updates": 2})
    assert (controller.beta, controller.num_updates, controller.last_kl) == (0.3, 2, None)
    trigger = SyncTrigger(kl_threshold=0.1)
    history = [3, 7]
    trigger.load_attributes({"sync_history": history, "num_syncs": 2})
    history.append(9)  # the caller's list stays the caller's
    assert (trigger.sync_history, trigger.num_syncs) == ([3, 7], 2)
    for rule, kind, known in ((controller, "KL-controller", "beta"), (trigger, "reference-sync", "num_syncs")):
        with pytest.raises(ValueError, match=f"Unknown {kind} state \\['bogus'\\]"):
            rule.load_attributes({"bogus": 1.0, known: 5})
    assert (controller.beta, trigger.num_syncs) == (0.3, 2)  # a refused state sets nothing
    # Both rules call the one function; neither module keeps a copy of it.
    import rpg_trl.kl_control as kl_control
    import rpg_trl.ref_sync.trigger as trigger_module

    assert kl_control.load_attributes is trigger_module.load_attributes is _kl_callback.load_attributes
    assert kl_control.check_beta_bounds is _kl_callback.check_beta_bounds

    # The bounds: [0.2, 0.1] is empty; β = 0.5 lies outside [0, 0.1]. Each caller names its own fields.
    with pytest.raises(ValueError, match=r"`kl_beta_min` \(0.2\) must be <= `kl_beta_max` \(0.1\)"):
        check_kl_control_arguments(0.1, 0.05, None, 0.2, 0.1, samples_per_step=8)
    with pytest.raises(ValueError, match=r"`beta_min` \(0.2\) must be <= `beta_max` \(0.1\)"):
        AdaptiveKLController(beta=0.1, target=0.05, beta_min=0.2, beta_max=0.1)
    with pytest.raises(ValueError, match=r"must lie within \[kl_beta_min, kl_beta_max\] = \[0, 0.1\]; got 0.5"):
        check_kl_control_arguments(0.5, 0.05, None, None, 0.1, samples_per_step=8)
    with pytest.raises(ValueError, match=r"\(the initial β\) must lie within \[beta_min, beta_max\] = \[0, 0.1\]"):
        AdaptiveKLController(beta=0.5, target=0.05, beta_max=0.1)
    _kl_callback.check_beta_bounds(0.1, None, None, ("a", "b"), "β")  # no bounds: any β passes
    _kl_callback.check_beta_bounds(0.1, 0.1, 0.1, ("a", "b"), "β")  # the bounds are inclusive


class _SpecOnlyTrainer:
    """What `AdaptiveKLCallback.from_trainer` and `bind` read of a trainer: its arguments and its loss specification."""

    def __init__(self, kl_level, spec_level):
        from types import SimpleNamespace

        from rpg_trl.losses import RPGLossSpec

        self.args = SimpleNamespace(
            beta=0.1, kl_target=0.05, kl_horizon=40.0, kl_beta_min=None, kl_beta_max=None, kl_level=kl_level
        )
        self.loss_spec = RPGLossSpec(beta=0.1, kl_level=spec_level)


def test_the_callback_takes_its_kl_level_from_the_loss_the_trainer_feeds_it():
    """One source for the controlled KL: the trainer feeds the callback `loss_spec.controlled_kl`, and the callback's
    level (recorded in its checkpointed arguments) is that specification's, not a copy of `args.kl_level`; binding it
    to a trainer whose loss controls the other level's KL is refused. The level names the metric independently:
    ``token`` → ``kl``/``num_tokens``, ``sequence`` → ``kl/sequence``/``num_sequences``."""
    for spec_level, metric, count in (("token", "kl", "num_tokens"), ("sequence", "kl/sequence", "num_sequences")):
        other = "token" if spec_level == "sequence" else "sequence"
        trainer = _SpecOnlyTrainer(kl_level=other, spec_level=spec_level)  # the arguments say the other level
        callback = AdaptiveKLCallback.from_trainer(trainer)
        assert callback.trainer is trainer and callback.level == spec_level
        assert (callback.controlled_kl.metric, callback.controlled_kl.count) == (metric, count)
        assert callback.controlled_kl == trainer.loss_spec.controlled_kl
        assert callback.state()["args"]["level"] == spec_level  # the checkpoint format: the level, by name
        mismatched = AdaptiveKLCallback(beta=0.1, target=0.05, horizon=40, level=other)
        with pytest.raises(ValueError, match=f"level='{other}'.*the trainer feeds '{metric}'"):
            mismatched.bind(trainer)
        assert mismatched.trainer is None
