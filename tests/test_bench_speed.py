"""`rpg-trl bench-speed --quick` runs end to end and reports consistent numbers."""

import json
import subprocess
import sys

from rpg_trl.bench_speed import make_fixed_rollout


def test_fixed_rollout_is_deterministic_and_varies_within_a_group():
    from rpg_trl.tiny import build_char_tokenizer

    class FakeTrainer:
        processing_class = build_char_tokenizer()

    rollout = make_fixed_rollout(5, 2, 10, seed=3)
    first = rollout(["1+1=", "1+1=", "2+2="], FakeTrainer())
    again = rollout(["2+2=", "1+1=", "1+1="], FakeTrainer())
    assert first["completion_ids"][0] != first["completion_ids"][1]  # two samples of one prompt differ
    assert again["completion_ids"][1:] == first["completion_ids"][:2]  # same prompt, same k-th sample
    assert again["completion_ids"][0] == first["completion_ids"][2]
    assert all(len(c) == 5 and all(2 <= t < 10 for t in c) for c in first["completion_ids"])


def test_bench_speed_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "rpg_trl.bench_speed", "--quick", "--device", "cpu", "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(a) RPG sampling anchor vs GRPO beta>0" in proc.stdout
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert runs["grpo-ref"]["has_ref_model"] and runs["rpg-reference"]["has_ref_model"]
    assert not runs["rpg-sampling"]["has_ref_model"]
    # The sampling anchor holds exactly one model's weights; GRPO with beta > 0 holds two.
    assert runs["rpg-sampling"]["weights_in_memory_bytes"] == runs["grpo-ref"]["model_weight_bytes"]
    assert runs["grpo-ref"]["weights_in_memory_bytes"] == 2 * runs["grpo-ref"]["model_weight_bytes"]
    for run in runs.values():
        assert run["step_time_s"] > 0 and run["peak_memory_bytes"] > 0
    assert report["loss_only"]["ratio"] > 0
