"""`rpg-trl bench-async` (rpg_research.cli.bench_async): the asynchronous trainer at a fixed policy lag on the CPU
rollouts of the library's testing package (`rpg_trl.testing.cpu_rollouts`, tested in tests/test_async.py), end to end
on an untrained model, and its refusal of bad arguments."""

import json

import pytest


@pytest.mark.slow  # the toy reward's math-verify fallback, off the main thread, runs in a worker process
def test_bench_async_command_end_to_end(tmp_path):
    """`rpg-trl bench-async` on an untrained demo model (no warm start), 2 steps at lag 2: the table, the plot and the
    results, with the policy version each step was sampled from."""
    from rpg_research.cli import main

    output = tmp_path / "bench"
    argv = ["bench-async", "--quick", "--output_dir", str(output), "--sft_steps", "0", "--steps", "2", "--lags", "2"]
    argv += ["--methods", "RPG-REINFORCE-URKL", "--eval_problems", "4", "--eval_every", "2"]
    assert main(argv) == 0
    results = json.loads((output / "results.json").read_text())
    (run,) = results["runs"]
    assert (run["method"], run["lag"]) == ("RPG-REINFORCE-URKL", 2)
    assert [tuple(v) for v in run["sampled_versions"]] == [(1, 1), (2, 1)]  # step s from version max(1, s - 2)
    assert [p["step"] for p in run["accuracy_curve"]] == [0, 2]
    assert "| 2 | RPG-REINFORCE-URKL |" in (output / "table.md").read_text()
    assert (output / "bench_async.png").stat().st_size > 10_000


def test_bench_async_refuses_bad_arguments():
    from rpg_research.cli.bench_async import BenchAsyncArguments

    with pytest.raises(ValueError, match="lags"):
        BenchAsyncArguments(lags=[0])
    with pytest.raises(ValueError, match="Unknown method"):
        BenchAsyncArguments(methods=["PPO"])
