"""The learning stage's command line and table (research/gpu/gpu_learn.py) for the sweep that chooses LoRA's learning
rate on the CPU (issue 60): the options and their errors, the sweep's arms and folders, and the greedy accuracy, its
falls and each run's peak KL and importance weight in learning.md / learning.json, from hand-made results."""

import json
from pathlib import Path

import pytest
from gpu_scripts import load_gpu_script


@pytest.fixture(scope="module")
def gpu_learn():
    return load_gpu_script("gpu_learn")


def test_defaults_are_the_gpu_runs(gpu_learn):
    args = gpu_learn.parse_args(["train", "W", "R"])
    assert args.modes == ["full", "lora"] and args.learning_rates == {"full": 6e-4, "lora": 1e-3}
    assert args.lora_rank == 16 and args.lora_learning_rates is None and args.seeds == [0, 1, 2, 3, 4, 5]
    assert gpu_learn.lora_config() == gpu_learn.LORA == {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    assert gpu_learn.lora_config(8) == {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def test_learning_rates_replace_the_named_modes_only(gpu_learn):
    args = gpu_learn.parse_args(["train", "W", "R", "--learning-rates", "lora=2e-3", "--lora-rank", "32"])
    assert args.learning_rates == {"full": 6e-4, "lora": 2e-3} and args.lora_rank == 32
    args = gpu_learn.parse_args(["train", "W", "R", "--learning-rates", "lora=2e-3,full=1e-4", "--modes", "lora"])
    assert args.learning_rates == {"full": 1e-4, "lora": 2e-3} and args.modes == ["lora"]
    assert gpu_learn.LEARNING_RATES == {"full": 6e-4, "lora": 1e-3}  # the defaults untouched


def test_the_sweep_is_lora_only(gpu_learn):
    args = gpu_learn.parse_args(["train", "W", "R", "--seeds", "10,11", "--lora-learning-rates", "1e-3, 2e-3,4e-3"])
    assert args.modes == ["lora"] and args.lora_learning_rates == [1e-3, 2e-3, 4e-3] and args.seeds == [10, 11]
    args = gpu_learn.parse_args(
        ["train", "W", "R", "--seeds", "10", "--modes", "lora", "--lora-learning-rates", "6e-3", "--learning-rates"]
        + ["full=1e-4"]
    )
    assert args.modes == ["lora"] and args.learning_rates["full"] == 1e-4


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--learning-rates", "qlora=1e-3"],
            "argument --learning-rates: 'qlora=1e-3': expected MODE=RATE with MODE one of full, lora",
        ),
        (["--learning-rates", "lora"], "'lora': expected MODE=RATE"),
        (["--learning-rates", "lora=fast"], "argument --learning-rates: 'fast' is not a learning rate"),
        (["--learning-rates", "lora=-1e-3"], "'-1e-3' is not a learning rate"),
        (["--learning-rates", "lora=1e-3,lora=2e-3"], "'lora' named twice"),
        (["--lora-rank", "0"], "argument --lora-rank: '0' is not a positive integer"),
        (["--lora-rank", "r16"], "argument --lora-rank: 'r16' is not a positive integer"),
        (["--modes", "full,qlora"], "argument --modes: qlora unknown; the modes are full, lora"),
        (["--seeds", "a,b"], "argument --seeds: 'a,b' is not a list of integers"),
        (["--seeds", "10", "--lora-learning-rates", "1e-3,nan"], "'nan' is not a learning rate"),
        (["--seeds", "10", "--lora-learning-rates", "1e-3,0.001"], "a learning rate named twice in '1e-3,0.001'"),
        (["--seeds", "10", "--lora-learning-rates", ","], "no learning rate given"),
        (["--seeds", "10", "--lora-learning-rates", "1e-3", "--modes", "full,lora"], "the sweep trains LoRA only"),
        (
            ["--seeds", "10", "--lora-learning-rates", "1e-3", "--learning-rates", "lora=1e-3"],
            "not with --learning-rates lora=",
        ),
        (
            ["--seeds", "2,10", "--lora-learning-rates", "1e-3"],
            "seed(s) [2] are the GPU run's final seeds (0,1,2,3,4,5)",
        ),
    ],
)
def test_bad_options_stop_naming_what_is_allowed(gpu_learn, capsys, options, message):
    with pytest.raises(SystemExit) as stopped:
        gpu_learn.parse_args(["train", "W", "R", *options])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def _warm_starts(tmp_path, seeds):
    for seed in seeds:
        folder = tmp_path / "warm" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "warm_start.json").write_text(json.dumps({"settings": {"seed": seed, "sft_steps": 1500}}))


