"""`research/gpu/bench_repeats.py`: the per-repeat figures research/docs/benchmarks.md cites, checked against values
derived by hand and against transformers' own parameter count; and the intervals of the bench-speed tables in the GPU
run's summary.md (`research/gpu/gpu_stages.py`)."""

import json
import math
from pathlib import Path

import pytest
from gpu_scripts import load_gpu_script


CALL2 = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu_2026-11-27" / "call2"


@pytest.fixture(scope="module")
def bench_repeats():
    return load_gpu_script("bench_repeats")


def test_sign_test_of_12_slower_rounds_in_15(bench_repeats):
    # P(X ≥ 12), X ~ Binomial(15, 1/2): (C(15,12) + C(15,13) + C(15,14) + C(15,15)) / 2^15 = (455 + 105 + 15 + 1) / 32768.
    one, two = bench_repeats.sign_test(12, 15)
    assert one == pytest.approx(576 / 32768) and two == pytest.approx(2 * 576 / 32768)
    assert bench_repeats.sign_test(0, 4) == (1.0, 1.0)


def test_median_interval_of_15_values_is_the_4th_to_12th(bench_repeats):
    # Coverage of [x(k), x(n+1-k)]: 1 − 2·P(X < k). k = 4: 1 − 2·(1 + 15 + 105 + 455)/32768 = 0.9648; k = 5 falls below.
    low, high, coverage = bench_repeats.median_interval([float(v) for v in range(15, 0, -1)])
    assert (low, high) == (4.0, 12.0)
    assert coverage == pytest.approx(1 - 2 * 576 / 32768)


def test_rotation_starts_each_repeat_one_scenario_later(bench_repeats):
    assert bench_repeats.rotation(["a", "b", "c", "d"], 3) == [list("abcd"), list("bcda"), list("cdab")]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "mlp"), [(2, 1, 64, 512), (4, 2, 32, 384)])
def test_qwen3_parameter_count_equals_transformers(bench_repeats, heads, kv_heads, head_dim, mlp):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=128, num_hidden_layers=2, vocab_size=100, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=mlp, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    expected = sum(p.numel() for p in model.parameters())
    assert bench_repeats.qwen3_parameters(128, 2, 100, heads, kv_heads, head_dim, mlp) == expected


