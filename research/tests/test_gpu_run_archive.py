"""The archive of research/gpu/gpu_run.sh comes back as results come, not only when a stage ends (issue 72): the device
tool brings back what lies under $OUT when a command ends or is killed at its per-command limit (SIGKILL to everything:
no trap runs), so `--archive` is rewritten in the background every RPG_GPU_ARCHIVE_EVERY seconds and as each learning
run's result.json appears, each time whole (written aside, then renamed). Checked with fake stages (RPG_GPU_RUN_HOOKS
replaces stage_setup and stage_learn; nothing of the GPU runs): a stage that can only go on once the archive holds what
it wrote proves the archive refreshed while the stage ran; a kill then leaves a whole archive holding all of it."""

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "research" / "gpu" / "gpu_run.sh"

# The fake stages. `archived PATTERN`: waits (0.2 s polls, 60 s at most: then the stage fails, and the test with it)
# until the archive holds the member matching PATTERN (a line of progress.txt, or a file).
HOOKS = r"""
stage_setup() { echo "fake setup"; }
archived() {
    local tries
    for ((tries = 0; tries < 300; tries++)); do
        if [[ -f "$ARCHIVE" ]] && eval "$1"; then return 0; fi
        sleep 0.2
    done
    echo "fake stage: the archive never held it: $1" >&2
    return 1
}
has_line() { tar xzOf "$ARCHIVE" --wildcards '*/progress.txt' 2>/dev/null | grep -qx "$1"; }
has_file() { tar tzf "$ARCHIVE" 2>/dev/null | grep -q "$1"; }
stage_learn() {
    local i
    case "$FAKE_MODE" in
        lines)  # a stage that runs on: three lines, each archived before the next, then a fourth, then waits
            for i in 1 2 3; do
                echo "line $i" >>"$RESULTS/progress.txt"
                archived "has_line 'line $i'"
            done
            echo "line 4" >>"$RESULTS/progress.txt"
            touch "$FAKE_READY"
            sleep 600 ;;
        results)  # two learning runs ending one after the other, each archived as it ends; then the stage ends
            for i in 0 1; do
                mkdir -p "$RESULTS/learn/RPG-lora/seed$i"
                echo '{"seed": '"$i"'}' >"$RESULTS/learn/RPG-lora/seed$i/result.json"
                archived "has_file 'learn/RPG-lora/seed$i/result.json'"
            done ;;
    esac
}
"""


def _start(tmp_path: Path, mode: str, every: int) -> tuple[subprocess.Popen, Path, Path]:
    hooks = tmp_path / "hooks.sh"
    hooks.write_text(HOOKS)
    archive = tmp_path / "out" / "call1.tar.gz"
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "RPG_GPU_RUN_HOOKS": str(hooks),
        "RPG_GPU_ARCHIVE_EVERY": str(every),
        "FAKE_MODE": mode,
        "FAKE_READY": str(ready),
    }
    command = ["bash", str(SCRIPT), "--wheels", "", "--stages", "learn", "--results", str(tmp_path / "call1")]
    # A session of its own: the kill below ends the script and all it started, as the device tool's limit does.
    process = subprocess.Popen(
        [*command, "--archive", str(archive)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return process, archive, ready


def _members(archive: Path) -> dict[str, bytes]:
    """The archive's files by their path inside the results folder (opening it fails if it is not whole)."""
    with tarfile.open(archive, "r:gz") as tar:
        return {
            member.name.split("/", 1)[1]: tar.extractfile(member).read()
            for member in tar.getmembers()
            if member.isfile()
        }


@pytest.mark.slow
def test_the_archive_is_rewritten_while_a_stage_runs_and_a_kill_keeps_it_whole(tmp_path):
    process, archive, ready = _start(tmp_path, "lines", every=1)
    try:
        for _ in range(600):  # the fake stage's three handshakes: at most 3 x 60 s, then it fails and the script ends
            if ready.exists() or process.poll() is not None:
                break
            time.sleep(0.2)
        assert ready.exists(), f"the stage did not reach its fourth line:\n{process.communicate(timeout=60)[0]}"
    finally:
        # What the device tool does at its per-command limit: SIGKILL to everything (no EXIT trap, no last archive).
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the script ended by itself (its stage failed): the assertion above says why
            pass
        process.wait(timeout=30)
    files = _members(archive)  # whole: gzip and tar read to the end
    lines = files["progress.txt"].decode().splitlines()
    # Each of lines 1-3 was archived before the stage wrote the next (else the stage would not have gone on); line 4,
    # written after the last refresh, is what a kill may lose (at most the last interval).
    assert lines[:3] == ["line 1", "line 2", "line 3"] and set(lines) <= {"line 1", "line 2", "line 3", "line 4"}
    # Taken while the stage ran: stages.tsv has the setup's line and not yet the learning stage's.
    stages = [line.split("\t")[0] for line in files["stages.tsv"].decode().splitlines()]
    assert stages == ["setup"]


@pytest.mark.slow
def test_each_learning_runs_result_is_archived_as_it_ends(tmp_path):
    # An interval far longer than the test: only a new result.json can make the refresh loop rewrite the archive.
    process, archive, _ = _start(tmp_path, "results", every=3600)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    files = _members(archive)
    assert files["learn/RPG-lora/seed0/result.json"].strip() == b'{"seed": 0}'
    assert files["learn/RPG-lora/seed1/result.json"].strip() == b'{"seed": 1}'
    # At exit: the last report (the learning stage's line in stages.tsv), the loop stopped, no part left beside.
    assert [line.split("\t")[:2] for line in files["stages.tsv"].decode().splitlines()] == [
        ["setup", "0"],
        ["learn", "0"],
    ]
    assert sorted(path.name for path in archive.parent.iterdir()) == ["call1.tar.gz"]