def _specs(gpu_learn, tmp_path, options):
    args = gpu_learn.parse_args(["train", str(tmp_path / "warm"), str(tmp_path / "results"), *options])
    args.warm, args.results, args.device = args.folders[0], args.folders[1], "cpu"
    return [
        (spec, str(Path(folder).relative_to(tmp_path / "results" / "learn")))
        for spec, folder in gpu_learn._specs(args)
    ]


def test_the_sweeps_arms_and_folders(gpu_learn, tmp_path):
    """One arm per rate, RPG and GRPO each, every seed; the rank in the folder when it is not 16."""
    _warm_starts(tmp_path, [10, 11])
    jobs = _specs(gpu_learn, tmp_path, ["--seeds", "10,11", "--lora-learning-rates", "1e-3,2e-3", "--steps", "40"])
    assert [folder for _, folder in jobs] == [
        f"{arm}-lora-lr{rate}/seed{seed}"
        for rate in ("0.001", "0.002")
        for arm in ("RPG", "GRPO")
        for seed in (10, 11)
    ]
    assert {(s["mode"], s["lora_rank"], s["steps"], s["device"]) for s, _ in jobs} == {("lora", 16, 40, "cpu")}
    assert [s["learning_rate"] for s, _ in jobs] == [1e-3] * 4 + [2e-3] * 4
    jobs = _specs(gpu_learn, tmp_path, ["--seeds", "10", "--lora-learning-rates", "4e-3", "--lora-rank", "32"])
    assert [folder for _, folder in jobs] == ["RPG-lora-r32-lr0.004/seed10", "GRPO-lora-r32-lr0.004/seed10"]
    assert [(s["learning_rate"], s["lora_rank"]) for s, _ in jobs] == [(4e-3, 32)] * 2


def test_the_normal_call_keeps_its_folders_and_rates(gpu_learn, tmp_path):
    """The GPU run's call (research/gpu/gpu_run.sh, with --learn-modes lora,full): <arm>-<mode>, the modes in the order
    named (LoRA first), the six final seeds by default, the default rates; an override changes the rate, not the folder;
    a full fine-tuning run's spec names no rank (as before the option)."""
    _warm_starts(tmp_path, [0, 1, 2, 3, 4, 5])
    jobs = _specs(gpu_learn, tmp_path, ["--modes", "lora,full"])
    assert [folder for _, folder in jobs] == [
        f"{arm}-{mode}/seed{seed}" for mode in ("lora", "full") for arm in ("RPG", "GRPO") for seed in range(6)
    ]
    assert [(s["mode"], s["learning_rate"], s.get("lora_rank")) for s, _ in jobs[::6]] == [
        ("lora", 1e-3, 16),
        ("lora", 1e-3, 16),
        ("full", 6e-4, None),
        ("full", 6e-4, None),
    ]
    jobs = [job for job in jobs if job[0]["mode"] == "full"]
    assert sorted(jobs[0][0]) == sorted(
        ["arm", "mode", "seed", "sft_dir", "sft_steps", "device", "steps", "learning_rate", "eval_every"]
        + ["eval_problems", "eval_samples"]
    )
    jobs = _specs(gpu_learn, tmp_path, ["--modes", "lora", "--learning-rates", "lora=2e-3"])
    assert [folder for _, folder in jobs][:1] == ["RPG-lora/seed0"] and jobs[0][0]["learning_rate"] == 2e-3


def test_run_extremes_from_a_log_history(gpu_learn):
    history = [
        {"heldout/accuracy": 0.5, "heldout/greedy_accuracy": 0.6, "step": 0},
        {"kl": 0.1, "importance_weight/max": 1.5, "step": 1},
        {"kl": 4.8, "importance_weight/max": float("nan"), "step": 2},
        {"kl": float("nan"), "importance_weight/max": 33.0, "step": 3},
        {"heldout/accuracy": 0.55, "heldout/greedy_accuracy": 0.45, "step": 3},
        {"train_loss": 0.1, "step": 3},
    ]
    out = gpu_learn.run_extremes(history)
    assert out == pytest.approx(
        {
            "greedy_initial": 0.6,
            "greedy_last": 0.45,
            "greedy_gain": -0.15,
            "kl_peak": 4.8,
            "importance_weight_peak": 33.0,
        }
    )
    assert gpu_learn.run_extremes([{"loss": 1.0, "step": 1}]) == dict.fromkeys(out)


