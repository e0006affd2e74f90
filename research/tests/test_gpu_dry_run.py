"""CI's proof that the GPU suite still imports and runs: a few of `tests/test_gpu.py`'s tests in its CPU dry run
(`RPG_GPU_DRY_RUN=1`: the tiny Qwen3 of `rpg_research.toy` instead of the 0.5B model, same test functions), through pytest
in a subprocess. The whole dry run is `RPG_GPU_DRY_RUN=1 python -m pytest -q tests/test_gpu.py` (11 tests, 25-45 s on
2 CPU cores); on a GPU, `python -m pytest -q -m gpu tests/test_gpu.py` (see research/docs/benchmarks.md). Also the pure steps of
`research/gpu/gpu_run.sh`: which carried wheels it installs (research/gpu/gpu_wheels.py) and its checks and summary
(research/gpu/gpu_stages.py)."""

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from gpu_scripts import load_gpu_script


ROOT = Path(__file__).resolve().parents[2]
#: One divergence x estimator in bf16 with gradient checkpointing, and LoRA with the "ref" adapter sync.
SUBSET = "urkl-reinforce or lora_one_gpu"


@pytest.mark.slow
def test_gpu_suite_dry_run_on_cpu(tmp_path):
    report = tmp_path / "report.xml"
    env = {**os.environ, "RPG_GPU_DRY_RUN": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py", "-k", SUBSET]
    proc = subprocess.run(
        cmd + [f"--junitxml={report}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": 2, "failures": 0, "errors": 0, "skipped": 0}, counts
    names = sorted(case.get("name") for case in suite.iter("testcase"))
    assert names == [
        "test_bf16_every_variant_finite_with_gradient_checkpointing[urkl-reinforce]",
        "test_lora_one_gpu_with_ref_adapter_sync",
    ]


def _load_example(name):
    return load_gpu_script(name)


def _fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires] + ['Requires-Dist: pyarrow>=99; extra == "never"']
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_carried_datasets_is_chosen_by_the_installed_pyarrow(tmp_path):
    """research/gpu/gpu_run.sh installs the carried datasets whose pyarrow requirement the GPU image's pyarrow meets: the
    version CI tests, else the newest fallback tier (with the packages it pins), else it stops naming the versions."""
    gpu_wheels = _load_example("gpu_wheels")
    trl = _fake_wheel(tmp_path, "trl", "1.16.0", "datasets>=4.7.0")
    main = [trl, _fake_wheel(tmp_path, "datasets", "5.2.0", "pyarrow>=24.0.0", "fsspec<=2026.9.0")]
    main.append(_fake_wheel(tmp_path, "fsspec", "2026.9.0"))
    tier21 = [_fake_wheel(tmp_path / "fallback" / "pyarrow21", "datasets", "5.0.1", "pyarrow>=21.0.0")]
    tier21.append(_fake_wheel(tmp_path / "fallback" / "pyarrow21", "fsspec", "2026.6.0"))
    tier15 = [_fake_wheel(tmp_path / "fallback" / "pyarrow15", "datasets", "4.0.0", "pyarrow>=15.0.0")]
    assert gpu_wheels.choose(tmp_path, "26.0.1") == sorted(main)
    assert gpu_wheels.choose(tmp_path, "24.0.0") == sorted(main)
    assert gpu_wheels.choose(tmp_path, "23.0.1") == sorted([trl] + tier21)
    assert gpu_wheels.choose(tmp_path, "18.1.0") == sorted([trl, main[2]] + tier15)
    with pytest.raises(SystemExit, match=r"pyarrow 14.0.2 is installed here, and no carried datasets accepts it"):
        gpu_wheels.choose(tmp_path, "14.0.2")


def test_carried_pins_fail_rather_than_fall_back_to_a_bare_name():
    gpu_wheels = _load_example("gpu_wheels")
    assert gpu_wheels.pins(["pytest"]) == [f"pytest=={pytest.__version__}"]
    with pytest.raises(SystemExit, match=r"\['no-such-package-rpg'\] not installed"):
        gpu_wheels.pins(["pytest", "no-such-package-rpg"])


def _step_log(step, **extra):
    log = {"loss": 0.01 * step, "kl": 1e-3, "clip_ratio/dual_mean": 0.0, "importance_weight/max": 1.1, "entropy": 4.6}
    return repr({**log, **extra, "epoch": 0.1 * step})


def _write_run(work: Path, folder: str, losses: dict, generation: dict) -> None:
    """checkpoint-20/trainer_state.json of an e2e run: its steps' logs at full precision."""
    history = [{"step": step, "loss": loss, **generation.get(step, {})} for step, loss in sorted(losses.items())]
    (work / folder / "checkpoint-20").mkdir(parents=True, exist_ok=True)
    (work / folder / "checkpoint-20" / "trainer_state.json").write_text(
        json.dumps({"global_step": 20, "log_history": history})
    )


def _write_batches(results: Path, name: str, steps, changed: int | None = None) -> None:
    lines = [
        json.dumps({"step": s, "process": 0, "tokens": f"t{s}" + ("x" if s == changed else ""), "advantages": f"a{s}"})
        for s in steps
    ]
    (results / f"e2e_{name}_batches.jsonl").write_text("\n".join(lines) + "\n")


def test_e2e_check_reads_both_runs_and_judges_the_resume(tmp_path):
    """The e2e stage's check: 20 logged steps and 10 resumed, every RPG metric finite, the reward every other step,
    what the checkpoints take on disk, and the resume's verdict (gpu_stages.RELATIVE's rule): the same batches and
    generation metrics at steps 11-20, the losses within float32's rounding on CPU and, on the GPU, within the
    repeat's spread."""
    gpu_stages = _load_example("gpu_stages")
    results, work = tmp_path / "results", tmp_path / "work"
    results.mkdir()
    steps = [_step_log(i, **({"reward": 0.5} if i % 2 else {})) for i in range(1, 21)]
    (results / "e2e_train.log").write_text("noise\n" + "\n".join(steps) + "\n{'train_runtime': 1.0}\n")
    (results / "e2e_resume.log").write_text("\n".join(steps[10:]) + "\n")
    (work / "e2e" / "checkpoint-10").mkdir(parents=True)
    (work / "e2e" / "checkpoint-10" / "rpg_generation_state.pt").write_bytes(b"x" * 10)
    (work / "e2e_resumed").mkdir(parents=True)
    (work / "e2e_resumed" / "model.safetensors").write_bytes(b"x" * 100)
    losses = {s: 1e-4 * (s % 3) for s in range(1, 21)}
    generation = {s: {"num_tokens": 100.0 * s, "completions/mean_length": 9.5, "reward": 0.5} for s in range(1, 21, 2)}
    _write_run(work, "e2e", losses, generation)
    _write_run(work, "e2e_resumed", losses, generation)
    for name in ("run", "resumed"):
        _write_batches(results, name, range(1 if name == "run" else 11, 21))
    summary = gpu_stages.e2e_check(str(results), str(work), precision="float32")
    assert (summary["steps"], summary["resumed_steps"], summary["max_abs_loss_difference_after_resume"]) == (20, 10, 0)
    assert summary["rewards"] == [0.5] * 10 and summary["checkpoint_bytes"] > 10 + 100
    assert "max_abs_loss_difference_between_two_runs" not in summary  # no repeated run: no yardstick
    verdict = summary["resume_verdict"]
    assert verdict["passed"] and verdict["same_batches"] and verdict["same_generation_metrics"]
    assert "e2e resume verdict (float32): passed" in gpu_stages.summary(str(results))
    # Another batch at step 13: the verdict fails the check, and e2e_summary.json says why.
    _write_batches(results, "resumed", range(11, 21), changed=13)
    with pytest.raises(AssertionError, match=r"same batches False \(other at steps \[13\]\)"):
        gpu_stages.e2e_check(str(results), str(work), precision="float32")
    assert json.loads((results / "e2e_summary.json").read_text())["resume_verdict"]["passed"] is False
    _write_batches(results, "resumed", range(11, 21))
    # A loss off by more than float32's rounding fails on CPU; on the GPU, within the repeat's spread, it passes.
    _write_run(work, "e2e_resumed", {**losses, 14: losses[14] + 1e-6}, generation)
    with pytest.raises(AssertionError, match="losses"):
        gpu_stages.e2e_check(str(results), str(work), precision="float32")
    repeat = [_step_log(i, **({"reward": 0.5} if i % 2 else {})) for i in range(1, 13)]
    repeat += [
        _step_log(i, **({"reward": 0.5} if i % 2 else {})).replace(
            f"'loss': {0.01 * i}", f"'loss': {0.01 * i + 0.001 * (i % 4)}"
        )
        for i in range(13, 21)
    ]
    (results / "e2e_repeat.log").write_text("\n".join(repeat) + "\n")
    _write_run(work, "e2e_repeat", {**losses, 17: losses[17] + 3e-6}, generation)
    _write_batches(results, "repeat", range(1, 21))
    summary = gpu_stages.e2e_check(str(results), str(work), precision="bf16")
    assert summary["first_step_two_runs_differ"] == 13
    assert summary["max_abs_loss_difference_between_two_runs"] == pytest.approx(3e-6)
    assert summary["resume_verdict"]["yardstick"] == pytest.approx(3e-6)
    assert summary["resume_verdict"]["passed"] and summary["resume_verdict"]["repeat_first_step_other_batches"] is None
    assert "(between two uninterrupted runs: 3e-06)" in gpu_stages.summary(str(results))
    # On the GPU the noise may reach the samples: where the repeat's own batches first differ at step 15, the resumed
    # steps from 15 on need not match; step 13 still must.
    _write_batches(results, "repeat", range(1, 21), changed=15)
    _write_batches(results, "resumed", range(11, 21), changed=17)
    verdict = gpu_stages.e2e_check(str(results), str(work), precision="bf16")["resume_verdict"]
    assert verdict["passed"] and verdict["steps_compared_exactly"] == [11, 12, 13, 14]
    _write_batches(results, "resumed", range(11, 21), changed=13)
    with pytest.raises(AssertionError, match=r"other at steps \[13\]"):
        gpu_stages.e2e_check(str(results), str(work), precision="bf16")
    _write_batches(results, "resumed", range(11, 21))
    _write_batches(results, "repeat", range(1, 21))
    # Beyond it (and beyond bf16's relative rounding of a loss of 2e-4): fails.
    _write_run(work, "e2e_resumed", {**losses, 14: losses[14] + 1e-5}, generation)
    with pytest.raises(AssertionError, match="losses"):
        gpu_stages.e2e_check(str(results), str(work), precision="bf16")
    # The same batches but another logged reward at a generation step: fails.
    _write_run(work, "e2e_resumed", losses, {**generation, 15: {**generation[15], "reward": 0.25}})
    with pytest.raises(AssertionError, match=r"reward at step 15"):
        gpu_stages.e2e_check(str(results), str(work), precision="bf16")
    _write_run(work, "e2e_resumed", losses, generation)
    (results / "e2e_resume.log").write_text("\n".join(steps[10:-1] + [steps[-1].replace("'kl': 0.001", "'kl': nan")]))
    with pytest.raises(AssertionError, match="kl"):
        gpu_stages.e2e_check(str(results), str(work))


def test_per_test_times_survive_a_cut_and_name_the_unfinished(pytester, monkeypatch, tmp_path):
    """research/gpu/pytest_times.py: one JSON line per test as it ends (pytest's JUnit XML is written at its end only,
    which a stage killed at its deadline never reaches); the tests check and summary.md read them when there is no
    XML and name the tests that had not finished."""
    gpu_stages = _load_example("gpu_stages")
    monkeypatch.syspath_prepend(str(ROOT / "research" / "gpu"))
    times = tmp_path / "pytest_gpu_times.jsonl"
    monkeypatch.setenv("RPG_TEST_TIMES", str(times))
    monkeypatch.delenv("RPG_STAGE_DEADLINE", raising=False)
    pytester.makepyfile(
        test_three="""
        import pytest
        def test_a(): pass
        def test_b(): pytest.skip("not here")
        def test_c(): pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "pytest_times", "-p", "no:cacheprovider", "-p", "no:benchmark")
    result.assert_outcomes(passed=2, skipped=1)
    lines = [json.loads(line) for line in times.read_text().splitlines()]
    assert lines[0] == {"collected": ["test_three.py::test_a", "test_three.py::test_b", "test_three.py::test_c"]}
    assert [(r["nodeid"].split("::")[1], r["outcome"]) for r in lines[1:]] == [
        ("test_a", "passed"),
        ("test_b", "skipped"),
        ("test_c", "passed"),
    ]
    assert all(r["duration"] >= 0 and r["setup"] >= 0 for r in lines[1:])
    counts = gpu_stages.pytest_check(str(tmp_path / "absent.xml"), True, str(times))
    assert (counts["tests"], counts["skipped"], counts["unfinished"]) == (3, 1, [])
    # Killed in test_c: its line never came (and a half-written line is skipped).
    times.write_text("\n".join(json.dumps(r) for r in lines[:3]) + '\n{"nodeid": "test_thr')
    with pytest.raises(AssertionError, match=r"1 tests did not finish: \['test_three.py::test_c'\]"):
        gpu_stages.pytest_check(str(tmp_path / "absent.xml"), True, str(times))
    times.rename(tmp_path / "results_times")
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "results_times").rename(results / "pytest_gpu_times.jsonl")
    text = gpu_stages.summary(str(results))
    assert "| test_three.py::test_b | skipped |" in text and "| test_three.py::test_c | not finished | | |" in text


def test_each_tests_limit_stays_inside_the_stages_deadline(pytester, monkeypatch):
    """research/gpu/pytest_times.py cuts pytest-timeout's per-test limit (here a stand-in plugin named `timeout` with
    its --timeout) to the seconds left before RPG_STAGE_DEADLINE less its margin, and leaves a smaller one alone."""
    monkeypatch.syspath_prepend(str(ROOT / "research" / "gpu"))
    monkeypatch.delenv("RPG_TEST_TIMES", raising=False)
    monkeypatch.setenv("RPG_STAGE_DEADLINE", str(time.time() + 40))
    pytester.syspathinsert()
    pytester.makepyfile(
        timeout="""
        def pytest_addoption(parser):
            parser.addoption("--timeout", type=float, default=None)
        def pytest_configure(config):
            config.addinivalue_line("markers", "timeout(seconds): the test's limit")
        """,
        test_limit="""
        def test_limit(request):
            marker = request.node.get_closest_marker("timeout")
            print("LIMIT", marker.args[0] if marker else request.config.getoption("timeout"))
        """,
    )
    for given, low, high in [(150, 25, 30), (5, 5, 5)]:
        result = pytester.runpytest_inprocess(
            "-p",
            "timeout",
            "-p",
            "pytest_times",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:benchmark",
            "-s",
            "--timeout",
            str(given),
        )
        result.assert_outcomes(passed=1)
        limit = float(result.stdout.str().split("LIMIT ")[1].split()[0])
        assert low <= limit <= high, (given, limit)


@pytest.mark.slow
def test_stage_groups_are_checked_before_anything_runs():
    """research/gpu/gpu_run.sh's --stages: a bench stage times, so it runs alone; a stage given twice is refused."""
    for stages, message in [
        ("learn+bench-1k", "bench-1k times steps: it runs alone, not in a group (learn+bench-1k)"),
        ("learn+tests+e2e,tests", "stage tests given twice"),
        ("learn+test", "unknown stage test"),
    ]:
        proc = subprocess.run(
            ["bash", "research/gpu/gpu_run.sh", "--dry-run", "--stages", stages],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and message in proc.stderr, (stages, proc.stderr)


def test_summary_and_pytest_check_from_a_results_folder(tmp_path):
    """summary.md from whatever a (cut short) results folder holds; a skipped GPU test fails the tests stage."""
    gpu_stages = _load_example("gpu_stages")
    (tmp_path / "stages.tsv").write_text("setup\t0\t20\t45\ne2e\t124\t135\t135\n")
    run = {"step_time_s": 0.25, "tokens_per_s": 32768.0, "peak_memory_bytes": 2**30}
    report = {
        "settings": {"completion_length": 1024, "lora": True, "loss_batch": 64, "loss_length": 4096},
        "runs": {"grpo-ref": run, "rpg-sampling": run},
        "ratios": {
            "(a) RPG sampling anchor vs GRPO beta>0": {
                "step_time": 0.8,
                "peak_memory": 0.9,
                "peak_memory_saved_bytes": 2**20,
            }
        },
        "loss_only": {"rpg_loss_s": 0.004, "grpo_loss_s": 0.005, "ratio": 0.8},
    }
    (tmp_path / "bench_speed_lora_1024.json").write_text(json.dumps(report))
    text = gpu_stages.summary(str(tmp_path))
    assert "| e2e | 124 | 135 | 135 |" in text and "| 1024 | LoRA | grpo-ref | 0.2500 | 32768 | 1024.0 |" in text
    assert "| 1024 | LoRA | (a) RPG sampling anchor vs GRPO beta>0 | 0.800 | 0.900 | 1.0 |" in text
    assert "(c) loss alone (1024 tokens, LoRA), B=64, T=4096: RPG 4.00 ms, GRPO 5.00 ms, ratio 0.800" in text
    xml = tmp_path / "pytest.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1"/></testsuites>')
    assert gpu_stages.pytest_check(str(xml), dry_run=True)["skipped"] == 1
    with pytest.raises(AssertionError, match="1 GPU tests skipped"):
        gpu_stages.pytest_check(str(xml), dry_run=False)


def test_learning_summary_pairs_rpg_with_grpo_by_seed(tmp_path):
    """The learning stage's table (research/gpu/gpu_learn.py): before and after per arm and mode over the seeds, RPG's
    paired difference to GRPO, from whatever runs finished; summary.md carries it."""
    gpu_learn, gpu_stages = _load_example("gpu_learn"), _load_example("gpu_stages")
    for arm, mode, seed, last in [("GRPO", "full", 0, 0.5), ("GRPO", "full", 1, 0.6), ("RPG", "full", 0, 0.6)]:
        folder = tmp_path / "learn" / f"{arm}-{mode}" / f"seed{seed}"
        folder.mkdir(parents=True)
        spec = {"arm": arm, "mode": mode, "seed": seed, "learning_rate": 6e-4, "steps": 200, "eval_problems": 400}
        curve = [{"step": 0, "accuracy": 0.3}, {"step": 200, "accuracy": last}]
        result = {"initial": 0.3, "last": last, "gain": last - 0.3, "seconds": 60.0, "accuracy_curve": curve}
        (folder / "result.json").write_text(json.dumps({"spec": {**spec, "device": "cuda"}, "result": result}))
    out = gpu_learn.summary(str(tmp_path))
    rpg = next(row for row in out["rows"] if row["arm"] == "RPG")
    assert rpg["seeds"] == [0] and rpg["vs_grpo"] == pytest.approx(0.1)  # paired on seed 0 only
    text = (tmp_path / "learning.md").read_text()
    assert text.startswith("Learning on cuda: held-out accuracy (mean@4, temperature 1, 400 two-digit additions")
    # No greedy numbers nor peaks in these results (research/tests/test_gpu_learn.py has them): "–".
    assert (
        "| full | GRPO | 2 | 0.0006 | – | 200 | 0.300 ± 0.000 | 0.550 ± 0.635 | +25.0 ± 63.5 | – | – | – | – | – |"
        in text
    )
    assert "| full | RPG | 1 | 0.0006 | – | 200 | 0.300 | 0.600 | +30.0 | – | – | – | – | +10.0 | – | – | 60 |" in text
    assert "| full | RPG | 1 |" in gpu_stages.summary(str(tmp_path))


def test_learning_runs_start_from_the_warm_start_their_spec_names(tmp_path):
    """Each learning run's spec (research/gpu/gpu_learn.py) carries what `warm_started` reads, its warm start's
    `sft_steps` from that warm start's ``warm_start.json`` (a carried one may differ from the command's defaults): the
    GPU run's learning stage failed on a missing key once. A saved toy model stands in for the trained warm start."""
    import argparse

    from rpg_research.cli.runs import warm_started
    from rpg_research.toy.addition import build_model, make_splits

    gpu_learn = _load_example("gpu_learn")
    folder = tmp_path / "warm" / "seed3"
    model, tokenizer = build_model(3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "warm_start.json").write_text(json.dumps({"settings": {"seed": 3, "sft_steps": 7}, "report": {}}))
    args = argparse.Namespace(
        warm=str(tmp_path / "warm"),
        seeds=[3],
        modes=["lora"],
        device="cpu",
        steps=2,
        eval_every=1,
        eval_problems=16,
        results=str(tmp_path / "results"),
    )
    jobs = gpu_learn._specs(args)
    assert [(spec["arm"], spec["mode"], spec["sft_steps"]) for spec, _ in jobs] == [
        ("RPG", "lora", 7),
        ("GRPO", "lora", 7),
    ]
    splits, loaded, _, heldout = warm_started(jobs[0][0])
    assert splits.eval == make_splits(3, num_eval=16).eval  # the held-out problems of seed 3
    assert heldout.curve == [] and loaded.num_parameters() == model.num_parameters()


def test_summary_says_what_each_bench_timed_and_its_targets(tmp_path):
    """Each bench-speed figure in summary.md comes with what was timed, its range over the repeats, the noise band
    and the targets; a command that skipped the loss alone (--loss-repeats 0) says nothing of (c)."""
    gpu_stages = _load_example("gpu_stages")
    run = {"step_time_s": 0.3, "step_time_min_s": 0.29, "step_time_max_s": 0.31, "tokens_per_s": 27000.0}
    from rpg_research.cli.bench_speed_report import PHASES

    run |= {"peak_memory_bytes": 2**30, "breakdown_s": dict.fromkeys(PHASES, 0.3 / len(PHASES))}
    report = {
        "settings": {"completion_length": 1024, "lora": False, "loss_batch": 64, "loss_length": 4096},
        "conditions": "Timed: optimizer steps on fixed synthetic completions (generation not timed, no vLLM), ...",
        "runs": {"grpo-ref": run},
        "ratios": {
            "(A/A) GRPO vs GRPO, the same run": {
                "step_time": 1.01,
                "step_time_min": 0.99,
                "step_time_max": 1.02,
                "peak_memory": 1.0,
                "peak_memory_saved_bytes": 0,
            }
        },
        "noise_band": 0.02,
        "targets": {"(b)": {"value": 1.01, "band": 0.02, "rule": "within the band", "met": True}},
        "loss_only": None,
    }
    (tmp_path / "bench_speed_full_1024.json").write_text(json.dumps(report))
    text = gpu_stages.summary(str(tmp_path))
    assert "- 1024 tokens, full: Timed: optimizer steps on fixed synthetic completions (generation not timed" in text
    assert "| 1024 | full | grpo-ref | 0.3000 [0.2900-0.3100] | 27000 | 1024.0 |" in text
    assert "| 1024 | full | (A/A) GRPO vs GRPO, the same run | 1.010 [0.990-1.020] | 1.000 | 0.0 |" in text
    assert "1024 tokens, full: noise band (A/A) 1.00 ± 0.020" in text
    assert "- target (b): ratio 1.010, band ± 0.020; rule: within the band: met" in text
    assert "(c) loss alone" not in text
