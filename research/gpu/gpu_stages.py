# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The Python steps of `research/gpu/gpu_run.sh`'s stages (the bash script installs, launches and times; this module
records, builds the inputs, checks and summarises), each a function tested on CPU by `research/tests/test_gpu_dry_run.py`:

    python research/gpu/gpu_stages.py env OUT.json DEVICE          # device, driver, CUDA, versions, date, commit (setup)
    python research/gpu/gpu_stages.py e2e-inputs WORK              # the e2e model and math parquet
    python research/gpu/gpu_stages.py e2e-check RESULTS WORK       # the e2e logs: 20 + 10 steps, finite RPG metrics,
                                                               # the resume's verdict (float32 in the dry run)
    python research/gpu/gpu_stages.py pytest-check XML DRY_RUN [TIMES]  # the GPU tests' JUnit XML (else the per-test
                                                               # JSON lines TIMES): no failure (no skip on GPU)
    python research/gpu/gpu_stages.py summary RESULTS              # summary.md: the tables of research/docs/benchmarks.md (and
                                                               # learning.md, of the learning runs that finished)
"""

from __future__ import annotations

import ast
import datetime
import glob
import hashlib
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET


#: The e2e stage's Qwen3 on the GPU: 31M parameters, so that the run and its resume write 1.4 GB (22 GB at 0.5B).
E2E_MODEL = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, intermediate_size=2048
)
#: The RPG metrics every training step must log, finite (with the loss and the entropy).
E2E_METRICS = ["loss", "kl", "clip_ratio/dual_mean", "importance_weight/max", "entropy"]
VERSIONS = ["torch", "transformers", "trl", "accelerate", "peft", "datasets", "math-verify", "deepspeed", "pyarrow"]
VERSIONS += ["numpy", "huggingface-hub", "tokenizers", "regex"]


def _command(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest(root=".") -> str:
    """A digest of the sources that ran (rpg_trl, rpg_research, examples, the GPU scripts, tests): the lent machine gets
    the tree without .git."""
    digest = hashlib.sha256()
    paths = glob.glob("rpg_trl/**/*.py", recursive=True, root_dir=root) + glob.glob("examples/*", root_dir=root)
    paths += glob.glob("research/rpg_research/**/*.py", recursive=True, root_dir=root)
    paths += glob.glob("research/gpu/*", root_dir=root) + glob.glob("research/tests/*.py", root_dir=root)
    for path in sorted(paths + glob.glob("tests/*.py", root_dir=root)):
        digest.update(path.encode() + b"\0" + open(os.path.join(root, path), "rb").read())
    return digest.hexdigest()[:16]


def record_env(path: str, device: str) -> dict:
    """env.json; exits if a needed package is missing or, with `device` "cuda", CUDA is not available."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_run.sh: CUDA is not available here; use --dry-run for the CPU dry run.")
    from gpu_wheels import versions as installed_versions  # research/gpu/, the script's folder, is on sys.path

    versions = installed_versions(VERSIONS)
    needed = ["trl", "datasets", "math-verify"] + (["deepspeed"] if device == "cuda" else [])
    missing = [name for name in needed if not versions[name]]
    if missing:
        sys.exit(
            f"gpu_run.sh: missing packages {missing}: carry their wheels (bash research/gpu/gpu_run.sh --fetch-wheels)"
        )
    for module in ["trl", "datasets", "math_verify", "rpg_trl"] + (["deepspeed"] if device == "cuda" else []):
        importlib.import_module(module)
    cuda = device == "cuda"
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "python": platform.python_version(),
        "versions": versions,
        # RPG_COMMIT, else git (absent where the tree travels without .git); the digest identifies the tree anyway.
        "commit": os.environ.get("RPG_COMMIT") or _command(["git", "rev-parse", "HEAD"]),
        "source_sha256": source_digest(),
    }
    with open(path, "w") as f:
        f.write(json.dumps(env, indent=2) + "\n")
    return env