def _result(folder: Path, spec: dict, *, last: float, greedy: tuple | None, kl: float, iw: float | None, state=None):
    folder.mkdir(parents=True)
    curve = [{"step": 0, "accuracy": 0.3}, {"step": 4, "accuracy": last}]
    result = {"initial": 0.3, "last": last, "gain": last - 0.3, "seconds": 10.0, "accuracy_curve": curve}
    if greedy is not None:
        result |= {"greedy_initial": greedy[0], "greedy_last": greedy[1], "greedy_gain": greedy[1] - greedy[0]}
        result |= {"kl_peak": kl, "importance_weight_peak": iw}
    (folder / "result.json").write_text(json.dumps({"spec": spec, "result": result}))
    if state is not None:
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": state}))


def test_summary_reports_greedy_falls_and_peaks_per_rate(gpu_learn, tmp_path):
    """Rows per (mode, lr, rank, arm); greedy before / after / gain over the seeds and how many fell; each seed's peak
    KL and importance weight ("–" where GRPO logs none); Δ vs GRPO paired within the same rate. A result written
    before the greedy numbers (an earlier GPU run's) takes them from its trainer_state.json."""
    learn = tmp_path / "learn"
    base = {"mode": "lora", "steps": 4, "eval_problems": 400, "device": "cpu", "lora_rank": 16}
    # lr 0.002, rank 16: RPG's greedy 0.5 -> 0.6 (seed 10) and 0.5 -> 0.4 (seed 11): fell on 1 of 2.
    for arm, seed, last, greedy, kl, iw in [
        ("RPG", 10, 0.5, (0.5, 0.6), 0.01, 33.0),
        ("RPG", 11, 0.4, (0.5, 0.4), 0.02, 111.0),
        ("GRPO", 10, 0.4, (0.5, 0.5), 4.8, None),
        ("GRPO", 11, 0.4, (0.5, 0.3), 24.5, None),
    ]:
        spec = {**base, "arm": arm, "seed": seed, "learning_rate": 2e-3}
        _result(learn / f"{arm}-lora-lr0.002" / f"seed{seed}", spec, last=last, greedy=greedy, kl=kl, iw=iw)
    # lr 0.002 at rank 32: a row of its own, one seed.
    spec = {**base, "arm": "RPG", "seed": 10, "learning_rate": 2e-3, "lora_rank": 32}
    _result(learn / "RPG-lora-r32-lr0.002" / "seed10", spec, last=0.6, greedy=(0.5, 0.7), kl=0.5, iw=2.0)
    # The old layout (no lora_rank in the spec: rank 16), no greedy in result.json: from the trainer state.
    state = [
        {"heldout/accuracy": 0.3, "heldout/greedy_accuracy": 0.5, "step": 0},
        {"kl": 143.0, "step": 1},
        {"heldout/accuracy": 0.2, "heldout/greedy_accuracy": 0.25, "step": 4},
    ]
    spec = {k: v for k, v in base.items() if k != "lora_rank"} | {"arm": "GRPO", "seed": 0, "learning_rate": 6e-3}
    _result(learn / "GRPO-lora" / "seed0", spec, last=0.2, greedy=None, kl=0, iw=None, state=state)

    out = gpu_learn.summary(str(tmp_path))
    rows = {(r["learning_rate"], r["lora_rank"], r["arm"]): r for r in out["rows"]}
    assert list(rows) == [(2e-3, 16, "GRPO"), (2e-3, 16, "RPG"), (2e-3, 32, "RPG"), (6e-3, 16, "GRPO")]
    rpg = rows[(2e-3, 16, "RPG")]
    assert (rpg["greedy_initial"], rpg["greedy_last"], rpg["greedy_gain"]) == pytest.approx((0.5, 0.5, 0.0))
    # The gains +0.1 and -0.1: standard deviation 0.1414, standard error 0.1, t(1) 12.706.
    assert rpg["greedy_gain_half"] == pytest.approx(1.2706, abs=1e-4) and rpg["greedy_fell"] == 1
    assert rpg["kl_peak"] == {10: 0.01, 11: 0.02} and rpg["importance_weight_peak"] == {10: 33.0, 11: 111.0}
    assert rpg["vs_grpo"] == pytest.approx(0.05)  # (0.5 - 0.4 + 0.4 - 0.4) / 2, within lr 0.002 rank 16
    assert rows[(2e-3, 16, "GRPO")]["greedy_fell"] == 1  # 0.5 -> 0.5 does not fall, 0.5 -> 0.3 does
    assert "vs_grpo" not in rows[(2e-3, 32, "RPG")]  # no GRPO at rank 32
    old = rows[(6e-3, 16, "GRPO")]
    assert (old["greedy_initial"], old["greedy_last"], old["greedy_fell"]) == (0.5, 0.25, 1)
    assert old["kl_peak"] == {0: 143.0} and old["importance_weight_peak"] == {0: None}

    text = (tmp_path / "learning.md").read_text()
    assert "| lr | rank | steps | before | after | gain (points) | greedy before | greedy after | greedy gain " in text
    assert (
        "| lora | GRPO | 2 | 0.002 | 16 | 4 | 0.300 ± 0.000 | 0.400 ± 0.000 | +10.0 ± 0.0 | 0.500 ± 0.000 | "
        "0.400 ± 1.271 | -10.0 ± 127.1 | 1/2 | – | 4.8 / 24.5 | – / – | 10 |"
    ) in text
    assert (
        "| lora | RPG | 2 | 0.002 | 16 | 4 | 0.300 ± 0.000 | 0.450 ± 0.635 | +15.0 ± 63.5 | 0.500 ± 0.000 | "
        "0.500 ± 1.271 | +0.0 ± 127.1 | 1/2 | +5.0 ± 63.5 | 0.01 / 0.02 | 33 / 111 | 10 |"
    ) in text
    assert (
        "| lora | RPG | 1 | 0.002 | 32 | 4 | 0.300 | 0.600 | +30.0 | 0.500 | 0.700 | +20.0 | 0/1 | – | 0.5 | 2 |"
        in text
    )
    assert (
        "| lora | GRPO | 1 | 0.006 | 16 | 4 | 0.300 | 0.200 | -10.0 | 0.500 | 0.250 | -25.0 | 1/1 | – | 143 | – |"
        in text
    )
    stored = json.loads((tmp_path / "learning.json").read_text())
    assert [r["greedy_fell"] for r in stored["rows"]] == [1, 1, 0, 1]
    assert stored["rows"][1]["kl_peak"] == {"10": 0.01, "11": 0.02}


