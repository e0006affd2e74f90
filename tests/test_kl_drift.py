"""Tests of `rpg_trl.reliability.kl_drift`: one warning when the KL to a reference model stops holding the policy."""

import warnings

import pytest

from rpg_trl.reliability.kl_drift import KLDriftMonitor, KLDriftWarning


SETTINGS = {"kl_clip_mode": "clipped", "beta": 0.2, "learning_rate": 2e-3, "steps_per_generation": 4}


def feed(monitor, per_batch, steps_per_generation=4, first_step=1):
    """Log each generation batch's values on each of its optimizer steps; return the steps at which it warned."""
    warned = []
    step = first_step
    for values in per_batch:
        for _ in range(steps_per_generation):
            if monitor.observe(values, step):
                warned.append(step)
            step += 1
    return warned


def test_rising_kl_with_falling_entropy_warns_once_naming_the_settings():
    # The first KL table's RPG-URKL per token, generation by generation: KL 0.04, 0.26, 0.72, 1.5, 3.7 and entropy
    # 0.51, 0.46, 0.45, 0.31, 0.20. Leaving out the first batch, the KL at least doubles twice in a row by batch 4
    # (0.26 -> 0.72 -> 1.5): known when batch 5 starts.
    batches = [
        {"kl": 0.04, "entropy": 0.51, "importance_weight/max": 4.0},
        {"kl": 0.26, "entropy": 0.46, "importance_weight/max": 22.7},
        {"kl": 0.72, "entropy": 0.45, "importance_weight/max": 38.1},
        {"kl": 1.5, "entropy": 0.31, "importance_weight/max": 35.0},
        {"kl": 3.7, "entropy": 0.20, "importance_weight/max": 12.9},
        {"kl": 6.6, "entropy": 0.12, "importance_weight/max": 152.0},
    ]
    monitor = KLDriftMonitor(16, clip_c=10.0, settings=SETTINGS, kl_can_push_away=True)
    with pytest.warns(KLDriftWarning) as record:
        warned = feed(monitor, batches, steps_per_generation=16)
    assert warned == [65]  # the first step of batch 5: batches 1-4 are finished
    assert len(record) == 1
    message = str(record[0].message)
    for expected in (
        "went 0.26, 0.72, 1.5",
        "kl_clip_mode='clipped' can push tokens away",
        "kl_clip_mode='truncated'",
        "learning_rate (now 0.002)",
        "beta (now 0.2)",
    ):
        assert expected in message


def test_a_kl_that_holds_or_oscillates_does_not_warn():
    # The first KL table's RPG-UFKL over whole completions: the KL rises then levels off at 0.09-0.14, entropy falls
    # slowly; and GRPO's k3, whose estimate jumps up and down. Neither is three rises in a row with falling entropy,
    # and no weight goes beyond 10·c.
    holding = [(0.025, 0.504), (0.061, 0.453), (0.088, 0.441), (0.0925, 0.431), (0.0894, 0.424), (0.141, 0.407)]
    oscillating = [(0.11, 0.51), (11.2, 0.50), (0.38, 0.507), (0.25, 0.499), (3.5, 0.494), (0.107, 0.481)]
    for series in (holding, oscillating):
        monitor = KLDriftMonitor(16, clip_c=10.0, settings=SETTINGS)
        batches = [{"kl": kl, "entropy": h, "importance_weight/max": 6.0} for kl, h in series]
        with warnings.catch_warnings():
            warnings.simplefilter("error", KLDriftWarning)
            assert feed(monitor, batches, steps_per_generation=16) == []
        assert [b["kl"] for b in monitor.batches] == pytest.approx([kl for kl, _ in series[:-1]])


def test_weights_far_beyond_c_twice_with_a_doubling_kl_warn():
    # The KL never doubles from one period to the next (×1.5, ×1.67) but doubles over two (0.12 -> 0.30), while the
    # largest weight is 150 > 10·c = 100 in batches 2 and 3.
    batches = [
        {"kl": 0.10, "entropy": 0.5, "importance_weight/max": 5.0},
        {"kl": 0.12, "entropy": 0.5, "importance_weight/max": 5.0},
        {"kl": 0.18, "entropy": 0.5, "importance_weight/max": 150.0},
        {"kl": 0.30, "entropy": 0.5, "importance_weight/max": 150.0},
        {"kl": 0.35, "entropy": 0.5, "importance_weight/max": 3.0},
    ]
    monitor = KLDriftMonitor(8, clip_c=10.0, settings={**SETTINGS, "kl_clip_mode": "exact"})
    with pytest.warns(KLDriftWarning, match="reached 150, beyond 10 × clip_c = 100, twice in a row") as record:
        assert feed(monitor, batches, steps_per_generation=8) == [33]  # batch 4 (0-based 3) done
    assert "kl_clip_mode=" not in str(record[0].message)  # only a KL weight that can push away gets that advice
    # One spike, or weights that high while the KL falls, are no signature.
    for series in (
        [dict(b, **{"importance_weight/max": 5.0 if i != 3 else 150.0}) for i, b in enumerate(batches)],
        [dict(b, kl=1.0 / (i + 1)) for i, b in enumerate(batches)],
    ):
        monitor = KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KLDriftWarning)
            assert feed(monitor, series, steps_per_generation=8) == []


