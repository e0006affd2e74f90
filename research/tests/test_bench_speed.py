"""`rpg-trl bench-speed --quick` runs end to end, reports consistent numbers and writes them with `--output-json`; its
report (`rpg_research.cli.bench_speed_report`): the ratios, their intervals, the noise band and the targets; the order
of the runs (a Williams design), the weights' dtype, and the JSON of a command cut short."""

import argparse
import json
import math
import subprocess
import sys
from collections import Counter

import pytest

from rpg_research import cli
from rpg_research.cli import bench_speed
from rpg_research.cli.bench_speed import (
    PHASES,
    _PhaseTimer,
    add_arguments,
    plan,
    run_orders,
    settings,
    williams_design,
)
from rpg_research.toy import make_fixed_rollout


def test_fixed_rollout_is_deterministic_and_varies_within_a_group():
    from rpg_research.toy import build_char_tokenizer

    class FakeTrainer:
        processing_class = build_char_tokenizer()

    rollout = make_fixed_rollout(5, 2, 10, seed=3)
    first = rollout(["1+1=", "1+1=", "2+2="], FakeTrainer())
    again = rollout(["2+2=", "1+1=", "1+1="], FakeTrainer())
    assert first["completion_ids"][0] != first["completion_ids"][1]  # two samples of one prompt differ
    assert again["completion_ids"][1:] == first["completion_ids"][:2]  # same prompt, same k-th sample
    assert again["completion_ids"][0] == first["completion_ids"][2]
    assert all(len(c) == 5 and all(2 <= t < 10 for t in c) for c in first["completion_ids"])


def test_both_entry_points_record_the_same_settings():
    """`rpg-trl bench-speed` and `python -m rpg_research.cli.bench_speed` parse to different namespaces (the former carries the
    subcommand and its function, which `json.dumps` refused, losing the measurements); the report records the same
    options from both."""
    argv = ["--quick", "--device", "cpu", "--steps", "3", "--output-json", "out.json"]
    from_cli = cli.build_parser().parse_args_and_config(["bench-speed", *argv])[0]
    module_parser = argparse.ArgumentParser()
    add_arguments(module_parser)
    from_module = module_parser.parse_args(argv)
    assert settings(from_cli) == settings(from_module) == vars(from_module)
    assert settings(from_cli)["steps"] == 3 and settings(from_cli)["output_json"] == "out.json"
    json.dumps(settings(from_cli))


