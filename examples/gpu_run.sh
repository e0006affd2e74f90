#!/usr/bin/env bash
# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
#
# The GPU run of rpg_trl (docs/benchmarks.md): run from the repository root on a machine with one CUDA GPU.
#
#   e2e       examples/rpg_math.py under `accelerate launch --num_processes 1`, transformers generation (no vLLM), on a
#             locally built ~0.5B Qwen3 (random weights, character tokenizer) and a small local math parquet in the
#             authors' (verl) schema: 20 steps with checkpoints at 10 and 20, then a resume from checkpoint-10 to 20;
#             checks that both logs show the RPG metrics (kl, clip_ratio/dual_mean, importance_weight/max).
#   tests     python -m pytest -q -m gpu tests/test_gpu.py (bf16 every divergence x estimator with gradient
#             checkpointing, LoRA with the "ref" adapter sync, DeepSpeed ZeRO-2 and ZeRO-3); fails if any test skips.
#   bench-1k, bench-4k
#             rpg-trl bench-speed --device cuda at 1024 / 4096 completion tokens, full fine-tuning and LoRA: tokens/s
#             and peak GPU memory of RPGTrainer against GRPOTrainer, side by side in one run each.
#
# Everything lands in the results folder (default gpu_results/<UTC date and time>): logs, JSON, pytest's JUnit XML,
# env.json (device, versions, date, commit) and summary.md (the tables of docs/benchmarks.md). --archive FILE also packs
# the folder into one .tar.gz (the device tool brings back at most 8 files: use --archive "$OUT/NAME.tar.gz").
#
# Usage:
#   bash examples/gpu_run.sh [--dry-run] [--stages e2e,tests,bench-1k,bench-4k] [--results DIR] [--archive FILE]
#                            [--bench-repeats N] [--bench-modes full,lora] [--wheels DIR]
#   bash examples/gpu_run.sh --fetch-wheels [--wheels DIR]
#
# --dry-run does the same on CPU with the tiny Qwen3 of rpg_trl.tools.toy and tiny lengths (the GPU tests through
# RPG_GPU_DRY_RUN=1, DeepSpeed skipped; bench-1k full and bench-4k LoRA only, unless --bench-modes is given): it proves
# the run works before a GPU is at hand.
#
# Carrying the packages. The lent GPU machine has PyTorch, CUDA, accelerate, transformers, peft, pytest, pandas and
# pyarrow, but no network, no vLLM and no trl, datasets, deepspeed or math-verify. On a machine with PyPI access:
#   bash examples/gpu_run.sh --fetch-wheels
# downloads into wheels/ (ignored by git) the wheels of trl, transformers, peft, datasets, math-verify and their missing
# requirements for Python 3.12 on x86-64 Linux, pinned to the versions installed here (the ones CI tests), and builds a
# deepspeed wheel (DeepSpeed publishes source only; DS_BUILD_OPS=0, its kernels compile on first use). Then hand the
# folder to the machine with the device tool's `carry` argument (about 20 MiB; the working tree travels with it, 64 MiB
# at most):
#   run(command="bash examples/gpu_run.sh --stages e2e --archive $OUT/e2e.tar.gz", carry=["wheels"], timeout_s=600)
# This script installs whatever wheels/ holds with `pip install --no-index --no-deps --target` into a temporary
# folder put first on PYTHONPATH, and puts the repository on PYTHONPATH (no install of rpg_trl needed). One command may
# run 10 minutes on the lent machine: run the stages in separate calls (docs/benchmarks.md lists them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DRY_RUN=0
FETCH=0
STAGES="e2e,tests,bench-1k,bench-4k"
RESULTS=""
ARCHIVE=""
WHEELS="wheels"
BENCH_REPEATS=""
BENCH_MODES="full,lora"
BENCH_MODES_SET=0
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"

usage() { sed -n '20,27p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --fetch-wheels) FETCH=1 ;;
        --stages) STAGES="$2"; shift ;;
        --results) RESULTS="$2"; shift ;;
        --archive) ARCHIVE="$2"; shift ;;
        --wheels) WHEELS="$2"; shift ;;
        --bench-repeats) BENCH_REPEATS="$2"; shift ;;
        --bench-modes) BENCH_MODES="$2"; BENCH_MODES_SET=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# ---------------------------------------------------------------------------------------------------------- wheels