def test_a_run_without_greedy_numbers_leaves_its_columns_empty(gpu_learn, tmp_path):
    spec = {"arm": "RPG", "mode": "full", "seed": 0, "learning_rate": 6e-4, "steps": 4, "eval_problems": 16}
    _result(tmp_path / "learn" / "RPG-full" / "seed0", {**spec, "device": "cpu"}, last=0.4, greedy=None, kl=0, iw=None)
    gpu_learn.summary(str(tmp_path))
    text = (tmp_path / "learning.md").read_text()
    assert "| full | RPG | 1 | 0.0006 | – | 4 | 0.300 | 0.400 | +10.0 | – | – | – | – | – | – | – | 10 |" in text


@pytest.mark.slow
def test_a_tiny_sweep_on_cpu_records_greedy_accuracy(gpu_learn, tmp_path):
    """`train` end to end on CPU (in this process: one worker): the sweep at one rate, 2 steps, from a saved toy model
    standing in for the warm start; the greedy numbers and the peaks land in result.json and learning.md."""
    from rpg_research.toy.addition import build_model

    folder = tmp_path / "warm" / "seed10"
    model, tokenizer = build_model(10)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "warm_start.json").write_text(json.dumps({"settings": {"seed": 10, "sft_steps": 7}, "report": {}}))
    results = tmp_path / "results"
    gpu_learn.main(
        ["train", str(tmp_path / "warm"), str(results), "--seeds", "10", "--device", "cpu", "--modes", "lora"]
        + ["--lora-learning-rates", "2e-3", "--steps", "2", "--eval-every", "1", "--eval-problems", "8"]
        + ["--workers", "1"]
    )
    for arm in ("RPG", "GRPO"):
        stored = json.loads((results / "learn" / f"{arm}-lora-lr0.002" / "seed10" / "result.json").read_text())
        result = stored["result"]
        assert stored["spec"]["learning_rate"] == 2e-3 and stored["spec"]["lora_rank"] == 16
        assert 0 <= result["greedy_initial"] <= 1 and 0 <= result["greedy_last"] <= 1
        assert result["greedy_gain"] == pytest.approx(result["greedy_last"] - result["greedy_initial"])
        assert [p["step"] for p in result["accuracy_curve"]] == [0, 1, 2]
        assert all(0 <= p["greedy_accuracy"] <= 1 for p in result["accuracy_curve"])
        assert result["kl_peak"] is not None and result["kl_peak"] >= 0
        assert (result["importance_weight_peak"] is None) == (arm == "GRPO")
    text = (results / "learning.md").read_text()
    assert "| lora | GRPO | 1 | 0.002 | 16 | 2 |" in text and "| lora | RPG | 1 | 0.002 | 16 | 2 |" in text


