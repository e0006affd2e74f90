"""`research/gpu/bench_repeats.py`: the per-repeat figures research/docs/benchmarks.md cites, checked against values
derived by hand and against transformers' own parameter count."""

import json
import math

import pytest
from gpu_scripts import load_gpu_script


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
