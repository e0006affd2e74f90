# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Child processes that outlive a SIGTERM to pytest, and their end.

The tests start some processes in a session of their own (`start_new_session=True`), so that a test can end a whole
tree at once: a `trl vllm-serve` and its engine core, a torchrun and its workers. A SIGTERM to pytest (CI stopped, a
timeout) ends pytest at once, without its fixtures' teardown, and a signal to pytest's process group does not reach
those sessions: they went on running. [`install`] (which the pytest plugin, `rpg_trl.testing.pytest_plugin`, calls)
makes a SIGTERM to pytest end, first, every process below it (its children, theirs, and the sessions [`popen`] started:
SIGTERM, then SIGKILL after a few seconds), and ends the sessions still running when pytest exits (atexit). Standard
library only: the vLLM server's workers of the tests import `helpers.vllm_cpu`, which imports this module.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path


#: The sessions [`popen`] started, by their id (the leader's PID, which is also the process group's id).
_SESSIONS: dict[int, subprocess.Popen] = {}
#: How long the processes have between SIGTERM and SIGKILL.
GRACE_S = 5.0


def popen(*args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(*args, **kwargs)` in a session of its own, ended with pytest (see the module's docstring)."""
    _forget_ended(_processes())
    process = subprocess.Popen(*args, start_new_session=True, **kwargs)
    _SESSIONS[process.pid] = process
    return process


def _forget_ended(table: dict) -> None:
    """Drops the sessions that have ended (leader reaped, no member left), so that no later process group that
    happens to get the same id is taken for one of them."""
    running = {group for _, group, state in table.values() if state != "Z"}
    for pid, process in list(_SESSIONS.items()):
        if process.poll() is not None and pid not in running:
            del _SESSIONS[pid]


def _processes() -> dict[int, tuple[int, int, str]]:
    """PID -> (parent PID, process group, state) of every process this one can see."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def _ours(table: dict) -> set[int]:
    """The running processes below this one in `table` ([`_processes`]): its descendants and the members of the
    sessions [`popen`] started (not zombies, which have ended already)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found |= {pid for pid, (_, group, _) in table.items() if group in _SESSIONS}
    found.discard(os.getpid())
    return {pid for pid in found if table[pid][2] != "Z"}


def _signal(pids, signum) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def stop_all(grace: float = GRACE_S) -> None:
    """Ends every process below this one ([`_ours`]): SIGTERM, then SIGKILL to those left after `grace` seconds. A
    process that its parent's end hands over to init stays on the list (it is no longer a descendant)."""
    pids, signalled = set(), set()
    deadline = time.monotonic() + grace
    while True:
        for process in _SESSIONS.values():
            process.poll()  # reaps a leader that is a child of this process
        table = _processes()
        pids = {pid for pid in pids | _ours(table) if pid in table and table[pid][2] != "Z"}
        if not pids or time.monotonic() >= deadline:
            break
        _signal(pids - signalled, signal.SIGTERM)
        signalled |= pids
        time.sleep(0.05)
    _signal(pids, signal.SIGKILL)
    for process in _SESSIONS.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1)
    _SESSIONS.clear()


_INSTALLED_IN: int | None = None


def _on_sigterm(signum, frame) -> None:
    # A process forked from pytest inherits this handler: there the signal only ends that process, as by default.
    if os.getpid() == _INSTALLED_IN:
        stop_all()
    # Then the end the signal would have brought (exit status 128 + 15 for the shell that waits for pytest).
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install() -> None:
    """SIGTERM ends this process's children and sessions first; at exit the sessions still running end too."""
    global _INSTALLED_IN
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _INSTALLED_IN = os.getpid()
        signal.signal(signal.SIGTERM, _on_sigterm)
        atexit.register(_stop_sessions)


def _stop_sessions() -> None:
    """At pytest's exit: the sessions [`popen`] started that still run (a test's own cleanup ends them before)."""
    if os.getpid() == _INSTALLED_IN and any(
        group in _SESSIONS and state != "Z" for _, group, state in _processes().values()
    ):
        stop_all()
