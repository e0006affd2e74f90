"""The KL table's choice of β (`rpg-trl bench-algos --tables kl`): one β for every arm, or each arm's own (the fifth
protocol), with the training replaced by a table of made-up scores so that the choice is known in advance."""

from types import SimpleNamespace

import pytest

from rpg_research.cli import bench_kl


#: The held-out true reward at the end of each (arm, β), the same on every seed.
SCORES = {
    ("RPG-URKL, token, default", 0.01): 0.30,
    ("RPG-URKL, token, default", 0.1): 0.50,
    ("RPG-URKL, token, default", 1.0): 0.40,
    ("RPG-URKL, sequence, default, k3", 0.01): 0.10,
    ("RPG-URKL, sequence, default, k3", 0.1): 0.20,
    ("RPG-URKL, sequence, default, k3", 1.0): 0.45,
}


def fake_kl_job(spec, run_dir):
    last = 0.25 if spec["beta"] == 0.0 else SCORES[(spec["arm"], spec["beta"])]
    summary = {
        "initial": 0.2,
        "seconds": 1.0,
        "last": last,
        "best": last,
        "proxy_last": 0.0,
        "length_end": 10.0,
        "kl_to_warm_start": 0.0,
    }
    return {**summary, "collapsed": False, "kl_estimate_end": None, "beta_end": spec["beta"], "curve": []}


def arguments(tmp_path, selection):
    return SimpleNamespace(
        output_dir=str(tmp_path), num_threads=1, kl_arms=["no KL", *sorted({arm for arm, _ in SCORES})],
        kl_betas=[0.01, 0.1, 1.0], kl_beta_selection=selection, kl_learning_rate=1e-3, selection_seeds=[7, 8],
        final_seeds=[9, 10], task="ring_walk", sft_steps=1, sft_extra_rounds=0, steps=1, eval_every=1,
        eval_problems=1, eval_samples=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("selection", "expected"),
    [
        # Shared: the mean over both arms is 0.20, 0.35, 0.425 at β = 0.01, 0.1, 1: β = 1 for both.
        ("shared", {"RPG-URKL, token, default": 1.0, "RPG-URKL, sequence, default, k3": 1.0}),
        ("per_arm", {"RPG-URKL, token, default": 0.1, "RPG-URKL, sequence, default, k3": 1.0}),
    ],
)
def test_the_kl_table_runs_each_arm_at_the_beta_its_selection_chose(tmp_path, monkeypatch, selection, expected):
    monkeypatch.setattr(bench_kl, "kl_job", fake_kl_job)
    monkeypatch.setattr(bench_kl, "kl_dynamics", lambda runs: {})  # it reads the runs' trainer states: none here
    args = arguments(tmp_path, selection)
    sft_dirs = {seed: str(tmp_path / f"sft{seed}") for seed in (7, 8, 9, 10)}
    kl = bench_kl.run_kl_table(args, sft_dirs, pool=None)
    assert len(kl["selection"]) == 2 * 3 * 2  # two regularised arms × three β × two selection seeds
    assert kl["chosen_betas"] == expected
    assert kl["chosen_beta"] == (1.0 if selection == "shared" else None)
    got = sorted((run["arm"], run["beta"], run["seed"]) for run in kl["runs"])
    want = sorted([("no KL", 0.0, s) for s in (9, 10)] + [(a, b, s) for a, b in expected.items() for s in (9, 10)])
    assert got == want
    table = bench_kl.format_kl_table(kl["table"], kl["chosen_beta"], args)
    assert ("| β |" in table) == (selection == "per_arm")
