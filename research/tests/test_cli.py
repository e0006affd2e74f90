# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tests of the `rpg-trl` command line: subcommand registry, `plot` and `bench-algos --quick`, each output option
written and read back (`demo --output-dir`: research/tests/test_demo.py; `bench-speed --output-json`: research/tests/test_bench_speed.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rpg_research import cli
from rpg_research.cli import bench_algos, bench_kl, plot, runs
from rpg_research.toy import build_char_tokenizer, build_tiny_qwen3, curves, no_activation_checkpointing
from rpg_trl import RPGConfig, RPGTrainer


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------------


def _commands(parser):
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def test_parser_registers_every_subcommand():
    assert {"demo", "plot", "bench-algos"} <= _commands(cli.build_parser())


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 1
    assert "demo" in capsys.readouterr().out


def test_optional_subcommand_absent_or_broken_is_skipped(monkeypatch, tmp_path, capsys):
    (tmp_path / "rpg_broken_cmd.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPTIONAL_SUBCOMMAND_MODULES", ("rpg_trl.no_such_module", "rpg_broken_cmd"))
    commands = _commands(cli.build_parser())
    assert {"demo", "plot", "bench-algos"} <= commands
    err = capsys.readouterr().err
    assert "rpg_broken_cmd" in err and "boom" in err
    assert "no_such_module" not in err  # absent: silently not offered


def test_optional_subcommand_module_registers_itself(monkeypatch, tmp_path, capsys):
    (tmp_path / "rpg_hello_cmd.py").write_text(
        textwrap.dedent(
            """
            def add_parser(subparsers):
                parser = subparsers.add_parser("hello", help="say hello")
                parser.add_argument("--name", default="world")
                return parser

            def run(args):
                print(f"hello {args.name}")
                return 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPTIONAL_SUBCOMMAND_MODULES", ("rpg_hello_cmd",))
    assert cli.main(["hello", "--name", "rpg"]) == 3
    assert capsys.readouterr().out == "hello rpg\n"


def test_subcommand_returning_a_result_object_exits_with_zero(monkeypatch, tmp_path):
    (tmp_path / "rpg_dict_cmd.py").write_text(
        "def add_parser(subparsers):\n    return subparsers.add_parser('results')\n\n"
        "def run(args):\n    return {'step_time': 1.0}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPTIONAL_SUBCOMMAND_MODULES", ("rpg_dict_cmd",))
    assert cli.main(["results"]) == 0


def test_options_from_a_yaml_config_file(tmp_path):
    config = tmp_path / "demo.yaml"
    config.write_text("steps: 7\nseed: 5\n")
    args = cli.build_parser().parse_args_and_config(["demo", "--config", str(config), "--seed", "6"])[0]
    # `sft_steps` is left unset: `DemoArguments` gives it the task's default (research/tests/test_long_addition.py).
    assert (args.command, args.steps, args.seed, args.sft_steps) == ("demo", 7, 6, None)


@pytest.mark.slow
def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "rpg_research.cli", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "demo" in result.stdout and "plot" in result.stdout and "bench-algos" in result.stdout


# ----------------------------------------------------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------------------------------------------------


def _reward_len(completions, **kwargs):
    return [float(len(c)) / 4.0 for c in completions]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Two 2-step runs on a tiny model: RPGTrainer (state saved in output_dir) and GRPOTrainer (in checkpoint-2/)."""
    root = tmp_path_factory.mktemp("runs")
    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_list([{"prompt": f"{a}+{a}="} for a in range(10, 26)])
    common = {
        "max_steps": 2,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 4,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "use_cpu": True,
        "bf16": False,
        **no_activation_checkpointing(),
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    rpg_dir, grpo_dir = root / "rpg-reinforce-urkl", root / "grpo"
    trainer = RPGTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=_reward_len,
        processing_class=tokenizer,
        train_dataset=dataset,
        args=RPGConfig(output_dir=str(rpg_dir), save_strategy="no", steps_per_generation=2, **common),
    )
    trainer.train()
    trainer.save_state()
    trainer = GRPOTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=_reward_len,
        processing_class=tokenizer,
        train_dataset=dataset,
        args=GRPOConfig(output_dir=str(grpo_dir), save_strategy="steps", save_steps=2, **common),
    )
    trainer.train()
    assert not (grpo_dir / "trainer_state.json").exists()
    assert (grpo_dir / "checkpoint-2" / "trainer_state.json").exists()
    return str(rpg_dir), str(grpo_dir)


def test_find_trainer_state_prefers_output_dir_then_latest_checkpoint(tmp_path):
    for step in (5, 40, 300):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert curves.find_trainer_state(str(tmp_path)).endswith(os.path.join("checkpoint-300", "trainer_state.json"))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert curves.find_trainer_state(str(tmp_path)) == str(tmp_path / "trainer_state.json")


def test_plot_overlays_rpg_and_grpo_runs(tiny_runs, tmp_path, capsys):
    output = tmp_path / "figs" / "curves.png"
    assert cli.main(["plot", *tiny_runs, "-o", str(output), "--title", "test"]) == 0
    png = output.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    assert "2 runs" in capsys.readouterr().out
    for run_dir in tiny_runs:
        steps, values = curves.metric_series(curves.load_log_history(run_dir), "reward")
        assert steps and all(isinstance(v, float) for v in values)


@pytest.mark.parametrize("suffix, signature", [(".svg", b"<?xml"), (".pdf", b"%PDF-")])
def test_plot_output_format_follows_the_suffix(tiny_runs, tmp_path, suffix, signature):
    output = tmp_path / f"curves{suffix}"
    assert cli.main(["plot", *tiny_runs, "--output", str(output)]) == 0
    assert output.read_bytes().startswith(signature)


def test_plot_names_must_match_runs(tiny_runs, tmp_path):
    with pytest.raises(ValueError, match="one entry per run: got 1 names for 2 runs"):
        plot.plot_runs(list(tiny_runs), str(tmp_path / "x.png"), names=["only-one"])


def test_plot_without_trainer_state_fails_clearly(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    status = cli.main(["plot", str(tmp_path / "empty"), "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert status == 2
    assert "trainer_state.json" in err and str(tmp_path / "empty") in err
    assert cli.main(["plot", str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_smoothing_and_names():
    assert curves.smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    # EMA with bias correction: 1; (0.5*0.5 + 0.5*3) / (1 - 0.25) = 7/3
    assert curves.smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 7.0 / 3.0])
    with pytest.raises(ValueError, match="got 1.0"):
        curves.smooth([1.0], 1.0)
    assert plot.run_names(["/a/x/run", "/b/y/run", "/c/other"]) == ["x/run", "y/run", "c/other"]
    assert plot.run_names(["/a/grpo", "/a/rpg/"]) == ["grpo", "rpg"]


# ----------------------------------------------------------------------------------------------------------------------
# bench-algos
# ----------------------------------------------------------------------------------------------------------------------


def test_drawdown_and_moving_average():
    assert curves.max_drawdown([0.1, 0.5, 0.2, 0.4, 0.1, 0.9]) == pytest.approx(0.4)
    assert curves.max_drawdown([0.1, 0.2, 0.3]) == 0.0
    assert curves.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_bench_arguments_presets_and_errors(monkeypatch):
    args = bench_algos.BenchAlgosArguments(quick=True, steps=5)
    assert args.steps == 5 and args.sft_steps == 40 and args.sft_extra_rounds == 0
    full = bench_algos.BenchAlgosArguments()
    # The protocol: both regimes, a grid spanning at least 8x, selection seeds apart from 5 consecutive final seeds.
    assert full.regimes == [16, 4] and full.steps == 128
    assert len(full.learning_rates) >= 4 and max(full.learning_rates) / min(full.learning_rates) >= 8
    assert full.final_seeds == [1000, 1001, 1002, 1003, 1004] and full.selection_seeds == [100, 101]
    assert len(full.algorithms) == 8 and "RPG sequence" not in full.algorithms
    # The fourth protocol (long completions): its own presets, fixed in research/docs/bench_algos.md.
    long = bench_algos.BenchAlgosArguments(task="long_addition")
    assert long.algorithms == ["GRPO", "DAPO", "RPG default", "RPG sequence", "REINFORCE++-Baseline"]
    assert (long.steps, long.regimes, long.learning_rates) == (32, [16], [1e-4, 3e-4, 1e-3])
    assert long.final_seeds == [4000, 4001, 4002, 4003, 4004] and long.eval_problems == 200 and long.diagnostics
    assert bench_algos.algorithm_config("RPG sequence") == {
        "trainer": "rpg",
        "kl_clip_mode": "truncated",
        "kl_level": "sequence",
    }
    with pytest.raises(ValueError, match="`model_size` must be one of \\['small'\\] with `task='addition'`"):
        bench_algos.BenchAlgosArguments(model_size="large")
    with pytest.raises(ValueError, match="`task` must be one of"):
        bench_algos.BenchAlgosArguments(task="multiplication")
    with pytest.raises(ValueError, match="`device` must be one of"):
        bench_algos.BenchAlgosArguments(device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="`device` is 'cuda' but torch .* finds no CUDA GPU here; use `--device cpu`"):
        bench_algos.BenchAlgosArguments(device="cuda")
    assert bench_algos.BenchAlgosArguments(final_seed_start=7, num_final_seeds=3).final_seeds == [7, 8, 9]
    with pytest.raises(ValueError, match="Unknown algorithm.*'PPO'"):
        bench_algos.BenchAlgosArguments(algorithms=["PPO"])
    with pytest.raises(ValueError, match="must be fresh: \\[100, 101\\]"):
        bench_algos.BenchAlgosArguments(final_seed_start=99, num_final_seeds=3)
    with pytest.raises(ValueError, match="sweep seeds \\[1000, 2000\\] must be fresh: \\[1000\\]"):
        bench_algos.BenchAlgosArguments(sweep_seeds=[1000, 2000])
    with pytest.raises(ValueError, match="`sweep_betas` must list positive"):
        bench_algos.BenchAlgosArguments(sweep_betas=[0.1, 0.0])
    with pytest.raises(ValueError, match="`regimes` must list integers >= 1"):
        bench_algos.BenchAlgosArguments(regimes=[0])
    with pytest.raises(ValueError, match="`learning_rates` must list positive"):
        bench_algos.BenchAlgosArguments(learning_rates=[1e-3, -1e-3])
    with pytest.raises(ValueError, match="`kl_betas` must list positive"):
        bench_algos.BenchAlgosArguments(kl_betas=[0.0])
    assert bench_algos.BenchAlgosArguments(kl_arms=["TRL k3 (corrected)"]).kl_arms == ["TRL k3 (corrected)"]
    with pytest.raises(ValueError, match="Unknown KL arm"):
        bench_algos.BenchAlgosArguments(kl_arms=["KL"])
    with pytest.raises(ValueError, match="Unknown table"):
        bench_algos.BenchAlgosArguments(tables=["speed"])


def test_a_long_task_run_trains_on_its_rows_and_records_them(tmp_path):
    """One run of the fourth protocol's comparison (``--task long_addition``), in this process and tiny: an untrained
    warm start (0 steps), 2 optimizer steps of 64 completions of up to 110 tokens, the sequence level."""
    from rpg_research.cli.runs import run_spec
    from rpg_research.toy.long_addition import MAX_COMPLETION_LENGTH

    args = bench_algos.BenchAlgosArguments(
        task="long_addition", quick=True, sft_steps=0, steps=2, eval_every=2, eval_problems=2, eval_samples=1
    )
    seed = args.final_seeds[0]
    warm = str(tmp_path / "warm")
    bench_algos.warm_start_job(
        {"task": args.task, "seed": seed, "sft_steps": 0, "sft_extra_rounds": 0, "eval_problems": 2}, warm
    )
    spec = run_spec(
        args,
        {seed: warm},
        seed,
        config=bench_algos.algorithm_config("RPG sequence"),
        algorithm="RPG sequence",
        regime=2,
        learning_rate=1e-3,
        diagnostics=True,
    )
    result = bench_algos.algorithm_job(spec, str(tmp_path / "run"))
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    # 64 completions per step (8 prompts x 8 samples) of at most the task's 110 tokens.
    assert len(steps) == 2 and state["train_batch_size"] == 64
    assert 0 < steps[0]["completions/max_length"] <= MAX_COMPLETION_LENGTH
    assert 0.0 <= result["last"] <= 1.0
    positions = result["positions"]
    groups = ["row 1", "row 2", "row 3", "row 4", "answer line and end"]
    assert list(positions) == groups[: len(positions)] and "row 1" in positions
    # The second step is off-policy (2 steps per generation): the weights spread, and s_t is a factor in (0, 1].
    assert positions["row 1"]["steps"] == 2
    for row in positions.values():
        assert row["log_w_min"] <= 0.0 <= row["log_w_max"]
        assert 0.0 < row["s_p05"] <= row["s_p50"] <= row["s_p95"] <= 1.0


@pytest.mark.slow
def test_bench_algos_quick(tmp_path, capsys):
    output_dir = tmp_path / "bench"
    assert cli.main(["bench-algos", "--quick", "--output-dir", str(output_dir)]) == 0
    out = capsys.readouterr().out
    table = (output_dir / "table.md").read_text()
    assert table in out
    report = json.loads((output_dir / "results.json").read_text())
    args = bench_algos.BenchAlgosArguments(quick=True)
    # Selection: every (method, rate) on the selection seed; one chosen rate per method, from the grid.
    selection = report["algorithms"]["selection"]
    assert len(selection) == len(args.algorithms) * len(args.learning_rates)
    assert {c["learning_rate"] for c in report["algorithms"]["chosen_learning_rates"]} <= set(args.learning_rates)
    runs = report["algorithms"]["runs"]
    assert sorted((r["algorithm"], r["seed"]) for r in runs) == sorted(
        (a, s) for a in args.algorithms for s in args.final_seeds
    )
    for run in runs:
        assert 0.0 <= run["last"] <= 1.0 and run["max_reward_drop"] >= 0.0
        assert (output_dir / "algorithms" / "spg16" / run["algorithm"]).is_dir()
        assert os.path.isfile(os.path.join(run["run_dir"], "trainer_state.json"))
    for name in args.algorithms:
        assert f"| {name} |" in table
    # The paired difference to GRPO, recomputed from the runs.
    row = next(r for r in report["algorithms"]["table"]["16"] if r["algorithm"] == "RPG-REINFORCE-URKL")
    by_seed = {(r["algorithm"], r["seed"]): r["last"] for r in runs}
    diffs = [by_seed[("RPG-REINFORCE-URKL", s)] - by_seed[("GRPO", s)] for s in args.final_seeds]
    assert row["last_vs_baseline"] == pytest.approx(sum(diffs) / len(diffs))
    # The KL table: the arms on the final seeds, at the chosen beta (0 without KL), with the proxy scored.
    kl = report["kl"]
    assert kl["chosen_beta"] in args.kl_betas
    assert sorted((r["arm"], r["beta"]) for r in kl["runs"]) == sorted(
        [("no KL", 0.0)] * 2 + [("RPG-URKL, token, exact", kl["chosen_beta"])] * 2
    )
    assert all(r["proxy_last"] >= 0.0 and r["length_end"] > 0 and r["kl_to_warm_start"] >= 0 for r in kl["runs"])
    # Every run is keyed by its resolved configuration: the RPG arm's KL clip mode, "no KL"'s β = 0.
    assert {r["arm"]: r["config"].get("kl_clip_mode") for r in kl["runs"]} == {
        "no KL": None,
        "RPG-URKL, token, exact": "exact",
    }
    # The robustness sweep: its three arms at each (β, learning rate) on the sweep seed.
    sweep = report["kl_sweep"]
    assert sorted((r["arm"], r["beta"], r["learning_rate"]) for r in sweep["runs"]) == sorted(
        (arm, 0.1, 2e-3) for arm in bench_kl.KL_SWEEP_ARMS
    )
    assert {r["seed"] for r in sweep["runs"]} == set(args.sweep_seeds)
    assert "KL robustness sweep" in table
    # The logged metrics per generation batch (8 steps: one batch of 16), the KL estimate 0 without a regulariser.
    assert set(kl["dynamics"]) == {"no KL", "RPG-URKL, token, exact"}
    exact_kl = kl["dynamics"]["RPG-URKL, token, exact"]["kl"]
    assert len(exact_kl) == 1 and exact_kl[0] > 0
    assert "largest importance weight" in table
    for name in ("bench_algos.png", "bench_kl.png"):
        png = (output_dir / name).read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    # A second invocation reads every run back from its folder instead of training it again.
    capsys.readouterr()
    assert cli.main(["bench-algos", "--quick", "--output-dir", str(output_dir), "--num-workers", "1"]) == 0
    assert json.loads((output_dir / "results.json").read_text())["algorithms"]["runs"] == runs


def test_a_run_is_keyed_by_everything_that_defines_it(tmp_path):
    # The cache key of a run (rpg_research.cli.runs.run_spec): the arm's resolved configuration, the warm start's
    # settings, and the library versions with a digest of rpg_trl's own source, so that another setting, another arm
    # configuration or changed code never reads a stale result.
    from rpg_research.cli.protocol import cached_result
    from rpg_trl.losses import DEFAULT_KL_CLIP_MODE

    args = bench_algos.BenchAlgosArguments(quick=True, output_dir=str(tmp_path))
    config = bench_kl.kl_arm_config("RPG-URKL, token, default")
    assert config == {
        "trainer": "rpg",
        "divergence": "urkl",
        "kl_level": "token",
        "kl_clip_mode": DEFAULT_KL_CLIP_MODE,
    }
    assert bench_kl.kl_arm_config("TRL k3 (corrected)") == {"trainer": "grpo", "use_bias_correction_kl": True}
    spec = runs.run_spec(args, {3: str(tmp_path / "warm")}, 3, config=config, arm="a", beta=0.2, learning_rate=1e-3)
    assert spec["sft_steps"] == args.sft_steps and spec["sft_extra_rounds"] == args.sft_extra_rounds
    assert set(spec["versions"]) >= {"rpg_trl", "rpg_trl_source", "torch", "transformers", "trl", "python"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"spec": spec, "result": {"last": 0.5}}))
    assert cached_result(run_dir, spec) == {"last": 0.5}
    for changed in (
        {"config": {**config, "kl_clip_mode": "clipped"}},
        {"sft_steps": args.sft_steps + 1},
        {"versions": {**spec["versions"], "rpg_trl_source": "0" * 16}},
    ):
        assert cached_result(run_dir, {**spec, **changed}) is None