# scipy.stats.nct's power of the two-sided one-sample t test at the 5 % level (computed once with scipy 1.17, which the
# project does not depend on), effect 4.125 points and spread 1.7812 (the CPU sweep's), seeds 2-8.
NCT_POWER = [0.2028, 0.5664, 0.8557, 0.9652, 0.9931, 0.9988, 0.9998]


def test_interval_power_is_the_noncentral_t_power(gpu_learn):
    """The integral gives scipy's noncentral-t power (to 1e-3: the interval uses a t table of 3 decimals), and at no
    effect the interval's own level: it excludes zero in 5 % of draws, whatever the seeds and the spread."""
    powers = [gpu_learn.interval_power(4.125, 1.7812, seeds) for seeds in range(2, 9)]
    assert powers == pytest.approx(NCT_POWER, abs=1e-3)
    for seeds, spread in ((2, 1.0), (5, 3.0), (12, 0.5)):
        assert gpu_learn.interval_power(0.0, spread, seeds) == pytest.approx(0.05, abs=2e-4)
    with pytest.raises(ValueError, match="2 seeds or more"):
        gpu_learn.interval_power(1.0, 1.0, 1)


def test_the_cpu_sweep_asks_for_six_seeds(gpu_learn):
    """From the committed CPU sweep (lr 1e-3, seeds 10 and 11): the greedy-accuracy changes read off its learning.json
    are the curves' last minus first greedy accuracy (0.8275 -> 0.8825 and 0.900 -> 0.9275 for GRPO, 0.8275 -> 0.880
    and 0.900 -> 0.930 for RPG, research/docs/benchmarks.md); their mean 4.125 points, the pooled spread
    sqrt(((5.5 - 2.75)^2 / 2 + (5.25 - 3.0)^2 / 2) / 2) = 1.78 with 2 degrees of freedom; at 1.4 times that spread,
    5 seeds give a power of 0.79 (scipy: 0.788) and 6 give 0.90: 6 seeds."""
    sweep = Path(__file__).resolve().parents[1] / "docs" / "results" / "lora_sweep_cpu_2026-11-27"
    changes = gpu_learn.sweep_greedy_changes(str(sweep), 1e-3)
    assert changes == {
        "GRPO": {10: pytest.approx(5.5), 11: pytest.approx(2.75)},
        "RPG": {10: pytest.approx(5.25), 11: pytest.approx(3.0)},
    }
    effect, spread, df = gpu_learn.pooled_spread(changes)
    assert effect == pytest.approx(4.125) and df == 2
    assert spread == pytest.approx(((2.75**2 / 2 + 2.25**2 / 2) / 2) ** 0.5)
    planning = gpu_learn.SEEDS_SPREAD_FACTOR * spread
    assert (
        gpu_learn.interval_power(effect, planning, 5)
        < gpu_learn.SEEDS_POWER
        < gpu_learn.interval_power(effect, planning, 6)
    )
    assert gpu_learn.seeds_needed(effect, planning) == 6 == len(gpu_learn.FINAL_SEEDS)
    report = gpu_learn.seeds_report(str(sweep), 1e-3)
    assert "seeds needed for power 0.8 at the planning spread: 6" in report
