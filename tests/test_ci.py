"""CI stops cleanly: a SIGTERM to `.ci/run`, or to pytest, ends within seconds every process they started, those in
sessions of their own (CI's steps and background jobs, the tests' vLLM servers and 2-process launches) included. The
tests of `.ci/run` itself run it in a copy of `.ci/` with stand-ins (tests/test_docs.py has another)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpg_trl.testing import sessions


ROOT = Path(__file__).resolve().parent.parent


def _running(pids) -> list[int]:
    """Those of `pids` that still run (a zombie has ended: only its parent's wait is missing)."""
    left = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            left.append(pid)
    return left


def _wait_for(path: Path, process: subprocess.Popen, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"{path.name} not written in {timeout} s"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def _end(process: subprocess.Popen, pids) -> None:
    """Cleanup whatever the test left (nothing, when it passes). The process is reaped before its pipes are read to
    their end: the guards of `.ci/run`'s sessions inherited its pipes, and end once it is gone or a zombie."""
    for pid in [process.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()
    process.communicate(timeout=30)


@pytest.mark.slow
def test_a_sigterm_to_pytest_ends_the_sessions_its_tests_started(tmp_path):
    """pytest runs tests/helpers/sigterm_probe.py, whose test starts a session of its own as the vLLM server fixture
    does (a shell and its sleeping child) and a plain child, then sleeps. A SIGTERM to pytest ends it within seconds
    (with SIGTERM's status, as without the handler) and leaves none of them running: without the conftests'
    handler (rpg_trl/testing/sessions.py) pytest ended at once and the session, out of reach of its process group, went on."""
    out = tmp_path / "pids"
    env = dict(os.environ, RPG_PROBE_PIDS=str(out))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/helpers/sigterm_probe.py"]
    pytest_run = sessions.popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pids = []
    try:
        pids = _wait_for(out, pytest_run, timeout=120)
        # The session's shell (twice: its own id and the leader's), its sleep, the plain child.
        assert len(set(_running(pids))) == 3, pids
        sent = time.monotonic()
        pytest_run.send_signal(signal.SIGTERM)
        pytest_run.wait(timeout=30)
        took = time.monotonic() - sent
        assert pytest_run.returncode == -signal.SIGTERM, pytest_run.communicate()[0]
        assert took < 10, took
        deadline = time.monotonic() + 2  # a signalled process takes a moment to end
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pids), f"left running after pytest's SIGTERM: {_running(pids)}"
    finally:
        _end(pytest_run, pids)


def _ci_with_stand_ins(tmp_path, ignores_sigterm=False):
    """`.ci/run` started in a copy of the repository's `.ci/` with stand-ins (as in tests/test_docs.py): `pip` and the
    README's commands succeed, the background jobs (`.ci/vllm`, `.ci/wheel`, `.ci/torch_floor`, `.ci/trl_floor`) and
    the baseline-kernel step (`python` under `ATEN_CPU_CAPABILITY`) sleep and record their process ids, a child of
    theirs too; the stand-in of `.ci/torch_floor` ignores SIGTERM if `ignores_sigterm`. Returns the run and, once all
    have started, the 10 process ids."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    jobs = ("vllm", "wheel", "torch_floor", "trl_floor")
    for name in jobs:
        record = f"echo $$ $! > {tmp_path}/{name}.tmp\nmv {tmp_path}/{name}.tmp {tmp_path}/{name}.pids"
        ignore = "trap '' TERM\n" if ignores_sigterm and name == "torch_floor" else ""
        (tmp_path / ".ci" / name).write_text(f"{ignore}sleep 300 &\n{record}\nwait\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "rpg-trl").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python").write_text(
        '#!/bin/sh\n[ -z "$ATEN_CPU_CAPABILITY" ] && exit 0\n'
        f"sleep 300 &\necho $$ $! > {tmp_path}/step.tmp\nmv {tmp_path}/step.tmp {tmp_path}/step.pids\nwait\n"
    )
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # bash cannot trap a signal that was ignored when it started (a test run under `nohup` ignores SIGHUP): the run
    # starts with SIGHUP and SIGTERM at their default, as from a terminal, through an exec that keeps its pid.
    start = (
        "import os, signal; [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGHUP, signal.SIGTERM)]; "
        "os.execvp('bash', ['bash', '.ci/run'])"
    )
    ci = sessions.popen(
        [sys.executable, "-c", start], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids = []
    try:
        for name in (*jobs, "step"):
            pids += _wait_for(tmp_path / f"{name}.pids", ci, timeout=30)
    except BaseException:
        _end(ci, pids)
        raise
    assert len(_running(pids)) == 10, pids
    return ci, pids


def _none_left(pids, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _running(pids)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, ignores_sigterm",
    [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, False)],
    ids=["sigterm", "sigterm-ignored-by-a-job", "sighup"],
)
def test_a_sigterm_or_sighup_to_ci_ends_its_step_and_background_jobs_within_seconds(tmp_path, signum, ignores_sigterm):
    """A SIGTERM to `.ci/run` ends it within seconds (status 143, the step named on the last line) and leaves none of
    its steps and jobs running: bash had deferred the trap until the step in the foreground ended (here 300 s). A job
    that ignores SIGTERM (the stand-in of `.ci/torch_floor` and its child, in the second case) gets SIGKILL after
    10 s. A SIGHUP (the terminal or connection gone) does the same, with status 129."""
    ci, pids = _ci_with_stand_ins(tmp_path, ignores_sigterm)
    try:
        sent = time.monotonic()
        ci.send_signal(signum)
        _, stderr = ci.communicate(timeout=30)
        took = time.monotonic() - sent
        assert ci.returncode == 128 + signum, stderr
        assert took < (15 if ignores_sigterm else 5), (took, stderr)
        last = stderr.strip().splitlines()[-1]
        step = "numerics-sensitive tests under ATEN_CPU_CAPABILITY=default"
        assert last.startswith(f"== FAILED: {step} (exit status {128 + signum}"), stderr
        assert not _none_left(pids, within=2), f"left running after CI's signal: {_running(pids)}"
    finally:
        _end(ci, pids)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["script", "process-group", "script-not-reaped"])
def test_a_sigkill_to_ci_or_its_process_group_leaves_no_step_or_job_running(tmp_path, target):
    """SIGKILL cannot be trapped: the step and the background jobs, each in a session of its own, outlived it. Each
    session's guard (`in_session` in `.ci/run`) sees the script gone and ends its session within about a second; also
    while the killed script is a zombie, its parent not having reaped it (`script-not-reaped`: the parent here waits
    only after the check), which `kill -0` alone takes for a live process."""
    ci, pids = _ci_with_stand_ins(tmp_path)
    try:
        if target == "process-group":
            os.killpg(ci.pid, signal.SIGKILL)  # sessions.popen made the script a process group leader
        else:
            ci.kill()
        if target == "script-not-reaped":
            left = _none_left(pids, within=5)
            assert Path(f"/proc/{ci.pid}").exists()  # still a zombie: not reaped yet
            assert not left, f"left running after CI's SIGKILL, CI not reaped: {_running(pids)}"
        ci.wait(timeout=10)
        assert ci.returncode == -signal.SIGKILL
        assert not _none_left(pids, within=5), f"left running after CI's SIGKILL: {_running(pids)}"
    finally:
        _end(ci, pids)