def no_warning(monitor, batches, steps_per_generation=16):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLDriftWarning)
        return feed(monitor, batches, steps_per_generation=steps_per_generation)


def test_a_small_kl_that_grows_does_not_warn_below_the_floor():
    # A healthy KL to a reference at a small β: 3.5e-5 -> 2.2e-4 over four generation batches, doubling twice in a row
    # (7e-5 -> 1.5e-4 -> ... ): the old rule warned at step 33. Below the floor (0.01 nats per token) it is no drift; with
    # the floor at 0 the same series warns, so the floor is what keeps it quiet.
    series = [3.5e-5, 7e-5, 1.5e-4, 2.2e-4 * 1.5, 2.2e-4 * 3.0, 2.2e-4 * 6.0]
    batches = [{"kl": kl, "entropy": 0.5, "importance_weight/max": 3.0} for kl in series]
    assert no_warning(KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS), batches, 8) == []
    with pytest.warns(KLDriftWarning):
        assert feed(KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS, min_kl=0.0), batches, steps_per_generation=8)


def test_the_saw_tooth_of_reference_syncs_does_not_warn():
    # ref_model_sync_kl_threshold syncs the reference when the KL reaches it: the KL restarts near 0 and climbs again,
    # 0.002 -> 0.03 -> 0.07 -> sync -> 0.002 -> ... Across a sync the climb looks like two doublings in a row; the
    # logged `ref/syncs` count starts the watch again, so it never warns. Without the count the same KL warns.
    tooth = [0.002, 0.03, 0.07]
    batches, syncs = [], 0
    for _ in range(4):
        for i, kl in enumerate(tooth):
            batches.append({"kl": kl, "entropy": 0.5, "importance_weight/max": 4.0, "ref/syncs": float(syncs)})
        syncs += 1
    monitor = KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS)
    assert no_warning(monitor, batches, 8) == []
    assert monitor.resets == [25, 49, 73]  # the first step of each batch after a sync
    with pytest.warns(KLDriftWarning):
        blind = [{key: v for key, v in b.items() if key != "ref/syncs"} for b in batches]
        assert feed(KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS), blind, steps_per_generation=8)


def test_a_flat_kl_with_large_importance_weights_does_not_warn():
    # A KL that holds (0.050, 0.051, 0.052, ...: rising, but by 1-2 %) while single tokens reach weights of 150 > 10·c
    # in every period: large weights alone are no drift.
    batches = [{"kl": 0.05 + 0.001 * i, "entropy": 0.5, "importance_weight/max": 150.0} for i in range(8)]
    assert no_warning(KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS), batches, 8) == []


def test_short_generation_batches_are_grouped_into_periods_of_at_least_eight_steps():
    # One optimizer step per generation batch: three rising steps in a row are noise, not a trend. The periods span 8
    # steps, and the values of a period are averaged.
    monitor = KLDriftMonitor(1, clip_c=10.0, settings=SETTINGS)
    assert monitor.steps_per_generation == 8 and KLDriftMonitor(3, clip_c=10.0).steps_per_generation == 9
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLDriftWarning)
        rising_steps = [{"kl": 0.1 * 2**i, "entropy": 1.0 - 0.01 * i} for i in range(4)]
        assert feed(monitor, rising_steps, steps_per_generation=1) == []
    assert monitor.batches == []  # still inside the first period