@pytest.mark.slow
def test_bench_speed_quick_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rpg_research.cli",
            "bench-speed",
            "--quick",
            "--device",
            "cpu",
            "--vocab-size",
            "500",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(a) RPG sampling anchor vs GRPO beta>0" in proc.stdout
    report = json.loads(out.read_text())
    # The effective settings (--quick's sizes), the runs, the comparisons and the loss-only timing.
    assert report["settings"]["quick"] and report["settings"]["output_json"] == str(out)
    assert (report["settings"]["repeats"], report["settings"]["hidden_size"]) == (1, 64)
    assert set(report["ratios"]) == {
        "(A/A) GRPO vs GRPO, the same run",
        "(a) RPG sampling anchor vs GRPO beta>0",
        "(b) RPG reference model vs GRPO beta>0",
        "(d) RPG exact per-position KL vs sampled KL",
        "(d') RPG exact per-position KL vs GRPO beta>0",
    }
    # What was timed travels with the figures; one repeat gives no noise band, so (b) cannot be judged.
    assert (
        "generation not timed, no vLLM), random weights loaded in float32, vocabulary 500, full fine-tuning"
        in report["conditions"]
    )
    assert report["conditions"] in proc.stdout and report["noise_band"] is None
    assert set(report["targets"]) == {"(a) time", "(a) memory", "(b)", "(d)", "(c)"}
    assert "target (d): mean step-time ratio" in proc.stdout
    assert report["targets"]["(b)"]["met"] is None and "target (c): ratio" in proc.stdout
    runs = report["runs"]
    assert list(runs) == ["grpo-ref", "grpo-ref-2", "rpg-sampling", "rpg-reference", "rpg-vocabulary"]
    assert all(run["vocab_size"] == 500 for run in runs.values())
    # Every step's time is saved (warm-up included), per run and repeat.
    assert [len(steps) for steps in report["per_repeat"]["grpo-ref"]] == [4]
    assert report["per_repeat_breakdown_s"]["grpo-ref"] == [runs["grpo-ref"]["breakdown_s"]]  # one repeat: its own
    assert report["orders"] == [["grpo-ref", "grpo-ref-2", "rpg-sampling", "rpg-reference", "rpg-vocabulary"]]
    assert report["processes"] == {"finished": 1, "planned": 1}
    assert all(run["parameter_dtypes"] == ["float32"] for run in runs.values())
    # One repeat: no interval anywhere, and (b) says so.
    assert all(r["step_time_half_width"] is None for r in report["ratios"].values())
    assert report["targets"]["(b)"]["verdict"] == "not measurable (one repeat)"
    assert runs["grpo-ref"]["has_ref_model"] and runs["rpg-reference"]["has_ref_model"]
    assert not runs["rpg-sampling"]["has_ref_model"]
    # The sampling anchor holds exactly one model's weights; GRPO with beta > 0 holds two.
    assert runs["rpg-sampling"]["weights_in_memory_bytes"] == runs["grpo-ref"]["model_weight_bytes"]
    assert runs["grpo-ref"]["weights_in_memory_bytes"] == 2 * runs["grpo-ref"]["model_weight_bytes"]
    for run in runs.values():
        assert run["step_time_s"] > 0 and run["peak_memory_bytes"] > 0
        # Where the step's time goes: the phases add up to the step, and each one that every run has takes time.
        phases = run["breakdown_s"]
        assert list(phases) == list(PHASES)
        assert sum(phases.values()) == pytest.approx(run["step_time_s"], rel=1e-9)
        assert phases["rest of the step"] >= 0
        for phase in ("scoring: policy log-probs", "scoring: rollout, rewards, rest", "forward and loss", "backward"):
            assert phases[phase] > 0, phase
        assert phases["optimizer step"] > 0
    # Only the runs with a reference model spend time on its log-probs.
    assert runs["rpg-sampling"]["breakdown_s"]["scoring: reference log-probs"] == 0
    assert runs["grpo-ref"]["breakdown_s"]["scoring: reference log-probs"] > 0
    assert runs["rpg-reference"]["breakdown_s"]["scoring: reference log-probs"] > 0
    assert (
        "| where a step's time goes (ms per step) | grpo-ref | grpo-ref-2 | rpg-sampling | rpg-reference | "
        "rpg-vocabulary |" in proc.stdout
    )
    # The loss alone runs in training mode, timed by torch.utils.benchmark.
    assert report["loss_only"]["ratio"] > 0 and report["loss_only"]["model_training"] is True
    assert report["loss_only"]["timer"] == "torch.utils.benchmark.Timer"
    # Where and when: the device, the versions and the date travel with the numbers.
    import torch

    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["device_name"]
    assert report["environment"]["date_utc"][:4].isdigit() and report["environment"]["cuda"] is None