def e2e_inputs(work: str, tiny: bool) -> None:
    """The e2e model (E2E_MODEL, or the tiny Qwen3 of the dry run) with a character tokenizer covering the paper's
    prompt, and a math parquet in the authors' schema (tests/test_math_task_data.py's authors_row)."""
    import string

    sys.path.insert(0, "tests")
    from test_math_task_data import authors_row, write_parquet

    from rpg_research.toy import build_char_tokenizer, save_tiny_model

    sizes = {**({} if tiny else E2E_MODEL), "max_position_embeddings": 1024}
    save_tiny_model(os.path.join(work, "model"), tokenizer=build_char_tokenizer(string.printable), **sizes)
    pairs = [(a, b) for a in range(1, 9) for b in range(1, 9)]
    rows = [authors_row(f"What is {a}+{b}?", str(a + b), index=i) for i, (a, b) in enumerate(pairs)]
    print("train file:", write_parquet(os.path.join(work, "math.parquet"), rows), len(rows), "rows")


def _literal(line: str) -> dict:
    """A printed dict of numbers, `nan` and `inf` included (which `ast.literal_eval` refuses: the very values the
    check must catch)."""
    tree = ast.parse(line, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in ("nan", "inf"):
            raise ValueError(f"not a printed dict of numbers: {line[:200]}")
        if not isinstance(node, (ast.Expression, ast.Dict, ast.Constant, ast.Name, ast.Load, ast.UnaryOp, ast.USub)):
            raise ValueError(f"not a printed dict of numbers: {line[:200]}")
    return eval(compile(tree, "<log>", "eval"), {"__builtins__": {}}, {"nan": math.nan, "inf": math.inf})


def training_logs(path: str) -> list[dict]:
    """The training steps' metric dicts a trainer printed (values as numbers)."""
    lines = open(path).read().splitlines()
    dicts = [_literal(line) for line in lines if line.startswith("{'") and "'loss'" in line]
    return [{k: float(v) for k, v in d.items()} for d in dicts]


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _metrics_only(log: dict) -> dict:
    return {k: v for k, v in log.items() if k not in ("step_time", "train_runtime")}


#: The resume verdict's rule (e2e_check; the steps 11-20 of the run resumed from checkpoint-10 against the same steps
#: of the uninterrupted run). The data path must be exact whatever the precision: the same batches (token ids and
#: masks of prompts and completions, research/gpu/e2e_train.py's digests) at every step, and at the steps that sample,
#: the same logged completion and reward metrics (GENERATION_KEYS; the rewards are functions of the text). The losses
#: may differ by what the arithmetic does not repeat: at each step |loss_resumed - loss_run| <= tolerance, where
#:   float32 (the CPU dry run, deterministic): RELATIVE["float32"] x max(|loss|) + LOSS_FLOOR, float32's spacing;
#:   bf16 (the GPU): max(R, RELATIVE["bf16"] x max(|loss|) + LOSS_FLOOR), with R the largest |loss_repeat - loss_run|
#:   over steps 11-20 of the repeat, the same run launched beside the first. CUDA's reductions are not all
#:   deterministic, so the run itself does not repeat its losses; the repeat has drifted from the run since step 1,
#:   the resume (from the run's own checkpoint) only since step 11, so an exact resume stays within R. Single steps are
#:   single draws of that noise: R is the repeat's largest over the steps, not its value at the same step. 2**-7 is
#:   bf16's relative spacing (8 significant bits), for the case where the repeat happens to agree bit for bit.
#: On the GPU the noise can reach the samples too (a token drawn near a boundary of its distribution, from weights a
#: rounding apart): where the repeat's own batches first differ from the run's at step F, the resumed steps from F on
#: are not required to match either (their losses are still held to R). In float32 every step must match.
#: LOSS_FLOOR: the loss is the token mean of terms of order 1 (normalised advantages times importance weights near 1)
#: that cancel to ~1e-4 and less, so float32 leaves an absolute error of about 2**-23 whatever the loss's size.
RELATIVE = {"float32": 2**-23, "bf16": 2**-7}
LOSS_FLOOR = 2**-23
GENERATION_KEYS = ("num_tokens", "completions/", "rewards/", "reward", "reward_std", "frac_reward_zero_std")
RESUMED_STEPS = range(11, 21)


def _history(path: str) -> dict[int, dict]:
    """The training steps' logs of a trainer_state.json by step, at full precision (the printed ones keep 4 digits)."""
    return {log["step"]: log for log in json.load(open(path))["log_history"] if "loss" in log}


def _batches(path: str) -> dict[int, list]:
    """research/gpu/e2e_train.py's digests, by step: the (tokens, advantages) of each batch, in order."""
    steps: dict[int, list] = {}
    for line in open(path).read().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append((record["process"], record["tokens"], record["advantages"]))
    return steps


def resume_verdict(run: dict, resumed: dict, repeat: dict | None, batches: dict, precision: str) -> dict:
    """Whether steps 11-20 of the resumed run repeat the uninterrupted run's (the rule above RELATIVE). `run`,
    `resumed`, `repeat`: step -> logged metrics (`_history`); `batches`: run name -> step -> digests (`_batches`)."""
    verdict = {"precision": precision, "rule": ""}
    first_other = None
    if "repeat" in batches:
        first_other = next((s for s in sorted(batches["run"]) if batches["run"][s] != batches["repeat"].get(s)), None)
        verdict["repeat_first_step_other_batches"] = first_other
    exact = [s for s in RESUMED_STEPS if precision != "bf16" or first_other is None or s < first_other]
    verdict["steps_compared_exactly"] = exact
    mismatched = [s for s in exact if batches["run"].get(s) != batches["resumed"].get(s)]
    verdict["same_batches"] = not mismatched and all(batches["run"].get(s) for s in exact)
    verdict["steps_with_other_batches"] = mismatched
    verdict["same_advantages"] = all(
        [b[2] for b in batches["run"].get(s, [])] == [b[2] for b in batches["resumed"].get(s, [])] for s in exact
    )
    differing = []
    for step in exact:
        keys = {k for k in run[step] if k.startswith(GENERATION_KEYS)} | {
            k for k in resumed[step] if k.startswith(GENERATION_KEYS)
        }
        differing += [f"{k} at step {step}" for k in sorted(keys) if run[step].get(k) != resumed[step].get(k)]
    verdict["same_generation_metrics"] = not differing
    verdict["differing_generation_metrics"] = differing
    yardstick = 0.0
    if precision == "bf16" and repeat is not None:
        yardstick = max(abs(run[s]["loss"] - repeat[s]["loss"]) for s in RESUMED_STEPS)
    verdict["yardstick"] = yardstick
    verdict["rule"] = (
        f"same batches and generation metrics at steps {exact[0]}-{exact[-1]}; " * bool(exact)
        + "|loss_resumed - loss_run| <= "
        + (f"max(R = {yardstick:.3g}, " if precision == "bf16" else "")
        + f"2**{round(math.log2(RELATIVE[precision]))} x max|loss| + 2**-23"
        + (")" if precision == "bf16" else "")
    )
    losses = []
    for step in RESUMED_STEPS:
        a, b = run[step]["loss"], resumed[step]["loss"]
        tolerance = RELATIVE[precision] * max(abs(a), abs(b)) + LOSS_FLOOR
        tolerance = max(yardstick, tolerance)
        losses.append({"step": step, "run": a, "resumed": b, "difference": abs(a - b), "tolerance": tolerance})
    verdict["losses"] = losses
    verdict["losses_within_tolerance"] = all(x["difference"] <= x["tolerance"] for x in losses)
    verdict["passed"] = (
        verdict["same_batches"] and verdict["same_generation_metrics"] and verdict["losses_within_tolerance"]
    )
    return verdict


def e2e_check(results: str, work: str, precision: str = "bf16") -> dict:
    """Checks the two e2e logs (20 steps; the resume from checkpoint-10, 10 steps), judges the resume (`resume_verdict`:
    `precision` "bf16" on the GPU, "float32" in the dry run) and writes e2e_summary.json; fails after writing it."""
    train = training_logs(os.path.join(results, "e2e_train.log"))
    resumed = training_logs(os.path.join(results, "e2e_resume.log"))
    assert len(train) == 20, f"the run logged {len(train)} training steps, expected 20"
    assert len(resumed) == 10, f"the resumed run logged {len(resumed)} steps, expected 10 (11 to 20)"
    # Every step logs the loss and RPG's metrics; the reward is logged at the steps that generate (1 in 2 here).
    for name, run in (("run", train), ("resumed run", resumed)):
        for key in E2E_METRICS + ["reward"]:
            values = [log[key] for log in run if key in log]
            expected = len(run) if key != "reward" else len(run) // 2
            assert len(values) == expected and all(math.isfinite(v) for v in values), (name, key, values)
    checkpoint = os.path.join(work, "e2e", "checkpoint-10")
    assert os.path.isfile(os.path.join(checkpoint, "rpg_generation_state.pt")), os.listdir(checkpoint)
    assert os.path.isfile(os.path.join(work, "e2e_resumed", "model.safetensors"))
    state = json.load(open(os.path.join(work, "e2e_resumed", "checkpoint-20", "trainer_state.json")))
    assert state["global_step"] == 20, state["global_step"]
    histories = {
        name: _history(os.path.join(work, folder, "checkpoint-20", "trainer_state.json"))
        for name, folder in (("run", "e2e"), ("resumed", "e2e_resumed"), ("repeat", "e2e_repeat"))
        if os.path.exists(os.path.join(work, folder, "checkpoint-20", "trainer_state.json"))
    }
    summary = {
        "steps": len(train),
        "resumed_steps": len(resumed),
        "metrics": E2E_METRICS,
        "last_step": {k: train[-1][k] for k in E2E_METRICS},
        "rewards": [log["reward"] for log in train if "reward" in log],
        # Exact resume (rpg_trl/reliability/generation_state.py): steps 11-20 of both runs train on the same batches.
        # At full precision (the checkpoints' trainer_state.json).
        "loss_steps_11_20": [histories["run"][s]["loss"] for s in RESUMED_STEPS],
        "loss_steps_11_20_resumed": [histories["resumed"][s]["loss"] for s in RESUMED_STEPS],
        "max_abs_loss_difference_after_resume": max(
            abs(histories["run"][s]["loss"] - histories["resumed"][s]["loss"]) for s in RESUMED_STEPS
        ),
        # What the two runs wrote: checkpoints 10 and 20, checkpoint 20 of the resume, and each one's final model.
        "checkpoint_bytes": _size(os.path.join(work, "e2e")) + _size(os.path.join(work, "e2e_resumed")),
        "one_checkpoint_bytes": _size(checkpoint),
    }
    # The yardstick: the same run again, uninterrupted, launched beside the first (gpu_run.sh); on a GPU two runs with
    # one seed may differ (not every CUDA kernel is deterministic), on a CPU they do not.
    path = os.path.join(results, "e2e_repeat.log")
    if os.path.exists(path):
        repeat = training_logs(path)
        assert len(repeat) == 20, f"the repeated run logged {len(repeat)} training steps, expected 20"
        assert "repeat" in histories, "the repeated run left no checkpoint-20/trainer_state.json"
        summary["loss_steps_11_20_repeat"] = [histories["repeat"][s]["loss"] for s in RESUMED_STEPS]
        summary["max_abs_loss_difference_between_two_runs"] = max(
            abs(histories["run"][s]["loss"] - histories["repeat"][s]["loss"]) for s in RESUMED_STEPS
        )
        summary["first_step_two_runs_differ"] = next(
            (i + 1 for i, (a, b) in enumerate(zip(train, repeat)) if _metrics_only(a) != _metrics_only(b)), None
        )
    batches = {
        name: _batches(os.path.join(results, f"e2e_{name}_batches.jsonl"))
        for name in ("run", "resumed", "repeat")
        if os.path.exists(os.path.join(results, f"e2e_{name}_batches.jsonl"))
    }
    assert "run" in batches and "resumed" in batches, "no batch digests (research/gpu/e2e_train.py, RPG_E2E_BATCHES)"
    summary["resume_verdict"] = resume_verdict(
        histories["run"], histories["resumed"], histories.get("repeat"), batches, precision
    )
    with open(os.path.join(results, "e2e_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    verdict = summary["resume_verdict"]
    assert verdict["passed"], (
        f"the resume did not repeat the run: same batches {verdict['same_batches']} (other at steps "
        f"{verdict['steps_with_other_batches']}), other generation metrics {verdict['differing_generation_metrics']}, "
        f"losses {[x for x in verdict['losses'] if x['difference'] > x['tolerance']]}; rule: {verdict['rule']}"
    )
    return summary


def test_times(path: str) -> dict:
    """research/gpu/pytest_times.py's JSON lines: the tests collected, each finished test's record (nodeid, outcome,
    seconds), and the tests collected that had not finished (the one running when the stage was cut, those after)."""
    collected, records = [], []
    for line in open(path).read().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        if "collected" in record:
            collected = record["collected"]
        else:
            records.append(record)
    finished = {record["nodeid"] for record in records if record["when"] != "teardown"}
    return {"collected": collected, "records": records, "unfinished": [n for n in collected if n not in finished]}


def pytest_check(xml: str, dry_run: bool, times: str | None = None) -> dict:
    """The counts of pytest's JUnit XML, or, where pytest was killed before writing it, of the per-test JSON lines
    `times` (research/gpu/pytest_times.py); fails on a failure or an error, on a test that did not finish, and on the
    GPU on a skip."""
    if os.path.exists(xml):
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
        counts["source"] = os.path.basename(xml)
    else:
        assert times and os.path.exists(times), f"neither {xml} nor per-test times: pytest did not start its tests"
        found = test_times(times)
        outcomes = [(r["when"], r["outcome"]) for r in found["records"]]
        counts = {
            "tests": len(found["collected"]),
            "failures": outcomes.count(("call", "failed")),
            "errors": outcomes.count(("setup", "failed")) + outcomes.count(("teardown", "failed")),
            "skipped": sum(outcome == "skipped" for _, outcome in outcomes),
            "source": os.path.basename(times) + " (no JUnit XML: pytest did not reach its end)",
            "unfinished": found["unfinished"],
        }
        assert not found["unfinished"], f"{len(found['unfinished'])} tests did not finish: {found['unfinished']}"
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, counts
    if not dry_run:  # on the GPU nothing may skip (DeepSpeed included)
        assert counts["skipped"] == 0, f"{counts['skipped']} GPU tests skipped: see pytest_gpu.log"
    return counts


def _tests_table(path: str) -> list[str]:
    """The per-test seconds (call and set-up) in the order the tests ran, and those that had not finished."""
    found = test_times(path)
    lines = ["| test | outcome | seconds (call) | set-up (s) |", "|---|---|---|---|"]
    for r in found["records"]:
        outcome = r["outcome"] + ("" if r["when"] == "call" else f" ({r['when']})")
        lines.append(f"| {r['nodeid']} | {outcome} | {r['duration']:.1f} | {r['setup']:.1f} |")
    lines += [f"| {nodeid} | not finished | | |" for nodeid in found["unfinished"]]
    return lines


def summary(results: str) -> str:
    """summary.md: whatever the results folder holds, as the tables of research/docs/benchmarks.md's GPU section."""
    lines = []
    path = os.path.join(results, "env.json")
    if os.path.exists(path):
        env = json.load(open(path))
        lines.append(
            f"device: {env['device']}, driver {env.get('driver')}, CUDA {env['cuda']}, {env['date_utc']}, "
            f"commit {env['commit']}, sources {env.get('source_sha256')}"
        )
        lines.append(f"versions: {env['versions']}")
    path = os.path.join(results, "image.json")
    if os.path.exists(path):
        lines.append(f"image before the install: {json.load(open(path))}")
    path = os.path.join(results, "stages.tsv")
    if os.path.exists(path):
        lines += ["", "| stage | exit status | seconds | deadline (s) |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(row.split("\t")) + " |" for row in open(path).read().splitlines() if row]
    lines.append("")
    path = os.path.join(results, "e2e_summary.json")
    if os.path.exists(path):
        e2e = json.load(open(path))
        yardstick = e2e.get("max_abs_loss_difference_between_two_runs")
        lines += [
            f"e2e: {e2e['steps']} steps + resume of {e2e['resumed_steps']}, last step {e2e['last_step']}, "
            f"max |loss difference| after resume {e2e['max_abs_loss_difference_after_resume']:.3g}"
            + ("" if yardstick is None else f" (between two uninterrupted runs: {yardstick:.3g})")
            + f", checkpoints {e2e['checkpoint_bytes'] / 2**20:.0f} MiB",
        ]
        verdict = e2e.get("resume_verdict")
        if verdict:
            worst = max(verdict["losses"], key=lambda x: x["difference"] / x["tolerance"])
            lines.append(
                f"e2e resume verdict ({verdict['precision']}): {'passed' if verdict['passed'] else 'FAILED'}: same "
                f"batches at steps {verdict.get('steps_compared_exactly', '11-20')} {verdict['same_batches']}, "
                f"same generation metrics "
                f"{verdict['same_generation_metrics']}, losses within tolerance {verdict['losses_within_tolerance']} "
                f"(largest |difference| / tolerance {worst['difference'] / worst['tolerance']:.3g}, at step "
                f"{worst['step']}); rule: {verdict['rule']}"
            )
        lines.append("")
    path = os.path.join(results, "pytest_gpu.log")
    if os.path.exists(path):
        tail = [line for line in open(path).read().splitlines() if line.strip()][-1:]
        lines += [f"pytest: {tail[0] if tail else '?'}", ""]
    path = os.path.join(results, "pytest_gpu_times.jsonl")
    if os.path.exists(path):
        lines += _tests_table(path) + [""]
    if os.path.isdir(os.path.join(results, "learn")):  # the finished runs, also of a stage cut short by its deadline
        if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # loaded by path (the tests)
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_learn import summary as learning_summary

        learning_summary(results)
        lines += [open(os.path.join(results, "learning.md")).read().rstrip(), ""]
    files = sorted(glob.glob(os.path.join(results, "bench_speed_*.json")))
    if files:
        lines += _bench_tables([json.load(open(path)) for path in files])
    text = "\n".join(lines) + "\n"
    with open(os.path.join(results, "summary.md"), "w") as f:
        f.write(text)
    return text


def _spread(value: float, low, high, digits: int) -> str:
    return f"{value:.{digits}f}" + ("" if low is None else f" [{low:.{digits}f}-{high:.{digits}f}]")


def _bench_tables(reports: list[dict]) -> list[str]:
    """The bench-speed reports as research/docs/benchmarks.md's tables: what was timed, the runs, the comparisons (medians and
    [min-max] over the repeats; and the mean ratios with their 95 % Student-t intervals, for reports that hold them),
    the targets, the loss alone and where a step's time goes."""
    lines = ["What was timed (each bench-speed command):"]
    runs = [
        "",
        "| completion tokens | training | run | step time (s) [min-max] | tokens/s | peak memory (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    ratios = [
        "",
        "| completion tokens | training | comparison | step time ratio [min-max] | peak memory ratio | "
        "peak memory saved (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    intervals = [
        "",
        "| completion tokens | training | comparison | repeats | mean step time ratio ± 95 % (Student-t) | interval |",
        "|---|---|---|---|---|---|",
    ]
    targets, losses, breakdowns = [""], [""], []
    for report in reports:
        s = report["settings"]
        head = f"| {s['completion_length']} | {'LoRA' if s['lora'] else 'full'} |"
        title = head.strip("| ").replace(" | ", " tokens, ")
        lines.append(f"- {title}: " + report.get("conditions", "(not recorded: bench-speed before 2026-11-26)"))
        for name, run in report["runs"].items():
            step = _spread(run["step_time_s"], run.get("step_time_min_s"), run.get("step_time_max_s"), 4)
            runs.append(
                f"{head} {name} | {step} | {run['tokens_per_s']:.0f} | {run['peak_memory_bytes'] / 2**20:.1f} |"
            )
        for label, r in report["ratios"].items():
            ratio = _spread(r["step_time"], r.get("step_time_min"), r.get("step_time_max"), 3)
            ratios.append(
                f"{head} {label} | {ratio} | {r['peak_memory']:.3f} | {r['peak_memory_saved_bytes'] / 2**20:.1f} |"
            )
            if "step_time_mean" in r:  # bench-speed after the GPU run of 2026-11-27
                mean, half = r["step_time_mean"], r["step_time_half_width"]
                spread = f"{mean:.3f}" if half is None else f"{mean:.3f} ± {half:.3f}"
                ends = "not measurable (one repeat)" if half is None else f"[{mean - half:.3f}, {mean + half:.3f}]"
                intervals.append(f"{head} {label} | {r['repeats']} | {spread} | {ends} |")
        if "targets" in report:
            from rpg_research.cli.bench_speed_report import format_targets

            band = report.get("noise_band")
            targets.append(f"{title}: noise band (A/A) " + ("none" if band is None else f"1.00 ± {band:.3f}"))
            targets += format_targets(report["targets"])[1:] + [""]
        loss = report["loss_only"]
        if loss is not None:
            losses.append(
                f"(c) loss alone ({title}), B={s['loss_batch']}, T={s['loss_length']}"
                f"{', training mode' if loss.get('model_training') else ''}: RPG {loss['rpg_loss_s'] * 1e3:.2f} ms, "
                f"GRPO {loss['grpo_loss_s'] * 1e3:.2f} ms, ratio {loss['ratio']:.3f}"
            )
            from rpg_research.cli.bench_speed_report import loss_details

            losses += loss_details(loss)
        if all("breakdown_s" in run for run in report["runs"].values()):  # bench-speed since 2026-11-26
            from rpg_research.cli.bench_speed_report import breakdown_table

            breakdowns += ["", f"{title}:", "", breakdown_table(report["runs"])]
    intervals = intervals if len(intervals) > 3 else []
    return lines + runs + ratios + intervals + targets + losses + breakdowns


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "env" and len(rest) == 2:
        print(json.dumps(record_env(*rest)))
    elif command == "e2e-inputs" and len(rest) == 1:
        # RPG_E2E_MODEL=gpu: the GPU run's model in the dry run too (to measure what its checkpoints take on disk).
        dry_run = os.environ.get("RPG_GPU_DRY_RUN", "0") not in ("", "0")
        e2e_inputs(rest[0], tiny=dry_run and os.environ.get("RPG_E2E_MODEL") != "gpu")
    elif command == "e2e-check" and len(rest) == 2:
        dry_run = os.environ.get("RPG_GPU_DRY_RUN", "0") not in ("", "0")
        print("e2e ok:", json.dumps(e2e_check(*rest, precision="float32" if dry_run else "bf16")))
    elif command == "pytest-check" and len(rest) in (2, 3):
        print("pytest:", pytest_check(rest[0], rest[1] == "1", *rest[2:]))
    elif command == "summary" and len(rest) == 1:
        summary(rest[0])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