def test_the_trainer_watches_only_a_kl_to_a_reference(tiny_model_dir, tmp_path):
    from helpers.tiny_runs import make_trainer

    sampling = make_trainer(tiny_model_dir, tmp_path / "s", beta=0.1)
    assert sampling.kl_drift_monitor is None  # the KL to π_old restarts at 0 with every generation batch
    reference = make_trainer(
        tiny_model_dir, tmp_path / "r", beta=0.1, kl_anchor="reference", steps_per_generation=4, learning_rate=1e-3
    )
    monitor = reference.kl_drift_monitor
    assert monitor is not None and monitor.clip_c == reference.args.clip_c and monitor.min_kl == 0.01
    assert monitor.settings["kl_clip_mode"] == "truncated" and monitor.settings["learning_rate"] == 1e-3
    # The trainer's log hands the monitor the interval's metrics (means of kl and entropy, the largest weight).
    reference.model.train()
    reference._metrics["train"].update({"kl": [0.1, 0.3], "entropy": [0.5, 0.7], "importance_weight/max": [2.0, 9.0]})
    reference.state.global_step = 1
    reference.log({})
    reference.state.global_step = 9  # the next period (2 generation batches of 4 optimizer steps): period 1 is done
    reference._metrics["train"].update({"kl": [1.0], "entropy": [0.4], "importance_weight/max": [3.0]})
    reference.log({})
    assert monitor.batches == [{"kl": pytest.approx(0.2), "entropy": pytest.approx(0.6), "weight_max": 9.0}]

    # A reference sync, logged by the sync callback as `ref/syncs`, starts the watch again.
    reference.state.global_step = 17
    reference._metrics["train"].update({"kl": [0.5], "ref/syncs": [0.0]})
    reference.log({})
    reference.state.global_step = 18
    reference._metrics["train"].update({"kl": [0.01], "ref/syncs": [1.0]})
    reference.log({})
    assert monitor.resets == [18] and monitor.batches == []


def test_the_check_can_be_switched_off_and_its_floor_set(tiny_model_dir, tmp_path):
    from helpers.tiny_runs import make_trainer

    off = make_trainer(tiny_model_dir, tmp_path / "off", beta=0.1, kl_anchor="reference", kl_drift_warning=False)
    assert off.kl_drift_monitor is None
    floor = make_trainer(tiny_model_dir, tmp_path / "floor", beta=0.1, kl_anchor="reference", kl_drift_min_kl=0.5)
    assert floor.kl_drift_monitor.min_kl == 0.5
    # Bad values are refused at construction (tests/test_config.py::INVALID_CONFIGS).


def test_the_last_period_is_evaluated_when_training_ends():
    # KL 0.04, 0.26, 0.6, 1.5 per period: the second doubling is in the last period, which no later step closes.
    batches = [{"kl": kl, "entropy": 0.5} for kl in (0.04, 0.26, 0.6, 1.5)]
    monitor = KLDriftMonitor(8, clip_c=10.0, settings=SETTINGS)
    warnings.simplefilter("error", KLDriftWarning)
    assert feed(monitor, batches, steps_per_generation=8) == []
    assert len(monitor.batches) == 3
    with pytest.warns(KLDriftWarning, match="went 0.26, 0.6, 1.5"):
        assert monitor.finish()
    assert not monitor.finish()  # nothing more to evaluate, and it warns once


def test_the_trainer_evaluates_the_last_period_when_train_returns(tiny_model_dir, tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from helpers.tiny_runs import make_trainer

    trainer = make_trainer(tiny_model_dir, tmp_path, beta=0.1, kl_anchor="reference", steps_per_generation=8)

    def training(self, *args, **kwargs):  # GRPOTrainer's training loop, as the monitor sees it: one log per step
        self.model.train()
        for step in range(1, 33):
            self._metrics["train"]["kl"] = [(0.04, 0.26, 0.6, 1.5)[(step - 1) // 8]]
            self.state.global_step = step
            self.log({})
        assert not self.kl_drift_monitor.warned  # the last period is still open
        return "the output of train()"

    monkeypatch.setattr(GRPOTrainer, "train", training)
    with pytest.warns(KLDriftWarning, match="went 0.26, 0.6, 1.5"):
        assert trainer.train() == "the output of train()"


@pytest.mark.filterwarnings("ignore::rpg_trl.losses.KLSignWarning")
@pytest.mark.parametrize(
    "overrides, pushes_away",
    [
        # With a reference model, Algorithm 1's clipped KL weight w̄·log(w̄/r) can have the sign opposite to the exact
        # one (r ≠ 1): the advice to change kl_clip_mode is given.
        (dict(kl_clip_mode="clipped"), True),
        # fkl's KL weight −r holds no importance weight: clipping leaves it exact, so there is nothing to advise.
        (dict(kl_clip_mode="clipped", divergence="fkl"), False),
        # Without RPG-Style Clip every mode is the exact weight.
        (dict(kl_clip_mode="clipped", rpg_clip=False), False),
        (dict(kl_clip_mode="truncated"), False),
        (dict(kl_clip_mode="exact"), False),
    ],
)
def test_the_trainer_tells_the_monitor_whether_the_kl_weight_can_push_away(
    tiny_model_dir, tmp_path, overrides, pushes_away
):
    from helpers.tiny_runs import make_trainer

    trainer = make_trainer(tiny_model_dir, tmp_path, beta=0.1, kl_anchor="reference", **overrides)
    assert trainer.kl_drift_monitor.kl_can_push_away is pushes_away
