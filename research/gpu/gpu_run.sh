#!/usr/bin/env bash
# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
#
# The GPU run of rpg_trl (research/docs/benchmarks.md): run from the repository root on a machine with one CUDA GPU.
#
#   learn     research/gpu/gpu_learn.py: a model that learns, RPG beside GRPO. The demo's warm starts (seeds 0-5; carried
#             in gpu_warm_starts/ or built here on CPU), each trained by RPG's default and by GRPOTrainer (beta 1e-4,
#             the same reference), LoRA (lr 1e-3; full fine-tuning too with --learn-modes lora,full), 400 steps (the
#             demo's): 12 runs at once on the GPU (one process each), held-out mean@4 and greedy accuracy before,
#             during and after; each run's result.json as it ends; learning.md, learning.json and learning_curves.png
#             (where matplotlib is).
#   e2e       examples/rpg_math.py (through research/gpu/e2e_train.py, which runs it unchanged and notes a digest of
#             each step's batch) under `accelerate launch --num_processes 1`, transformers generation (no vLLM), on a
#             locally built ~31M-parameter Qwen3 (hidden 512 x 8 layers, random weights, character tokenizer; the tiny
#             one in the dry run) and a small local math parquet in the authors' (verl) schema: 20 steps with
#             checkpoints at 10 and 20 (and the same run again, beside it: the yardstick of the resume, as two runs
#             with one seed may differ on a GPU), then a resume from checkpoint-10 to 20; checks that the logs show the
#             RPG metrics (kl, clip_ratio/dual_mean, importance_weight/max) at every step, and judges the resume
#             (e2e_summary.json's resume_verdict, the rule at research/gpu/gpu_stages.py's RELATIVE): the same batches
#             and generation metrics at steps 11-20, the losses within the repeat's spread or bf16's rounding (exact to
#             float32's in the dry run); a failed verdict fails the stage.
#   tests     python -m pytest -v -m gpu tests/test_gpu.py on a ~0.5B Qwen3 (DeepSpeed ZeRO-2 and ZeRO-3 under
#             `accelerate launch` first, then bf16 every divergence x estimator with gradient checkpointing, the reward
#             rising, LoRA with the "ref" adapter sync), each test's seconds shown as it ends and written as it ends
#             to pytest_gpu_times.jsonl (research/gpu/pytest_times.py: what a cut leaves), each test's limit and the
#             launches' kept inside the stage's deadline; fails if any test skips or did not finish.
#   bench-1k, bench-4k
#             rpg-trl bench-speed --device cuda at 1024 / 4096 completion tokens, full fine-tuning and LoRA, on a ~0.6B
#             Qwen3 with Qwen3's vocabulary (151,936; random weights, fixed synthetic completions: generation not
#             timed), its weights in bf16 as users load them: at 1024 tokens 4 repeats of the 4 runs (GRPO twice, the
#             A/A pair, and both RPG anchors) in a Williams design (each run first once), 8 timed steps a run after
#             2, each ratio with its 95 % interval, the JSON written after each repeat; at 4096 (LoRA only unless
#             --bench-modes is given) one repeat of GRPO and both RPG anchors, 4 timed steps after 2; the loss alone
#             (c) once, paired rounds with their interval and what each loss dispatches; one saved model for both
#             stages, removed at exit. bench-4k runs first.
#   long      the fourth protocol's GPU-sized variant (research/docs/bench_algos.md, long completions): rpg-trl bench-algos
#             --task long_addition with the "large" model (13.8M parameters), the warm start of seed 4000, then GRPO
#             and RPG sequence (kl_level="sequence") at learning rate 3e-4, 32 steps each, 16 per generation, both at
#             once on the GPU; one seed, not a comparison. In a call of its own (`--stages long`, at most 5 minutes).
#
# --stages lists groups, in order, joined by ","; the stages of a group, joined by "+", run at the same time (none of
# them a timing: the bench stages run alone): `--stages learn+tests+e2e` runs the three side by side, `--stages
# bench-1k,bench-4k` one after the other. The groups run in the order of their earliest stage in learn, e2e, tests,
# bench-4k, bench-1k, long, whatever the order given. Each stage runs under its own deadline (--limits; defaults
# below; counted from its group's start), gets its own line in stages.tsv and fails alone; beside others its output
# goes to NAME.console.log. The results are summarised and archived as each stage ends and at exit (a TERM included: the
# stages still running are ended, exit status 143), and the archive is rewritten every 20 s while the call runs
# (RPG_GPU_ARCHIVE_EVERY) and as each learning run ends, always whole (written aside, then renamed), so that a call
# killed outright (the device tool's per-command limit) brings back all but the last 20 s. Everything lands in the
# results folder
# (default gpu_results/<UTC date and time>): image.json (the versions found before anything is installed), env.json
# (device, driver, CUDA, versions, date, commit), stages.tsv (each stage's exit status, seconds and deadline), logs,
# JSON, pytest's JUnit XML and summary.md (the tables of research/docs/benchmarks.md). --archive FILE packs the folder into one
# .tar.gz (the device tool brings back files written under $OUT: use --archive "$OUT/NAME.tar.gz").
#
# Usage:
#   bash research/gpu/gpu_run.sh [--dry-run] [--stages learn+tests+e2e,bench-1k,bench-4k,long] [--results DIR]
#                            [--archive FILE]
#                            [--bench-repeats N] [--bench-modes full,lora] [--wheels DIR] [--limits STAGE=S,...]
#                            [--learn-seeds 0,1,2,3,4,5] [--learn-modes lora[,full]]
#   bash research/gpu/gpu_run.sh --fetch-wheels [--wheels DIR]
#
# --dry-run does the same on CPU with the tiny Qwen3 of rpg_research.toy and tiny lengths (the learning runs a few
# steps from a short warm start of seed 0, the GPU tests through RPG_GPU_DRY_RUN=1, DeepSpeed skipped; bench-1k full and
# bench-4k LoRA only, unless --bench-modes is given, a 512-row vocabulary, one repeat), with the
# carried wheels installed exactly as on the GPU machine: run it with a Python 3.12 built like the GPU image
# (research/gpu/gpu_image_env.sh builds one: PYTHON=DIR/bin/python bash research/gpu/gpu_run.sh --dry-run), or with
# --wheels '' to use the packages installed here instead.
#
# Carrying the packages. The lent GPU machine has PyTorch, CUDA, accelerate, transformers, peft, pytest, pandas and
# pyarrow, but no network, no vLLM and no trl, datasets, deepspeed or math-verify. On a machine with PyPI access, in
# the environment CI tests (pip install -e ".[deepspeed,test]"):
#   bash research/gpu/gpu_run.sh --fetch-wheels
# downloads into wheels/ (ignored by git) the wheels of research/gpu/gpu_wheels.py's CARRIED list for Python 3.12 on
# x86-64 Linux, each pinned to the version installed here (a package missing here stops the fetch), the fallback
# datasets wheels of its FALLBACKS into wheels/fallback/ (for an image whose pyarrow is older than the carried datasets
# needs: chosen at run time), and builds a deepspeed wheel at the version installed here (DeepSpeed publishes source
# only; DS_BUILD_OPS=0, its kernels compile on first use). Hand the folder to the machine with the device tool's
# `carry` argument (about 22 MiB; the working tree travels with it, 64 MiB at most); research/docs/benchmarks.md gives the two
# calls. This script installs the chosen wheels with `pip install --no-index --no-deps --target` into a temporary
# folder put first on PYTHONPATH, and puts the repository and research/ on PYTHONPATH (no install of rpg_trl or rpg_research needed).
# research/gpu/gpu_prepare.sh does every step before the first device call (the wheels, the warm starts, the size
# of each call, the dry run), each timed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DRY_RUN=0
FETCH=0
STAGES="learn+tests+e2e,bench-4k,bench-1k"
RESULTS=""
ARCHIVE=""
WHEELS="wheels"
BENCH_REPEATS=""
BENCH_MODES="full,lora"
BENCH_MODES_SET=0
LIMITS=""
LEARN_SEEDS="0,1,2,3,4,5"
LEARN_MODES="lora"

