#!/usr/bin/env bash
# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
#
# Everything research/gpu/gpu_run.sh's GPU calls need done before the first device call (research/docs/benchmarks.md,
# "The third run's plan"), each step timed, so that the first minutes with a GPU machine go to the run itself:
#
#   bash research/gpu/gpu_prepare.sh [--python PY] [--seeds 0,1,2,3,4,5] [--workers N] [--image-python PY312]
#                                    [--skip-wheels] [--skip-warm-starts] [--out DIR]
#
#   wheels       gpu_run.sh --fetch-wheels with PY (the environment CI tests, deepspeed installed: default
#                $PYTHON, else python3): the carried wheels in wheels/ (ignored by git)
#   warm starts  gpu_learn.py warm-starts gpu_warm_starts --seeds SEEDS (the demo's 1500 supervised steps, on CPU,
#                --workers processes, default the CPUs here), then the learning stage's own command
#                (gpu_run.sh's: --device cpu --workers 6 --eval-problems 400) again, which must reuse every one of
#                them: on the GPU machine it then costs seconds, not a warm start's 30-60 s of its deadline
#   size         what each call sends against the device tool's 64 MiB: the tree (`git ls-files -co
#                --exclude-standard`, what `run` sends besides `carry`), wheels/ (both calls) and gpu_warm_starts/
#                (call 1); stops if either call is over
#   dry run      with --image-python (research/gpu/gpu_image_env.sh's venv, built like the GPU image): gpu_run.sh
#                --dry-run on a copy of the commit (`git archive HEAD`, outside the repository: the commit's files, not
#                the working tree's edits) with the carried wheels installed as on the GPU; its stages.tsv printed
#
# Each step's seconds go to OUT/prepare_times.tsv (default gpu_results/prepare-<UTC date and time>, ignored by git),
# the logs beside it, and the two device calls are printed with the commit filled in. A working tree that differs
# from the commit (`git status --porcelain`) is named: the device tool sends the working tree, so send it clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SEEDS="0,1,2,3,4,5"
WORKERS="$(nproc 2>/dev/null || echo 2)"
IMAGE_PY=""
DO_WHEELS=1
DO_WARM=1
OUT=""
LIMIT_BYTES=$((64 * 1024 * 1024))
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) PY="$2"; shift ;;
        --seeds) SEEDS="$2"; shift ;;
        --workers) WORKERS="$2"; shift ;;
        --image-python) IMAGE_PY="$2"; shift ;;
        --skip-wheels) DO_WHEELS=0 ;;
        --skip-warm-starts) DO_WARM=0 ;;
        --out) OUT="$2"; shift ;;
        -h | --help) sed -n '4,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_prepare.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
OUT="${OUT:-gpu_results/prepare-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TIMES="$OUT/prepare_times.tsv"
printf 'step\tseconds\tstatus\n' >"$TIMES"
COMMIT="$(git rev-parse HEAD)"
echo "Commit $COMMIT; logs and times in $OUT"

# step NAME LOG CMD...: CMD's output to LOG (and shown), its wall seconds and exit status to prepare_times.tsv; the
# script stops at the first step that fails.
step() {
    local name="$1" log="$2" start rc seconds
    shift 2
    echo "== $name: $*"
    start=$(date +%s%N)
    set +e
    "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    seconds=$((($(date +%s%N) - start) / 1000000))
    seconds="$((seconds / 1000)).$((seconds % 1000 / 100))"
    printf '%s\t%s\t%s\n' "$name" "$seconds" "$rc" >>"$TIMES"
    echo "== $name: $seconds s, exit status $rc"
    if ((rc != 0)); then echo "gpu_prepare.sh: $name failed (log: $log)" >&2; exit "$rc"; fi
}

