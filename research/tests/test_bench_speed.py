"""`rpg-trl bench-speed --quick` runs end to end, reports consistent numbers and writes them with `--output-json`; its
report (`rpg_research.cli.bench_speed_report`): the ratios, the noise band and the targets."""

import argparse
import json
import subprocess
import sys

import pytest

from rpg_research import cli
from rpg_research.cli.bench_speed import PHASES, _PhaseTimer, add_arguments, plan, settings
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
    }
    # What was timed travels with the figures; one repeat gives no noise band, so (b) cannot be judged.
    assert "generation not timed, no vLLM), random weights, vocabulary 500, full fine-tuning" in report["conditions"]
    assert report["conditions"] in proc.stdout and report["noise_band"] is None
    assert set(report["targets"]) == {"(a) time", "(a) memory", "(b)", "(c)"}
    assert report["targets"]["(b)"]["met"] is None and "target (c): ratio" in proc.stdout
    runs = report["runs"]
    assert list(runs) == ["grpo-ref", "grpo-ref-2", "rpg-sampling", "rpg-reference"]
    assert all(run["vocab_size"] == 500 for run in runs.values())
    # Every step's time is saved (warm-up included), per run and repeat.
    assert [len(steps) for steps in report["per_repeat"]["grpo-ref"]] == [4]
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
        "| where a step's time goes (ms per step) | grpo-ref | grpo-ref-2 | rpg-sampling | rpg-reference |"
        in proc.stdout
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


def test_targets_and_the_noise_band_from_per_repeat_times():
    """(a) the time saved against GRPO's own reference pass, (b) against the A/A band, (c) against 1.05."""
    from rpg_research.cli.bench_speed_report import ratios, summarize, targets

    def run(step, reference_pass, peak):
        breakdown = dict.fromkeys(PHASES, 0.0) | {"scoring: reference log-probs": reference_pass}
        return {
            "step_time_s": step,
            "tokens_per_s": 1 / step,
            "peak_memory_bytes": peak,
            "model_weight_bytes": 100,
            "weights_in_memory_bytes": 200,
            "has_ref_model": True,
            "vocab_size": 10,
            "resident_before_bytes": None,
            "breakdown_s": breakdown,
        }

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
    loss = {"ratio": 1.04, "model_training": True}
    result = targets(summary, runs, out, aa["band"], loss, lora=False)
    assert result["(a) time"]["value"] == pytest.approx(0.95) and result["(a) time"]["met"]  # 95 ms of 100 ms
    assert result["(a) memory"]["met"] and result["(a) memory"]["saved_bytes"] == 100
    assert targets(summary, runs, out, aa["band"], loss, lora=False, cuda=False)["(a) memory"]["met"] is None  # RSS
    assert result["(b)"]["value"] == pytest.approx(1.01) and result["(b)"]["met"]  # |0.01| <= 0.02
    assert result["(c)"]["met"]
    assert (
        targets(summary, runs, out, 0.005, {"ratio": 1.06, "model_training": True}, lora=True)["(b)"]["met"] is False
    )
    lora = targets(summary, runs, out, None, {"ratio": 1.06, "model_training": True}, lora=True)
    assert lora["(a) memory"]["met"] is None and lora["(b)"]["met"] is None and lora["(c)"]["met"] is False