usage() { sed -n '/^# Usage:/,/^#   bash .* --fetch-wheels/p' "$0" | sed 's/^# \{0,1\}//'; }

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
        --limits) LIMITS="$2"; shift ;;
        --learn-seeds) LEARN_SEEDS="$2"; shift ;;
        --learn-modes) LEARN_MODES="$2"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# ---------------------------------------------------------------------------------------------------------- wheels
PLATFORMS=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch_wheels() {
    local pins tier ds_version scratch
    # Pinned to the versions installed here (the ones CI tests); a package missing here stops the fetch.
    pins="$("$PY" research/gpu/gpu_wheels.py pins)"
    ds_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null)" || {
        echo "gpu_run.sh: deepspeed is not installed in $PY: the carried wheel is built at the version CI tests" \
            "(pip install -e '.[deepspeed,test]')" >&2
        exit 1
    }
    rm -rf "$WHEELS"/*.whl "$WHEELS/fallback"  # one version of each: two stop the install
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$WHEELS" $pins
    for tier in $("$PY" research/gpu/gpu_wheels.py fallback-tiers); do
        # shellcheck disable=SC2046
        "$PY" -m pip download --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$WHEELS/fallback/$tier" \
            $("$PY" research/gpu/gpu_wheels.py fallback-pins "$tier")
    done
    # DeepSpeed publishes source only. Built in pip's isolated build environment (setuptools and wheel fetched for
    # it), so that a fresh machine builds it too (with --no-build-isolation it needs `wheel` installed here).
    DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-cache-dir -w "$WHEELS" "deepspeed==$ds_version"
    # The install the GPU machine will do, for its Python 3.12 on x86-64, into a scratch folder: checks the tags.
    scratch="$(mktemp -d)"
    for tier in main $("$PY" research/gpu/gpu_wheels.py fallback-tiers); do
        # shellcheck disable=SC2046
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$scratch/$tier" --only-binary=:all: \
            "${PLATFORMS[@]}" $("$PY" research/gpu/gpu_wheels.py tier "$WHEELS" "$tier")
    done
    rm -rf "$scratch"
    ls -l "$WHEELS" "$WHEELS"/fallback/*
    du -sh "$WHEELS"
}

if [[ $FETCH == 1 ]]; then
    fetch_wheels
    exit 0
fi

# --stages: groups in order, joined by ","; the members of a group, joined by "+", run at once.
has_stage() { [[ ",${STAGES//+/,}," == *",$1,"* ]]; }
group_of() {  # group_of STAGE: the members of STAGE's group, one a line
    local group
    for group in ${STAGES//,/ }; do
        if [[ "+$group+" == *"+$1+"* ]]; then printf '%s\n' ${group//+/ }; fi
    done
}
declare -A SEEN
for group in ${STAGES//,/ }; do
    for stage in ${group//+/ }; do
        case "$stage" in learn | e2e | tests | bench-1k | bench-4k | long) ;; *) echo "gpu_run.sh: unknown stage $stage" >&2; exit 2 ;; esac
        [[ -z ${SEEN[$stage]+x} ]] || { echo "gpu_run.sh: stage $stage given twice" >&2; exit 2; }
        SEEN[$stage]=1
        # The bench stages time: beside another stage their figures would measure the sharing.
        if [[ $group == *+* && $stage == bench-* ]]; then
            echo "gpu_run.sh: $stage times steps: it runs alone, not in a group ($group)" >&2
            exit 2
        fi
    done
done

# ------------------------------------------------------------------------------------------------------ deadlines
# Seconds per stage, `setup` included (the install and the checks before the first stage), each counted from the start
# of the stage's group. On the GPU, the third run's plan (research/docs/benchmarks.md, "The third run's plan", where
# each figure's measured basis and margin are given, with the raw file it comes from): setup 45 s (29 s at most
# measured), learn+tests+e2e 180 s side by side (about 150 s estimated: learn 117 s alone with 12 runs, tests 117 s,
# e2e 76 s), bench-4k 100 s (LoRA only: about 83 s estimated), bench-1k 365 s (8 timed steps a run: about 318 s
# estimated). Calls of `timeout_s` 250 and 535 (each 25 s after its deadlines for a cut stage's 10 s kill, the summary
# and the archive: 17 s at most measured), with the machine's start, the transfers and the give-back (75 s counted;
# 53 s and 45 s in the first two runs): 860 s of the session's 900, 40 s left. The dry run on 2 CPU cores takes
# longer. --limits learn=200,tests=300 overrides some.
declare -A LIMIT
if [[ $DRY_RUN == 1 ]]; then
    LIMIT=([setup]=300 [learn]=900 [e2e]=600 [tests]=900 [bench-1k]=900 [bench-4k]=600 [long]=900)
else
    LIMIT=([setup]=45 [learn]=180 [e2e]=180 [tests]=180 [bench-1k]=365 [bench-4k]=100 [long]=240)
fi
for item in ${LIMITS//,/ }; do
    [[ $item == *=* && -n ${LIMIT[${item%%=*}]+x} ]] || { echo "gpu_run.sh: bad --limits entry $item" >&2; exit 2; }
    LIMIT[${item%%=*}]="${item#*=}"
done
DEADLINE=0  # set by run_member, in each stage's own subshell
# limited CMD...: runs CMD (and its children) until the current stage's deadline; 124 when it is cut short. Its
# `timeout` leads a process group of its own, outside its stage's: its PID is noted for the end of the run (finish).
limited() {
    local left=$((DEADLINE - $(date +%s))) pid
    if ((left <= 0)); then echo "gpu_run.sh: the stage's deadline has passed before: $*" >&2; return 124; fi
    timeout --kill-after=10 "$left" "$@" <&0 &
    pid=$!
    echo "$pid" >>"$WORK/limited.pids"
    wait "$pid"
}

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
FAILED=()

# archive: the results folder packed into --archive FILE, atomically: tar writes a name of this process's own beside it
# (same folder, so the rename is atomic), then renames it over FILE, so that FILE is always a whole archive, whichever
# process (the run, the refresh loop below) wrote it last and whenever the run is killed. With stages still running
# beside, a file may change while tar reads it: tar says so with exit status 1 and the archive holds the rest (the
# next one takes it again).
archive() {
    [[ -n "$ARCHIVE" ]] || return 0
    local rc=0 part
    part="$(dirname "$ARCHIVE")/.$(basename "$ARCHIVE").$BASHPID.part"
    tar czf "$part" --warning=no-file-changed -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" 2>/dev/null || rc=$?
    if ((rc <= 1)); then mv -f "$part" "$ARCHIVE"; else rm -f "$part"; fi
}
# report: summary.md from whatever the results folder holds, then the archive (at each stage's end and at exit).
report() {
    "$PY" research/gpu/gpu_stages.py summary "$RESULTS" || true
    archive
}
# refresh_archive: in the background while the run lasts (ended by finish), the archive rewritten every ARCHIVE_EVERY
# seconds (RPG_GPU_ARCHIVE_EVERY, default 20) and within 2 s of each learning run's end (a new result.json),
# so that a call killed at the device tool's per-command limit (SIGKILL to everything: no trap runs) loses at most the
# last interval: results within a stage come back as they are written, not only when the stage ends.
ARCHIVE_EVERY="${RPG_GPU_ARCHIVE_EVERY:-20}"
refresh_archive() {
    local last=0 runs seen="" now poll=2 sleeper
    ((ARCHIVE_EVERY < poll)) && poll=$ARCHIVE_EVERY
    trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
    while :; do
        now=$(date +%s)
        runs="$(find "$RESULTS" -name result.json 2>/dev/null | wc -l)" || true
        if ((now - last >= ARCHIVE_EVERY)) || [[ $runs != "$seen" ]]; then
            archive
            last=$now
            seen=$runs
        fi
        sleep "$poll" &
        sleeper=$!
        wait "$sleeper"
    done
}
REFRESH_PID=""
stop_refresh() {
    [[ -n "$REFRESH_PID" ]] || return 0
    kill -TERM "$REFRESH_PID" 2>/dev/null || true
    wait "$REFRESH_PID" 2>/dev/null || true
    REFRESH_PID=""
}
# descendants PID: the processes below PID, from /proc (the image may lack procps).
descendants() {
    cat /proc/[0-9]*/stat 2>/dev/null | awk -v root="$1" '
        { i = match($0, /\) [A-Za-z] -?[0-9]+/); split(substr($0, i + 2), f, " "); parent[$1] = f[2] }
        END {
            n = 1; todo[1] = root
            while (n) { p = todo[n--]; for (c in parent) if (parent[c] == p) { print c; todo[++n] = c } }
        }'
}
# stop_running: ends the stages still running (a TERM to the run, or its exit on an error): SIGTERM to every process
# below this shell and to the `timeout`s of `limited` (in process groups of their own, which pass it on to theirs,
# and may outlive a killed stage), SIGKILL to what is left after 10 s; each such stage gets exit status 143 in
# stages.tsv.
stop_running() {
    local name pids=() alive=() pid waited
    ((${#MEMBER_PID[@]})) || return 0
    echo "gpu_run.sh: ending the stages still running: ${!MEMBER_PID[*]}" >&2
    mapfile -t pids < <(descendants $$)
    if [[ -f "$WORK/limited.pids" ]]; then
        while read -r pid; do
            [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == timeout ]] && pids+=("$pid")
        done <"$WORK/limited.pids"
    fi
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((waited = 0; waited < 20; waited++)); do
        alive=()
        for pid in "${pids[@]}"; do if [[ -e /proc/$pid ]]; then alive+=("$pid"); fi; done
        ((${#alive[@]})) || break
        sleep 0.5
    done
    if ((${#alive[@]})); then kill -KILL "${alive[@]}" 2>/dev/null || true; fi
    for name in "${!MEMBER_PID[@]}"; do
        wait "${MEMBER_PID[$name]}" 2>/dev/null || true
        record_member "$name" 143
    done
}
finish() {
    local rc=$?
    trap - EXIT
    trap '' TERM INT  # the end of the run itself (its stages have their own)
    stop_refresh
    stop_running
    report
    cat "$RESULTS/summary.md" 2>/dev/null || true
    rm -rf "$WORK"
    [[ -n "$ARCHIVE" ]] && echo "Archived the results into $ARCHIVE"
    echo "Results: $RESULTS (summary.md, stages.tsv, env.json, logs, JSON)"
    if ((${#FAILED[@]})); then echo "gpu_run.sh: failed stages: ${FAILED[*]}" >&2; exit 1; fi
    exit "$rc"
}
declare -A MEMBER_PID MEMBER_START
trap finish EXIT
trap 'exit 143' TERM INT

# run_member NAME START: stage NAME in a background subshell under set -e, with its own deadline, START plus its
# --limits entry (`limited` reads DEADLINE; the GPU tests read RPG_STAGE_DEADLINE: tests/test_gpu.py's launches and
# research/gpu/pytest_times.py's per-test limit). Not to be called where set -e is ignored (after || or in an if
# condition), which would ignore it inside the stage too.
run_member() {
    local name="$1"
    MEMBER_START[$name]="$2"
    (
        DEADLINE=$(($2 + LIMIT[$name]))
        export RPG_STAGE_DEADLINE=$DEADLINE
        case "$name" in
            setup) stage_setup ;;
            learn) stage_learn ;;
            e2e) stage_e2e ;;
            tests) stage_tests ;;
            long) stage_long ;;
            bench-1k | bench-4k)
                if [[ $DRY_RUN == 1 ]]; then BENCH_LENGTH=$([[ $name == bench-1k ]] && echo 16 || echo 64)
                else BENCH_LENGTH=$([[ $name == bench-1k ]] && echo 1024 || echo 4096); fi
                stage_bench ;;
        esac
    ) &
    MEMBER_PID[$name]=$!
}
# record_member NAME STATUS: its line in stages.tsv (seconds from its group's start), a failure in FAILED too.
record_member() {
    local name="$1" rc="$2" seconds
    seconds=$(($(date +%s) - MEMBER_START[$name]))
    unset "MEMBER_PID[$name]"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "${LIMIT[$name]}" >>"$RESULTS/stages.tsv"
    if ((rc != 0)); then
        FAILED+=("$name")
        echo "gpu_run.sh: stage $name failed after $seconds s (exit status $rc$([[ $rc == 124 ]] &&
            echo ': deadline reached'))" >&2
    fi
}
# run_group NAME...: the stages at once (one: as a sequence of groups runs them), each recorded, summarised and
# archived as it ends, whatever the others do. Beside others a stage's output goes to NAME.console.log (its own logs as
# alone), shown here in part if it fails.
run_group() {
    local start name rc
    start=$(date +%s)
    for name in "$@"; do
        echo "== $name (deadline ${LIMIT[$name]} s$( (($# > 1)) && echo ", beside $*: output in $name.console.log"))"
        if (($# > 1)); then
            run_member "$name" "$start" >"$RESULTS/$name.console.log" 2>&1
        else
            run_member "$name" "$start"
        fi
    done
    # Polled (each ended stage is reaped by bash, so `kill -0` fails): a TERM waits half a second at most.
    while ((${#MEMBER_PID[@]})); do
        sleep 0.5
        for name in "${!MEMBER_PID[@]}"; do
            kill -0 "${MEMBER_PID[$name]}" 2>/dev/null && continue
            rc=0
            wait "${MEMBER_PID[$name]}" || rc=$?
            record_member "$name" "$rc"
            if (($# > 1)); then
                echo "== $name ended: exit status $rc after $(($(date +%s) - start)) s"
                if ((rc != 0)); then tail -n 30 "$RESULTS/$name.console.log" | sed "s/^/[$name] /" >&2; fi
            fi
            report
        done
    done
}

stage_setup() {
    # The image's own versions first, before anything is installed (pyarrow, regex and peft decide what fits).
    "$PY" research/gpu/gpu_wheels.py versions "$RESULTS/image.json"
    if [[ -n "$WHEELS" && -d "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
        local pyver
        pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        if [[ $pyver != 3.12 ]]; then
            echo "gpu_run.sh: the wheels in $WHEELS are for Python 3.12 (the GPU image); $PY is Python $pyver." \
                "Build the image's environment (bash research/gpu/gpu_image_env.sh) and run with PYTHON=ITS/bin/python," \
                "or give --wheels '' to use the packages installed here" >&2
            return 1
        fi
        local chosen
        mapfile -t chosen < <("$PY" research/gpu/gpu_wheels.py choose "$WHEELS")
        ((${#chosen[@]})) || return 1
        echo "Installing ${#chosen[@]} carried wheels from $WHEELS into $WORK/site"
        printf '%s\n' "${chosen[@]##*/}" >"$RESULTS/wheels_installed.txt"
        limited "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "${chosen[@]}"
    else
        echo "No carried wheels (--wheels '$WHEELS'): the packages installed for $PY are used"
    fi
    # rpg_trl's torch requirement (setup.cfg's floor), resolved by pip against the image's torch with no index, as
    # `pip install rpg_trl` resolves it on a user's machine: the floor is the oldest torch CI tests (.ci/torch_floor)
    # and the image's torch meets it, so pip keeps that torch; a floor above it stops the run here (pip would replace
    # a user's torch). The carried wheels go in with --no-deps only because --target ignores what is installed.
    local floor
    floor="$(sed -n 's/^ *\(torch>=[0-9.]*\) *$/\1/p' setup.cfg)"
    limited "$PY" -m pip install --no-index --no-cache-dir "$floor" | tee "$RESULTS/torch_floor.txt"
    # Device, driver, versions, date and commit; stops here if a package is missing or (GPU run) CUDA is not there.
    limited "$PY" research/gpu/gpu_stages.py env "$RESULTS/env.json" "$DEVICE"
    "$PY" -m pip check >"$RESULTS/pip_check.txt" 2>&1 || echo "note: pip check reports conflicts (see $RESULTS/pip_check.txt)"
}

if [[ $DRY_RUN == 1 ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RPG_GPU_DRY_RUN=1
    DEVICE=cpu
else
    export DS_ACCELERATOR=cuda  # the carried deepspeed wheel was built on a machine without CUDA
    DEVICE=cuda
fi
# The carried wheels go to $WORK/site (setup), first on the path; then the repository (no install of rpg_trl needed).
export PYTHONPATH="$WORK/site:$ROOT:$ROOT/research${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------------------------------------------------- learn
stage_learn() {
    # The warm starts: carried (gpu_warm_starts/, built on CPU with `python research/gpu/gpu_learn.py warm-starts
    # gpu_warm_starts`: reused when their settings match) or built here, on CPU, one process per seed.
    local warm="$WORK/warm_starts" sizes
    if [[ $DRY_RUN == 1 ]]; then
        sizes=(--seeds 0 --eval-problems 16)
        limited "$PY" research/gpu/gpu_learn.py warm-starts "$warm" "${sizes[@]}" --sft-steps 30 --sft-extra-rounds 0
        limited "$PY" research/gpu/gpu_learn.py train "$warm" "$RESULTS" "${sizes[@]}" --device cpu --steps 4 \
            --eval-every 2 --workers 2 2>&1 | tee "$RESULTS/learn.log"
    else
        # LoRA first (the card's own use), 6 seeds x RPG and GRPO = 12 runs at once, as many as the second run's 12 (117
        # s alone): 6 seeds so that the 95 % interval of the greedy-accuracy change can exclude zero if the effect is the
        # CPU sweep's (research/docs/benchmarks.md, "How many seeds"); full fine-tuning (--learn-modes lora,full: 12 runs
        # more) repeats the second run's configuration and does not fit the plan's 15 minutes beside it.
        sizes=(--seeds "$LEARN_SEEDS" --eval-problems 400)
        if [[ -d gpu_warm_starts ]]; then warm="$ROOT/gpu_warm_starts"; fi
        limited "$PY" research/gpu/gpu_learn.py warm-starts "$warm" "${sizes[@]}" --device cpu --workers 6
        limited "$PY" research/gpu/gpu_learn.py train "$warm" "$RESULTS" "${sizes[@]}" --device cuda --steps 400 \
            --eval-every 50 --modes "$LEARN_MODES" --workers 12 2>&1 | tee "$RESULTS/learn.log"
    fi
}

# ------------------------------------------------------------------------------------------------------------ e2e
stage_e2e() {
    # A ~31M-parameter Qwen3 (the tiny one in the dry run) with a character tokenizer covering the paper's prompt, and
    # a math parquet in the authors' schema (the rows of tests/test_math_task_data.py's authors_row). Small, so that
    # what the two runs write (three checkpoints of 378 MB, two final models) stays near 1.4 GB (22 GB at 0.5B); the
    # 0.5B model is tests/test_gpu.py's.
    limited "$PY" research/gpu/gpu_stages.py e2e-inputs "$WORK"
    local launch precision completion
    if [[ $DRY_RUN == 1 ]]; then
        launch=(--cpu --mixed_precision no)
        precision=(--use_cpu true --bf16 false --gradient_checkpointing true)
        completion=16
    else
        launch=(--mixed_precision bf16)
        precision=(--bf16 true --gradient_checkpointing true)
        completion=128
    fi
    local train_args=(
        --model_name_or_path "$WORK/model" --train_dataset "$WORK/math.parquet" --eval_strategy no
        --max_steps 20 --per_device_train_batch_size 8 --num_generations 4 --steps_per_generation 2
        --max_completion_length "$completion" --overlong_buffer $((completion / 4)) --beta 1e-4
        --learning_rate 1e-5 --logging_steps 1 --save_strategy steps --save_steps 10 --report_to none
        --disable_tqdm true --seed 0 "${precision[@]}"
    )
    local launcher=("$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --dynamo_backend no
        "${launch[@]}")
    # examples/rpg_math.py through research/gpu/e2e_train.py, which runs it unchanged and notes a digest of the batch
    # of every step (e2e_*_batches.jsonl): the check compares the batches of the resumed steps with the run's.
    local name
    for name in run repeat resumed; do : >"$RESULTS/e2e_${name}_batches.jsonl"; done
    # The same run again, at the same time (the model is small: both fit the GPU side by side): how far two
    # uninterrupted runs with one seed differ (CUDA's kernels are not all deterministic) is the yardstick of the resume.
    limited env RPG_E2E_BATCHES="$RESULTS/e2e_repeat_batches.jsonl" "${launcher[@]}" research/gpu/e2e_train.py \
        "${train_args[@]}" --output_dir "$WORK/e2e_repeat" > "$RESULTS/e2e_repeat.log" 2>&1 &
    local repeat=$!
    limited env RPG_E2E_BATCHES="$RESULTS/e2e_run_batches.jsonl" "${launcher[@]}" research/gpu/e2e_train.py \
        "${train_args[@]}" --output_dir "$WORK/e2e" 2>&1 | tee "$RESULTS/e2e_train.log"
    wait "$repeat" || echo "gpu_run.sh: the repeated e2e run failed (exit status $?): see e2e_repeat.log" >&2
    limited env RPG_E2E_BATCHES="$RESULTS/e2e_resumed_batches.jsonl" "${launcher[@]}" research/gpu/e2e_train.py \
        "${train_args[@]}" --output_dir "$WORK/e2e_resumed" --resume_from_checkpoint "$WORK/e2e/checkpoint-10" 2>&1 |
        tee "$RESULTS/e2e_resume.log"
    limited "$PY" research/gpu/gpu_stages.py e2e-check "$RESULTS" "$WORK"
    rm -rf "$WORK/e2e" "$WORK/e2e_resumed" "$WORK/e2e_repeat"
}

# ---------------------------------------------------------------------------------------------------------- tests
stage_tests() {
    # -v with each test's seconds as it ends (console_output_style=times, pytest >= 8.4; the image has 9.1), and
    # research/gpu/pytest_times.py: each test's record in pytest_gpu_times.jsonl as it ends, which outlives a pytest
    # killed at the deadline (the JUnit XML is written at its end only), and pytest-timeout's per-test limit cut to the
    # seconds left before RPG_STAGE_DEADLINE.
    local pytest_args=(-v -rs -o console_output_style=times -p no:cacheprovider -p pytest_times
        --junitxml="$RESULTS/pytest_gpu.xml")
    if [[ $DRY_RUN == 1 ]]; then
        pytest_args+=(tests/test_gpu.py)  # RPG_GPU_DRY_RUN=1: unmarked, on CPU with the tiny model
    else
        pytest_args+=(-m gpu tests/test_gpu.py)
    fi
    # A test past its time fails alone (pytest-timeout, in the GPU image, loaded by its entry point), so that the
    # JUnit XML is still written.
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        pytest_args+=(--timeout "$([[ $DRY_RUN == 1 ]] && echo 600 || echo 150)")
    fi
    local rc=0
    # Each DeepSpeed launch ends at 90 s (tests/test_gpu.py's default: 120 s): 25 s and 30 s in the first run, over 60 s
    # once in the second (its 11th test, cut at the stage's deadline). Two launches of 120 s would leave the 11
    # in-process tests (about 60 s, with pytest's start) no room in the stage's 180 s; one of 90 s leaves 90 s.
    local launch_timeout=90
    [[ $DRY_RUN == 1 ]] && launch_timeout=300
    limited env RPG_TEST_TIMES="$RESULTS/pytest_gpu_times.jsonl" PYTHONPATH="$ROOT/research/gpu:$PYTHONPATH" \
        RPG_GPU_LAUNCH_TIMEOUT="${RPG_GPU_LAUNCH_TIMEOUT:-$launch_timeout}" \
        "$PY" -m pytest "${pytest_args[@]}" 2>&1 | tee "$RESULTS/pytest_gpu.log" || rc=$?
    # Also after a cut: the check says which tests had not finished (from the JSON lines when there is no XML).
    "$PY" research/gpu/gpu_stages.py pytest-check "$RESULTS/pytest_gpu.xml" "$DRY_RUN" "$RESULTS/pytest_gpu_times.jsonl" ||
        rc=$((rc ? rc : 1))
    return "$rc"
}

# ---------------------------------------------------------------------------------------------------------- bench
BENCH_LENGTH=""
bench() {  # bench LENGTH MODE: the loss alone (c) with the first mode of bench-1k only (it depends on neither)
    local length="$1" mode="$2" name="bench_speed_${2}_${1}" repeats
    # One model for both stages (4096 + 64 positions: RoPE has no weights), built by the first, removed at exit.
    local args=(--device "$DEVICE" --completion-length "$length" --output-json "$RESULTS/$name.json"
        --model-dir "$WORK/bench-model" --max-positions "$([[ $DRY_RUN == 1 ]] && echo 128 || echo 4160)")
    # 8 timed steps a run at 1024 tokens (4 repeats: 32 a configuration; 18 in the second run): 12 would not fit the
    # stage's deadline with its margin (research/docs/benchmarks.md, "The third run's plan").
    local steps=8
    if [[ $length == 4096 || $length == 64 ]]; then  # the long stage: GRPO and both RPG anchors, once each
        repeats=1
        steps=4
        BENCH_LOSS=0
        args+=(--scenarios grpo-ref,rpg-sampling,rpg-reference)
    else
        repeats=4  # the 4 runs: each first once (a Williams design), each directly after each other once
        # The plan's 4 runs, named: bench-speed's default also holds rpg-vocabulary (kl_estimate="vocabulary") on TRL
        # 1.16, which this stage's deadline was not sized for (its GPU rows are still to be planned).
        args+=(--scenarios grpo-ref,grpo-ref-2,rpg-sampling,rpg-reference)
    fi
    if [[ $DRY_RUN == 1 ]]; then
        repeats=1
        args+=(--hidden-size 64 --num-layers 2 --vocab-size 512 --batch-size 4 --num-generations 2 --steps 2
            --warmup 2 --loss-batch 8 --loss-length 256 --loss-repeats 2 --loss-number 2 --loss-warmup 1
            --num-threads 1 --timeout 300 --dtype bfloat16)
    else
        # ~0.6B parameters, Qwen3-0.6B's shape but for its MLP: hidden 1024 (16 heads, 8 KV heads, MLP 4096) x 28
        # layers, Qwen3's vocabulary (151,936, tied embeddings); bf16 autocast, gradient checkpointing.
        # Its weights in bf16, as users load a model to train on a GPU (the second run's were float32 under autocast).
        args+=(--hidden-size 1024 --num-layers 28 --vocab-size 151936 --gradient-checkpointing --timeout 150)
        # 4 completions a micro-batch at both lengths (the second run's 8 at 1024 tokens would not fit 4 repeats of 12
        # steps, full and LoRA, in the stage's deadline: about 400 s against 340, from that run's per-process times).
        args+=(--batch-size 4 --steps "$steps" --warmup 2 --dtype bfloat16)
    fi
    args+=(--repeats "${BENCH_REPEATS:-$repeats}")
    [[ $mode == lora ]] && args+=(--lora)
    [[ $BENCH_LOSS == 0 ]] && args+=(--loss-repeats 0)
    BENCH_LOSS=0
    echo "== $name: rpg-trl bench-speed ${args[*]}"
    limited "$PY" -m rpg_research.cli bench-speed "${args[@]}" 2>&1 | tee "$RESULTS/$name.md"
}
stage_bench() {
    local modes mode
    modes="$BENCH_MODES"
    if [[ $DRY_RUN == 1 && $BENCH_MODES_SET == 0 ]]; then  # each length and each mode once, to keep it short
        modes=$([[ $BENCH_LENGTH == 16 ]] && echo full || echo lora)
    elif [[ $BENCH_LENGTH == 4096 && $BENCH_MODES_SET == 0 ]]; then
        # LoRA only at 4096 tokens (never measured: cut in the second run); full fine-tuning's was
        # (research/docs/results/gpu_2026-11-27/call2/bench_speed_full_4096.json) and does not fit beside it with a margin.
        modes=lora
    fi
    BENCH_LOSS=1
    for mode in ${modes//,/ }; do
        case "$mode" in full | lora) bench "$BENCH_LENGTH" "$mode" ;; *) echo "gpu_run.sh: unknown mode $mode" >&2; return 2 ;; esac
    done
}

# ----------------------------------------------------------------------------------------------------------- long
stage_long() {
    # The fourth protocol's GPU-sized variant (research/docs/bench_algos.md); in the dry run the same command on CPU with the
    # small model and the --quick budget.
    local args=(--task long_addition --tables algorithms --algorithms GRPO "RPG sequence" --learning_rates 3e-4
        --final_seed_start 4000 --num_final_seeds 1 --num_workers 2 --output_dir "$RESULTS/long")
    if [[ $DRY_RUN == 1 ]]; then
        args+=(--quick --model_size small --device cpu)
    else
        args+=(--model_size large --device cuda)
    fi
    echo "== long: rpg-trl bench-algos ${args[*]}"
    limited "$PY" -m rpg_research.cli bench-algos "${args[@]}" 2>&1 | tee "$RESULTS/long.log"
}

# RPG_GPU_RUN_HOOKS=FILE: a bash file sourced here, after the stages are defined, that may redefine them (stage_setup,
# stage_learn, ...): research/tests/test_gpu_run_archive.py replaces them with fast fakes to check the archive's
# refresh and a kill; never set on the GPU.
if [[ -n "${RPG_GPU_RUN_HOOKS:-}" ]]; then
    # shellcheck disable=SC1090
    source "$RPG_GPU_RUN_HOOKS"
fi
if [[ -n "$ARCHIVE" ]]; then
    [[ $ARCHIVE_EVERY =~ ^[1-9][0-9]*$ ]] || { echo "gpu_run.sh: RPG_GPU_ARCHIVE_EVERY=$ARCHIVE_EVERY is not a number of seconds" >&2; exit 2; }
    mkdir -p "$(dirname "$ARCHIVE")"
    ARCHIVE="$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")"
    refresh_archive &
    REFRESH_PID=$!
fi
run_group setup
if ((${#FAILED[@]})); then exit 1; fi

# The groups in the order of their first stage in this list. bench-4k before bench-1k: its two modes are short and
# each is one repeat, while bench-1k keeps its JSON repeat by repeat, so that a deadline cuts its last repeat rather
# than a whole mode at 4096 tokens (the second run lost 4096 tokens with LoRA so).
declare -A DONE
for stage in learn e2e tests bench-4k bench-1k long; do
    has_stage "$stage" && [[ -z ${DONE[$stage]+x} ]] || continue
    mapfile -t group < <(group_of "$stage")
    for member in "${group[@]}"; do DONE[$member]=1; done
    run_group "${group[@]}"
done