# The check of the warm starts: the learning stage's own command must reuse every seed, its result.json as its
# weights untouched (run_jobs reuses a job whose result.json records the same spec; a changed spec trains again).
reuse_check() {
    local before after seed n=0
    for seed in ${SEEDS//,/ }; do
        [[ -f gpu_warm_starts/seed$seed/result.json ]] || { echo "no warm start of seed $seed"; return 1; }
        n=$((n + 1))
    done
    before="$(stat -c '%n %Y' gpu_warm_starts/seed*/model.safetensors gpu_warm_starts/seed*/result.json)"
    "$PY" research/gpu/gpu_learn.py warm-starts gpu_warm_starts --seeds "$SEEDS" --eval-problems 400 --device cpu \
        --workers 6 || return 1
    after="$(stat -c '%n %Y' gpu_warm_starts/seed*/model.safetensors gpu_warm_starts/seed*/result.json)"
    if [[ "$before" != "$after" ]]; then echo "the learning stage's command trained warm starts again"; return 1; fi
    echo "all $n warm starts reused by the learning stage's command"
}

# sizes: the bytes each call sends, and the check against the device tool's limit.
sizes() {
    "$PY" - "$LIMIT_BYTES" <<'EOF'
import os
import subprocess
import sys

limit = int(sys.argv[1])
listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True).stdout
files = [f for f in listed.decode().split("\0") if f and os.path.isfile(f)]
tree = sum(os.path.getsize(f) for f in files)


def folder(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


wheels, warm = folder("wheels"), folder("gpu_warm_starts")
mib = 1024 * 1024
print(f"tree {tree / mib:.1f} MiB ({len(files)} files), wheels/ {wheels / mib:.1f} MiB, gpu_warm_starts/ {warm / mib:.1f} MiB")
over = False
for call, total in (("call 1 (tree + wheels + warm starts)", tree + wheels + warm), ("call 2 (tree + wheels)", tree + wheels)):
    print(f"{call}: {total / mib:.1f} MiB of {limit / mib:.0f} MiB")
    over |= total >= limit
sys.exit(1 if over else 0)
EOF
}

# dry_run: gpu_run.sh --dry-run on the commit's own files, with the carried wheels, in the emulated image's Python.
dry_run() {
    local tree="$OUT/tree" rc=0
    rm -rf "$tree"
    mkdir -p "$tree"
    git archive HEAD | tar -x -C "$tree" || return 1
    (
        cd "$tree" &&
            OMP_NUM_THREADS=1 RPG_COMMIT="$COMMIT" PYTHON="$IMAGE_PY" bash research/gpu/gpu_run.sh --dry-run \
                --wheels "$ROOT/wheels" --results "$OUT/dry-run" --archive "$OUT/dry-run.tar.gz"
    ) || rc=$?
    rm -rf "$tree"
    cat "$OUT/dry-run/stages.tsv" 2>/dev/null
    return "$rc"
}

if [[ $DO_WHEELS == 1 ]]; then
    step wheels "$OUT/wheels.log" env PYTHON="$PY" bash research/gpu/gpu_run.sh --fetch-wheels
fi
if [[ $DO_WARM == 1 ]]; then
    step warm-starts "$OUT/warm_starts.log" "$PY" research/gpu/gpu_learn.py warm-starts gpu_warm_starts --seeds "$SEEDS" \
        --workers "$WORKERS"
fi
if [[ -d gpu_warm_starts ]]; then step warm-starts-reused "$OUT/warm_starts_reused.log" reuse_check; fi
step size "$OUT/size.log" sizes
if [[ -n "$IMAGE_PY" ]]; then step dry-run "$OUT/dry_run.log" dry_run; fi

echo
column -t "$TIMES" 2>/dev/null || cat "$TIMES"
if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
    echo "note: the working tree differs from $COMMIT (git status); the device tool sends the working tree: commit first"
fi
cat <<EOF

The two device calls (research/docs/benchmarks.md, "The third run's plan"), back to back:
run(command="RPG_COMMIT=$COMMIT bash research/gpu/gpu_run.sh --stages learn+tests+e2e --results gpu_results/call1 --archive \$OUT/call1.tar.gz",
    carry=["wheels", "gpu_warm_starts"], timeout_s=250)
run(command="RPG_COMMIT=$COMMIT bash research/gpu/gpu_run.sh --stages bench-4k,bench-1k --results gpu_results/call2 --archive \$OUT/call2.tar.gz",
    carry=["wheels"], timeout_s=535)
EOF