def test_phase_timer_tells_the_reference_pass_of_a_peft_model(tmp_path):
    """With LoRA, TRL scores the reference with the same model, its adapter disabled (or the "ref" adapter set)."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import use_adapter

    from rpg_research.toy import build_char_tokenizer
    from rpg_research.toy.models import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m", build_char_tokenizer()))
    model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    trainer = SimpleNamespace(ref_model=None, accelerator=Accelerator(cpu=True))
    timer = _PhaseTimer.__new__(_PhaseTimer)
    timer.trainer = trainer
    assert not timer._is_reference(model)
    with use_adapter(model, adapter_name=None):
        assert timer._is_reference(model)
    model.add_adapter("ref", LoraConfig(r=2, target_modules="all-linear"))
    with use_adapter(model, adapter_name="ref"):
        assert timer._is_reference(model)
    assert not timer._is_reference(model)
    other = object()
    trainer.ref_model = other
    assert timer._is_reference(other) and not timer._is_reference(model)


def test_repeats_rotate_the_order_and_share_a_process_on_cuda():
    """Repeat r runs the scenarios rotated by r, so that none is always first: in one process per repeat (CUDA, where
    the peak memory statistics reset between runs), or one per run (CPU, where the peak RSS cannot be reset)."""
    assert plan(["a", "b", "c"], 3, one_process_per_run=False) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert plan(["a", "b"], 3, one_process_per_run=True) == [["a"], ["b"], ["b"], ["a"], ["a"], ["b"]]


def _result(step, reference_pass=0.0, peak=300, scenario=None):
    """A worker's result for one run, the fields the report reads."""
    breakdown = dict.fromkeys(PHASES, 0.0) | {"scoring: reference log-probs": reference_pass}
    return {
        "scenario": scenario,
        "step_time_s": step,
        "step_times_s": [step, step],
        "tokens_per_s": 1 / step,
        "peak_memory_bytes": peak,
        "model_weight_bytes": 100,
        "weights_in_memory_bytes": 200,
        "has_ref_model": True,
        "vocab_size": 10,
        "resident_before_bytes": None,
        "breakdown_s": breakdown,
    }