fetch_wheels() {
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl  # one version of each: two stop the install
    # Pinned to the versions installed here. The GPU machine lacks trl, datasets, math-verify, deepspeed and their
    # requirements below; transformers and peft replace its own (the versions CI tests); its accelerate, tokenizers,
    # huggingface-hub, safetensors, pandas, pyarrow, psutil, msgpack, ninja, py-cpuinfo, einops, sympy, typer are used.
    local pins
    pins="$("$PY" - <<'EOF'
import importlib.metadata as m

names = ["trl", "transformers", "peft", "datasets", "dill", "multiprocess", "fsspec", "math-verify", "latex2sympy2_extended",
         "antlr4-python3-runtime", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson"]
for name in names:
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        print(name)
EOF
)"
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $pins
    DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "deepspeed==$DEEPSPEED_VERSION"
    # The install the GPU machine will do, for its Python 3.12 on x86-64, into a scratch folder: checks the tags.
    local scratch
    scratch="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$scratch" --python-version 3.12 \
        --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "$WHEELS"/*.whl
    rm -rf "$scratch"
    ls -l "$WHEELS"
    du -sh "$WHEELS"
}

if [[ $FETCH == 1 ]]; then
    fetch_wheels
    exit 0
fi

has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }
for stage in ${STAGES//,/ }; do
    case "$stage" in e2e | tests | bench-1k | bench-4k) ;; *) echo "gpu_run.sh: unknown stage $stage" >&2; exit 2 ;; esac
done

# ----------------------------------------------------------------------------------------------------- environment
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_DISABLED=true PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
if [[ -z "$RESULTS" ]]; then
    RESULTS="gpu_results/$([[ $DRY_RUN == 1 ]] && echo dry-run- || true)$STAMP"
fi
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/rpg-gpu-run.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [[ $DRY_RUN == 1 && ${#wheels[@]} -gt 0 ]]; then
    echo "Dry run: the installed packages are used; the wheels in $WHEELS (Python 3.12) are for the GPU machine"
    wheels=()
fi
if [[ ${#wheels[@]} -gt 0 ]]; then
    echo "Installing ${#wheels[@]} carried wheels from $WHEELS into $WORK/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "${wheels[@]}"
    export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $DRY_RUN == 1 ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RPG_GPU_DRY_RUN=1
    DEVICE=cpu
    BENCH_REPEATS="${BENCH_REPEATS:-1}"
else
    export DS_ACCELERATOR=cuda  # the carried deepspeed wheel was built on a machine without CUDA
    DEVICE=cuda
    BENCH_REPEATS="${BENCH_REPEATS:-1}"
fi

# Device, versions, date and commit; stops here if a package is missing or (GPU run) CUDA is not there.
"$PY" - "$RESULTS/env.json" "$DEVICE" <<'EOF'
import datetime, importlib, importlib.metadata as m, json, platform, subprocess, sys

path, device = sys.argv[1:3]
import torch

if device == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_run.sh: CUDA is not available here; use --dry-run for the CPU dry run.")
versions = {}
for name in ["torch", "transformers", "trl", "accelerate", "peft", "datasets", "math-verify", "deepspeed"]:
    try:
        versions[name] = m.version(name)
    except m.PackageNotFoundError:
        versions[name] = None
missing = [n for n, v in versions.items() if v is None and (n != "deepspeed" or device == "cuda")]
if missing:
    sys.exit(f"gpu_run.sh: missing packages {missing}: carry their wheels (bash examples/gpu_run.sh --fetch-wheels)")
for module in ["trl", "datasets", "math_verify", "rpg_trl"] + (["deepspeed"] if device == "cuda" else []):
    importlib.import_module(module)
try:  # the lent machine gets the working tree without .git, maybe without git
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
except OSError:
    commit = None
env = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
    "cuda": torch.version.cuda if device == "cuda" else None,
    "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None,
    "python": platform.python_version(),
    "versions": versions,
    "commit": commit,
}
open(path, "w").write(json.dumps(env, indent=2) + "\n")
print(json.dumps(env))
EOF
"$PY" -m pip check >"$RESULTS/pip_check.txt" 2>&1 || echo "note: pip check reports conflicts (see $RESULTS/pip_check.txt)"

# ------------------------------------------------------------------------------------------------------------ e2e
if has_stage e2e; then
    echo "== e2e: examples/rpg_math.py under accelerate launch, 20 steps, checkpoint, resume"
    # The model of tests/test_gpu.py (HALF_B, ~0.5B; the tiny one in the dry run) with a character tokenizer covering
    # the paper's prompt, and a math parquet in the authors' schema (the rows of tests/test_math_task_data.py's authors_row).
    "$PY" - "$WORK" <<'EOF'
import os, string, sys

sys.path.insert(0, "tests")
from rpg_trl.tools.toy import build_char_tokenizer, save_tiny_model
from test_math_task_data import authors_row, write_parquet
from test_gpu import MODEL_SIZES

work = sys.argv[1]
sizes = {**MODEL_SIZES, "max_position_embeddings": 1024}
save_tiny_model(os.path.join(work, "model"), tokenizer=build_char_tokenizer(string.printable), **sizes)
rows = [authors_row(f"What is {a}+{b}?", str(a + b), index=i) for i, (a, b) in
        enumerate((a, b) for a in range(1, 9) for b in range(1, 9))]
print("train file:", write_parquet(os.path.join(work, "math.parquet"), rows), len(rows), "rows")
EOF
    if [[ $DRY_RUN == 1 ]]; then
        launch=(--cpu --mixed_precision no)
        precision=(--use_cpu true --bf16 false --gradient_checkpointing true)
        completion=16
    else
        launch=(--mixed_precision bf16)
        precision=(--bf16 true --gradient_checkpointing true)
        completion=256
    fi
    train_args=(
        --model_name_or_path "$WORK/model" --train_dataset "$WORK/math.parquet" --eval_strategy no
        --max_steps 20 --per_device_train_batch_size 8 --num_generations 4 --steps_per_generation 2
        --max_completion_length "$completion" --overlong_buffer $((completion / 4)) --beta 1e-4
        --learning_rate 1e-5 --logging_steps 1 --save_strategy steps --save_steps 10 --report_to none
        --disable_tqdm true --seed 0 "${precision[@]}"
    )
    launcher=("$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --dynamo_backend no "${launch[@]}")
    "${launcher[@]}" examples/rpg_math.py "${train_args[@]}" --output_dir "$WORK/e2e" 2>&1 | tee "$RESULTS/e2e_train.log"
    "${launcher[@]}" examples/rpg_math.py "${train_args[@]}" --output_dir "$WORK/e2e_resumed" \
        --resume_from_checkpoint "$WORK/e2e/checkpoint-10" 2>&1 | tee "$RESULTS/e2e_resume.log"
    "$PY" - "$RESULTS" "$WORK" <<'EOF'
import ast, json, math, os, sys

results, work = sys.argv[1:3]


def logs(name):
    """The training steps' metric dicts the trainer printed (values as numbers)."""
    lines = open(os.path.join(results, name)).read().splitlines()
    dicts = [ast.literal_eval(line) for line in lines if line.startswith("{'") and "'loss'" in line]
    return [{k: float(v) for k, v in d.items()} for d in dicts]


train, resumed = logs("e2e_train.log"), logs("e2e_resume.log")
assert len(train) == 20, f"the run logged {len(train)} training steps, expected 20"
assert len(resumed) == 10, f"the resumed run logged {len(resumed)} steps, expected 10 (11 to 20)"
# Every step logs the loss and RPG's metrics; the reward is logged at the steps that generate (1 in 2 here).
keys = ["loss", "kl", "clip_ratio/dual_mean", "importance_weight/max", "entropy"]
for name, run in (("run", train), ("resumed run", resumed)):
    for key in keys + ["reward"]:
        values = [log[key] for log in run if key in log]
        expected = len(run) if key != "reward" else len(run) // 2
        assert len(values) == expected and all(math.isfinite(v) for v in values), (name, key, values)
checkpoint = os.path.join(work, "e2e", "checkpoint-10")
assert os.path.isfile(os.path.join(checkpoint, "rpg_generation_state.pt")), os.listdir(checkpoint)
assert os.path.isfile(os.path.join(work, "e2e_resumed", "model.safetensors"))
state = json.load(open(os.path.join(work, "e2e_resumed", "checkpoint-20", "trainer_state.json")))
assert state["global_step"] == 20, state["global_step"]
summary = {
    "steps": len(train),
    "resumed_steps": len(resumed),
    "metrics": keys,
    "last_step": {k: train[-1][k] for k in keys},
    "rewards": [log["reward"] for log in train if "reward" in log],
    # Exact resume (rpg_trl/reliability/generation_state.py): steps 11-20 of both runs train on the same batches.
    "loss_steps_11_20": [log["loss"] for log in train[10:]],
    "loss_steps_11_20_resumed": [log["loss"] for log in resumed],
    "max_abs_loss_difference_after_resume": max(abs(a["loss"] - b["loss"]) for a, b in zip(train[10:], resumed)),
}
json.dump(summary, open(os.path.join(results, "e2e_summary.json"), "w"), indent=2)
print("e2e ok:", json.dumps(summary))
EOF
fi

# ---------------------------------------------------------------------------------------------------------- tests
if has_stage tests; then
    echo "== tests: tests/test_gpu.py"
    if [[ $DRY_RUN == 1 ]]; then
        pytest_args=(tests/test_gpu.py)  # RPG_GPU_DRY_RUN=1: unmarked, on CPU with the tiny model
    else
        pytest_args=(-m gpu tests/test_gpu.py)
    fi
    "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$RESULTS/pytest_gpu.xml" "${pytest_args[@]}" 2>&1 |
        tee "$RESULTS/pytest_gpu.log"
    "$PY" - "$RESULTS/pytest_gpu.xml" "$DRY_RUN" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
print("pytest:", counts)
assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, counts
if sys.argv[2] != "1":  # on the GPU nothing may skip (DeepSpeed included)
    assert counts["skipped"] == 0, f"{counts['skipped']} GPU tests skipped: see pytest_gpu.log"
EOF
fi

# ---------------------------------------------------------------------------------------------------------- bench
bench() {  # bench LENGTH MODE
    local length="$1" mode="$2" name="bench_speed_${2}_${1}"
    local args=(--device "$DEVICE" --completion-length "$length" --repeats "$BENCH_REPEATS"
        --output-json "$RESULTS/$name.json")
    if [[ $DRY_RUN == 1 ]]; then
        args+=(--hidden-size 64 --num-layers 2 --batch-size 4 --num-generations 2 --steps 2 --warmup 2
            --loss-batch 8 --loss-length 256 --loss-repeats 2 --loss-warmup 1 --num-threads 1)
    else
        # ~0.44B parameters: hidden 1024 (16 heads, 8 KV heads, MLP 4096) x 28 layers; bf16, gradient checkpointing.
        args+=(--hidden-size 1024 --num-layers 28 --batch-size 8 --gradient-checkpointing)
    fi
    [[ $mode == lora ]] && args+=(--lora)
    echo "== $name: rpg-trl bench-speed ${args[*]}"
    "$PY" -m rpg_trl.tools.cli bench-speed "${args[@]}" 2>&1 | tee "$RESULTS/$name.md"
}
for stage in bench-1k bench-4k; do
    has_stage "$stage" || continue
    if [[ $DRY_RUN == 1 ]]; then length=$([[ $stage == bench-1k ]] && echo 16 || echo 64)
    else length=$([[ $stage == bench-1k ]] && echo 1024 || echo 4096); fi
    modes="$BENCH_MODES"
    if [[ $DRY_RUN == 1 && $BENCH_MODES_SET == 0 ]]; then  # each length and each mode once, to keep it short
        modes=$([[ $stage == bench-1k ]] && echo full || echo lora)
    fi
    for mode in ${modes//,/ }; do
        case "$mode" in full | lora) bench "$length" "$mode" ;; *) echo "gpu_run.sh: unknown mode $mode" >&2; exit 2 ;; esac
    done
done

# --------------------------------------------------------------------------------------------------------- report
# summary.md: the tables of docs/benchmarks.md's GPU section, from whatever this results folder holds.
"$PY" - "$RESULTS" <<'EOF'
import glob, json, os, sys

results = sys.argv[1]
env = json.load(open(os.path.join(results, "env.json")))
lines = [f"device: {env['device']}, CUDA {env['cuda']}, {env['date_utc']}, commit {env['commit']}",
         f"versions: {env['versions']}", ""]
path = os.path.join(results, "e2e_summary.json")
if os.path.exists(path):
    e2e = json.load(open(path))
    lines += [f"e2e: {e2e['steps']} steps + resume of {e2e['resumed_steps']}, last step {e2e['last_step']}, "
              f"max |loss difference| after resume {e2e['max_abs_loss_difference_after_resume']:.3g}", ""]
path = os.path.join(results, "pytest_gpu.log")
if os.path.exists(path):
    tail = [line for line in open(path).read().splitlines() if line.strip()][-1:]
    lines += [f"pytest: {tail[0] if tail else '?'}", ""]
files = sorted(glob.glob(os.path.join(results, "bench_speed_*.json")))
if files:
    lines += ["| completion tokens | training | run | step time (s) | tokens/s | peak memory (MiB) |",
              "|---|---|---|---|---|---|"]
    ratios = ["", "| completion tokens | training | comparison | step time ratio | peak memory ratio | "
              "peak memory saved (MiB) |", "|---|---|---|---|---|---|"]
    for path in files:
        report = json.load(open(path))
        s = report["settings"]
        mode = "LoRA" if s["lora"] else "full"
        for name, run in report["runs"].items():
            lines.append(f"| {s['completion_length']} | {mode} | {name} | {run['step_time_s']:.4f} | "
                         f"{run['tokens_per_s']:.0f} | {run['peak_memory_bytes'] / 2**20:.1f} |")
        for label, r in report["ratios"].items():
            ratios.append(f"| {s['completion_length']} | {mode} | {label} | {r['step_time']:.3f} | "
                          f"{r['peak_memory']:.3f} | {r['peak_memory_saved_bytes'] / 2**20:.1f} |")
    lines += ratios
open(os.path.join(results, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

if [[ -n "$ARCHIVE" ]]; then
    mkdir -p "$(dirname "$ARCHIVE")"
    tar czf "$ARCHIVE" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    echo "Archived the results into $ARCHIVE"
fi
echo "Results: $RESULTS (summary.md, env.json, logs, JSON)"