def test_main_prints_the_per_repeat_savings_and_the_sign_test(bench_repeats, tmp_path, capsys):
    data = {
        "settings": {"repeats": 3, "hidden_size": 128, "num_layers": 2, "vocab_size": 100},
        "runs": {
            "grpo-ref": {"step_time_per_repeat_s": [0.5, 0.4, 0.6], "model_weight_bytes": 4 * 1000},
            "rpg-sampling": {"step_time_per_repeat_s": [0.45, 0.42, 0.5]},
        },
        "ratios": {"rpg/grpo": {"step_time_per_repeat": [0.9, 1.05, 0.8333]}},
        "noise_band": 0.1,
        "loss_only": {"grpo_loss_rounds_s": [1.0, 1.0, 1.0, 1.0], "rpg_loss_rounds_s": [1.1, 1.2, 0.9, 1.05]},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    bench_repeats.main(str(path))
    out = capsys.readouterr().out
    assert "(a) step time saved per repeat (ms): [50.0, -20.0, 100.0], median 50.0" in out
    assert "repeats outside the band: [3]" in out  # |0.8333 − 1| > 0.1 only
    assert "RPG slower in 3 of 4 rounds" in out
    assert f"{5 / 16:.3f} one-sided" in out  # P(X ≥ 3), X ~ Binomial(4, 1/2) = 5/16
    assert math.isclose(5 / 16, bench_repeats.sign_test(3, 4)[0])


def test_main_reads_the_recorded_orders_and_prints_the_intervals(bench_repeats, tmp_path, capsys):
    """A JSON with `orders` and `per_repeat_breakdown_s`: the orders as recorded; each ratio's mean with its interval
    and (a)'s two rows, by hand with t(3) = 3.182 over four repeats."""
    reference = [0.10, 0.20, 0.11, 0.06]
    data = {
        "settings": {"repeats": 4, "hidden_size": 64, "num_layers": 1, "vocab_size": None, "dtype": "bfloat16"},
        "runs": {
            "grpo-ref": {
                "step_time_per_repeat_s": [1.0, 2.0, 1.0, 0.5],
                "model_weight_bytes": 2 * 1000,
                "vocab_size": 28,
            },
            "rpg-sampling": {"step_time_per_repeat_s": [0.91, 1.79, 0.90, 0.45]},
        },
        "orders": [["rpg-sampling", "grpo-ref"], ["grpo-ref", "rpg-sampling"]] * 2,
        "per_repeat_breakdown_s": {
            "grpo-ref": [{"scoring: reference log-probs": r} for r in reference],
            "rpg-sampling": [{"scoring: reference log-probs": 0.0}] * 4,
        },
        "ratios": {"(b)": {"step_time_per_repeat": [1.02, 0.98, 1.06, 1.00]}},
        "noise_band": None,
        "processes": {"finished": 8, "planned": 8},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    bench_repeats.main(str(path))
    out = capsys.readouterr().out
    assert "repeat 1 runs, in order (recorded): rpg-sampling, grpo-ref" in out
    assert "repeat 2 runs, in order (recorded): grpo-ref, rpg-sampling" in out
    # Mean 1.015; sd = sqrt((0.005² + 0.035² + 0.045² + 0.015²) / 3) = 0.034157; ± 3.182 x 0.034157 / 2 = 0.054343.
    assert "mean ratio 1.015 ± 0.054 [0.961, 1.069] (95 % Student-t over 4 repeat(s))" in out
    # Saved 90, 210, 100, 50 ms: mean 112.5, sd 68.496, ± 108.98; the pass 117.5, sd 59.09, ± 94.01.
    assert "median 95.0, mean 112.5 ± 109.0 [3.5, 221.5]" in out
    assert "less the anchor's (ms): [100.0, 200.0, 110.0, 60.0], mean 117.5 ± 94.0 [23.5, 211.5]" in out
    assert "saved / pass, of the means: 96%" in out  # 112.5 / 117.5
    assert "weights (bfloat16): 2000 bytes = 1,000 parameters x 2 bytes" in out
    # The character vocabulary (settings: None) from the run; bench_speed's model of hidden 64 x 1 layer has 2 heads of
    # 32: attention 64·32·(2·2 + 2·1) + 2·32 = 12,352, MLP 3·64·256 = 49,152, norms 128, embeddings 28·64 = 1,792,
    # final norm 64: 63,488 (the 253,952 float32 bytes of such a CPU run, / 4).
    assert "hidden 64 x 1 layers, vocabulary 28: 63,488 parameters with 2 heads of 32 and MLP 256" in out


def test_main_reads_the_gpu_run_of_2026_11_27(bench_repeats, capsys):
    """The real JSON of the previous format (no orders, no per-repeat breakdown): the rotation it ran, the intervals
    recomputed from its per-repeat ratios (scipy's t quantile here), the reference pass as its median."""
    from scipy import stats

    path = CALL2 / "bench_speed_full_1024.json"
    data = json.loads(path.read_text())
    bench_repeats.main(str(path))
    out = capsys.readouterr().out
    assert "repeat 2 runs, in order (not recorded: the rotation of its time): grpo-ref-2, rpg-sampling" in out
    ratios = data["ratios"]["(A/A) GRPO vs GRPO, the same run"]["step_time_per_repeat"]
    mean = sum(ratios) / 3
    half = stats.t.ppf(0.975, 2) * math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2) / math.sqrt(3)
    assert f"mean ratio {mean:.3f} ± {half:.3f} [{mean - half:.3f}, {mean + half:.3f}]" in out
    assert "(a) GRPO's reference pass: median 44.8 ms (per repeat not in this JSON: no interval)" in out
    assert "weights (float32): 2384185344 bytes = 596,046,336 parameters x 4 bytes" in out


def test_summary_shows_the_intervals_when_the_reports_hold_them():
    """gpu_stages' bench tables: an interval table for the reports that hold intervals; the GPU run's JSONs of
    2026-11-27 (none) render as before."""
    gpu_stages = load_gpu_script("gpu_stages")
    old = json.loads((CALL2 / "bench_speed_full_1024.json").read_text())
    lines = gpu_stages._bench_tables([old])
    assert not any("± 95 % (Student-t)" in line for line in lines)
    assert "| 1024 | full | (A/A) GRPO vs GRPO, the same run | 0.988 [0.942-1.021] | 1.000 | 0.0 |" in lines
    new = json.loads(json.dumps(old))
    new["ratios"]["(A/A) GRPO vs GRPO, the same run"] |= {
        "step_time_mean": 0.984,
        "step_time_half_width": 0.098,
        "repeats": 3,
    }
    new["ratios"]["(a) RPG sampling anchor vs GRPO beta>0"] |= {
        "step_time_mean": 0.85,
        "step_time_half_width": None,
        "repeats": 1,
    }
    lines = gpu_stages._bench_tables([new])
    assert "| 1024 | full | (A/A) GRPO vs GRPO, the same run | 3 | 0.984 ± 0.098 | [0.886, 1.082] |" in lines
    assert (
        "| 1024 | full | (a) RPG sampling anchor vs GRPO beta>0 | 1 | 0.850 | not measurable (one repeat) |" in lines
    )