def _t_interval(values, t):
    """Mean and half-width of the 95 % Student-t interval, by the textbook formula with the quantile `t` given."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t * sd / math.sqrt(n)


def test_targets_and_the_noise_band_from_per_repeat_times():
    """(a) the time saved against GRPO's own reference pass, (b) by the ratio's interval, (c) the paired rounds' mean
    ratio against 1.00 (the ratio of the medians for a report without it)."""
    from rpg_research.cli.bench_speed_report import ratios, summarize, targets

    run = _result
    runs = {
        "grpo-ref": [run(1.00, 0.10, 300), run(1.00, 0.10, 300), run(1.00, 0.10, 300)],
        "grpo-ref-2": [run(1.02, 0.10, 300), run(0.99, 0.10, 300), run(1.00, 0.10, 300)],
        "rpg-sampling": [run(0.905, 0.0, 200), run(0.90, 0.0, 200), run(0.91, 0.0, 200)],
        "rpg-reference": [run(1.01, 0.10, 300), run(1.00, 0.10, 300), run(1.03, 0.10, 300)],
    }
    out = ratios(runs)
    aa = out["(A/A) GRPO vs GRPO, the same run"]
    assert aa["step_time"] == pytest.approx(1.00) and aa["band"] == pytest.approx(0.02)
    summary = {name: summarize(results) for name, results in runs.items()}
    loss = {"ratio": 1.04, "ratio_mean": 0.99, "ratio_half_width": 0.02, "model_training": True}
    result = targets(summary, runs, out, aa["band"], loss, lora=False)
    assert result["(a) time"]["value"] == pytest.approx(0.95) and result["(a) time"]["met"]  # 95 ms of 100 ms
    assert result["(a) memory"]["met"] and result["(a) memory"]["saved_bytes"] == 100
    assert targets(summary, runs, out, aa["band"], loss, lora=False, cuda=False)["(a) memory"]["met"] is None  # RSS
    # (b): ratios 1.01, 1.00, 1.03: mean 1.01333, sd 0.01528, t(2) = 4.303: ± 0.0380, [0.975, 1.051] holds 1.
    assert result["(b)"]["value"] == pytest.approx(1.013333, abs=1e-6)
    assert result["(b)"]["half_width"] == pytest.approx(0.037949, abs=1e-6)
    assert result["(b)"]["median"] == pytest.approx(1.01) and result["(b)"]["met"]
    assert result["(c)"]["met"] and result["(c)"]["interval"] == pytest.approx([0.97, 1.01])
    lora = targets(summary, runs, out, None, {"ratio": 0.98, "ratio_mean": 1.01, "model_training": True}, lora=True)
    assert lora["(c)"]["value"] == 1.01  # the paired mean, not the ratio of the medians
    assert lora["(a) memory"]["met"] is None and lora["(c)"]["met"] is False


def test_williams_design_puts_each_run_at_each_position_and_after_each_other_once():
    """n = 4: four orders, each run once at each position, each ordered pair of neighbours once (12 = 4 x 3 pairs);
    n = 3 (odd): six orders, each position twice, each ordered pair twice."""
    for n, orders, times in [(4, 4, 1), (3, 6, 2), (6, 6, 1), (5, 10, 2)]:
        design = williams_design(n)
        assert len(design) == orders
        assert all(sorted(order) == list(range(n)) for order in design)
        for position in range(n):
            assert Counter(order[position] for order in design) == dict.fromkeys(range(n), times)
        pairs = Counter((order[i], order[i + 1]) for order in design for i in range(n - 1))
        assert pairs == {(a, b): times for a in range(n) for b in range(n) if a != b}


def test_run_orders_balanced_when_the_repeats_are_a_multiple_of_the_runs():
    names = ["grpo-ref", "grpo-ref-2", "rpg-sampling", "rpg-reference"]
    orders, words = run_orders(names, 8)
    assert orders[:4] == orders[4:] and "Williams design" in words
    assert orders[0] == ["grpo-ref", "grpo-ref-2", "rpg-reference", "rpg-sampling"]  # 0, 1, n-1, 2
    assert Counter(order[0] for order in orders) == dict.fromkeys(names, 2)
    # 3 repeats of 4 runs: the rotation, and the words say it is unbalanced and who ran first how often.
    orders, words = run_orders(names, 3)
    assert orders == [names, names[1:] + names[:1], names[2:] + names[:2]]
    assert "unbalanced" in words and "rpg-sampling 1, rpg-reference 0" in words
    # On CPU each run of a repeat has its own process, in the repeat's order.
    first = ["grpo-ref", "grpo-ref-2", "rpg-reference", "rpg-sampling"]
    assert plan(names, 4, one_process_per_run=True)[:4] == [[name] for name in first]


def test_intervals_of_the_ratios_and_of_target_a_against_the_textbook_formula():
    """Four repeats (3 degrees of freedom, t = 3.182): each comparison's mean ratio and interval, (a)'s saved time and
    reference pass each with its own interval, (b)'s verdict by its interval, and one repeat: nothing measurable."""
    from rpg_research.cli.bench_speed_report import format_targets, ratios, summarize, targets

    grpo = [1.0, 2.0, 1.0, 0.5]
    aa = [1.01, 0.99, 1.00, 1.02]
    rpg_reference = [1.02, 0.98, 1.06, 1.00]
    saved = [0.09, 0.21, 0.10, 0.05]
    reference = [0.10, 0.20, 0.11, 0.06]
    runs = {
        "grpo-ref": [_result(g, r) for g, r in zip(grpo, reference)],
        "grpo-ref-2": [_result(g * x, r) for g, x, r in zip(grpo, aa, reference)],
        "rpg-sampling": [_result(g - s) for g, s in zip(grpo, saved)],
        "rpg-reference": [_result(g * x, r) for g, x, r in zip(grpo, rpg_reference, reference)],
    }
    out = ratios(runs)
    for label, values in [
        ("(A/A) GRPO vs GRPO, the same run", aa),
        ("(b) RPG reference model vs GRPO beta>0", rpg_reference),
    ]:
        mean, half = _t_interval(values, 3.182)
        assert out[label]["step_time_mean"] == pytest.approx(mean, rel=1e-9)
        assert out[label]["step_time_half_width"] == pytest.approx(half, rel=1e-9)
        assert out[label]["step_time_per_repeat"] == pytest.approx(values) and out[label]["repeats"] == 4
    # (b) by hand: mean 1.015, sd sqrt(0.0035 / 3) = 0.034157, half 3.182 x 0.034157 / 2 = 0.054343: holds 1.
    summary = {name: summarize(results) for name, results in runs.items()}
    result = targets(summary, runs, out, out["(A/A) GRPO vs GRPO, the same run"]["band"], None, lora=False)
    b = result["(b)"]
    assert b["value"] == pytest.approx(1.015) and b["half_width"] == pytest.approx(0.054343, abs=1e-6)
    assert b["interval"] == pytest.approx([1.015 - 0.054343, 1.015 + 0.054343], abs=1e-6)
    assert b["met"] and b["verdict"] == "no difference detected at ± 0.054"
    assert b["aa_half_width"] == pytest.approx(_t_interval(aa, 3.182)[1])
    # (a): saved mean 0.1125, reference pass mean 0.1175 (the anchor has none), share 0.957 >= 0.90.
    a = result["(a) time"]
    assert a["saved_s"] == pytest.approx(0.1125) and a["reference_pass_s"] == pytest.approx(0.1175)
    assert a["saved_half_width_s"] == pytest.approx(_t_interval(saved, 3.182)[1])
    assert a["reference_pass_half_width_s"] == pytest.approx(_t_interval(reference, 3.182)[1])
    assert (
        a["value"] == pytest.approx(0.1125 / 0.1175) and a["met"] and a["saved_per_repeat_s"] == pytest.approx(saved)
    )
    text = "\n".join(format_targets(result))
    assert "step time saved 112.5 ± " in text and "GRPO's reference pass 117.5 ± " in text
    assert "no difference detected at ± 0.054" in text and "A/A interval ± 0.021" in text
    # A ratio whose interval lies above 1 is "slower", below 1 "faster": (b) missed either way.
    for factor, verdict in [(1.1, "slower"), (0.9, "faster")]:
        shifted = {
            **runs,
            "rpg-reference": [_result(g * x * factor, r) for g, x, r in zip(grpo, rpg_reference, reference)],
        }
        b = targets(summary, shifted, ratios(shifted), None, None, lora=False)["(b)"]
        assert (b["verdict"], b["met"]) == (verdict, False)
    # One repeat: no interval, (b) not measurable; (a) judged on its single values.
    single = {name: results[:1] for name, results in runs.items()}
    out = ratios(single)
    assert all(r["step_time_half_width"] is None for r in out.values())
    result = targets({n: summarize(r) for n, r in single.items()}, single, out, None, None, lora=False)
    assert result["(b)"]["met"] is None and result["(b)"]["verdict"] == "not measurable (one repeat)"
    assert result["(a) time"]["saved_half_width_s"] is None and result["(a) time"]["value"] == pytest.approx(0.9)
    assert "interval not measurable" in "\n".join(format_targets(result))


def _opts(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bfloat16_weights_are_saved_loaded_and_counted_at_two_bytes(tmp_path):
    """--dtype bfloat16: the shared model is saved in bf16, both trainers' models (GRPO's reference included) hold
    bf16 parameters, and the weights weigh 2 bytes per parameter (counted from the saved model, not the trainer); a
    folder holding the other dtype is refused."""
    from transformers import AutoModelForCausalLM

    opts = _opts(
        "--device", "cpu", "--dtype", "bfloat16", "--hidden-size", "64", "--num-layers", "1",
        "--completion-length", "16", "--batch-size", "4", "--num-generations", "2", "--steps", "2", "--warmup", "0",
        "--model-dir", str(tmp_path / "model"),
    )  # fmt: skip
    opts.scenarios_here = ["grpo-ref"]
    (result,) = bench_speed._worker(opts)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype="auto")
    assert saved.dtype == __import__("torch").bfloat16
    parameters = sum(p.numel() for p in saved.parameters())
    assert result["parameter_dtypes"] == ["bfloat16"]
    assert result["model_weight_bytes"] == 2 * parameters
    assert result["weights_in_memory_bytes"] == 2 * 2 * parameters  # the policy and GRPO's reference model
    assert "--dtype=bfloat16" in bench_speed._forwarded_flags(opts)
    opts.dtype = "float32"
    with pytest.raises(ValueError, match="holds bfloat16 weights; this benchmark loads float32"):
        bench_speed.shared_model(opts, tmp_path / "model")


def test_a_command_cut_short_keeps_the_json_of_its_finished_processes(tmp_path, monkeypatch):
    """The JSON is written after each worker process; the second one failing leaves the first one's numbers, whole."""
    out = tmp_path / "bench.json"
    calls = []

    def worker(opts, names, model_dir):
        calls.append(names)
        if len(calls) == 2:
            raise RuntimeError("bench-speed worker failed")
        return [_result(0.25, 0.05, scenario=name) for name in names]

    monkeypatch.setattr(bench_speed, "_run_worker", worker)
    monkeypatch.setattr(bench_speed, "shared_model", lambda opts, path: str(path))
    opts = _opts(
        "--device", "cpu", "--repeats", "1", "--scenarios", "grpo-ref,rpg-sampling", "--loss-repeats", "0",
        "--model-dir", str(tmp_path / "model"), "--output-json", str(out),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="worker failed"):
        bench_speed.run(opts)
    assert calls == [["grpo-ref"], ["rpg-sampling"]]  # CPU: one process per run
    report = json.loads(out.read_text())
    assert report["processes"] == {"finished": 1, "planned": 2}
    assert list(report["runs"]) == ["grpo-ref"] and report["runs"]["grpo-ref"]["step_time_per_repeat_s"] == [0.25]
    assert report["per_repeat_breakdown_s"]["grpo-ref"][0]["scoring: reference log-probs"] == 0.05
    assert report["orders"] == [["grpo-ref", "rpg-sampling"]] and report["ratios"] == {}
    assert "Cut short: 1 of 2 worker processes finished." in report["conditions"]
    assert not (tmp_path / "bench.json.tmp").exists()


def test_dispatch_counts_tell_kernels_from_views_and_count_the_waits():
    """A view launches no kernel; the addition and the sum do; `.item()` makes the host wait (and reads the device)."""
    import torch

    from rpg_research.cli.bench_loss import dispatch_counts

    x = torch.ones(4)
    counts = dispatch_counts(lambda: (x.view(2, 2) + 1).sum().item())
    assert counts == {"operators": 4, "kernels": 3, "waits": 1, "copies_to_host": 0}
    assert dispatch_counts(lambda: x.view(2, 2).t())["kernels"] == 0


def test_loss_only_measures_c_alone_and_refuses_no_round(tmp_path, capsys):
    """`--loss-only`: (c) and nothing else (no trainer run: no `runs` in the JSON); RPG's loss never waits for the
    device, GRPOTrainer's waits once per `.item()` of its metrics."""
    import json

    from rpg_research.cli.bench_speed import main

    out = tmp_path / "c.json"
    tiny = ["--loss-only", "--device", "cpu", "--loss-batch", "4", "--loss-length", "8", "--loss-number", "1"]
    main(tiny + ["--loss-repeats", "2", "--loss-warmup", "0", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert "runs" not in report and report["loss_only"]["rounds"] == 2
    assert report["loss_only"]["rpg_dispatch"]["waits"] == 0 and report["loss_only"]["grpo_dispatch"]["waits"] >= 5
    assert "(c) paired rounds: mean ratio" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--loss-repeats 0"):
        main(tiny + ["--loss-repeats", "0"])
