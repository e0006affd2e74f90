# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The fast tier stays fast: a test that starts a process or a server must carry the `slow` mark.

The README's test command runs `-m "not slow"` (the fast tier); `.ci/run` then runs `-m slow` (setup.cfg, the
markers). A test that starts a process (`subprocess.Popen`, which `subprocess.run`, `check_output` and the
`rpg_trl.testing.sessions` launches go through; `multiprocessing.Process.start`; `os.fork`) or listens on a socket (a
stand-in server) without the mark fails, naming what it started, so that a new launch cannot slip into the fast tier
unseen. [`install`] registers the check with pytest (the pytest plugin, `rpg_trl.testing.pytest_plugin`, calls it).
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import socket
import subprocess
import sys

import pytest


#: What each guard watches, by the name the failure message gives it.
_WATCHED = {
    "a process (subprocess.Popen)": (subprocess.Popen, "_execute_child"),
    "a process (multiprocessing)": (multiprocessing.process.BaseProcess, "start"),
    "a process (os.fork)": (os, "fork"),
    "a server (socket.listen)": (socket.socket, "listen"),
}


def _describe(args) -> str:
    if args and isinstance(args[0], (list, tuple)):
        return " ".join(str(a) for a in args[0])[:200]
    return repr(args[0])[:200] if args else ""


class Tracker:
    """Records what one test outside the slow tier starts, while it runs (its set-up and teardown included)."""

    def __init__(self):
        self.started: list[str] = []
        self._originals = {}

    def watch(self) -> None:
        for what, (owner, name) in _WATCHED.items():
            original = getattr(owner, name)
            self._originals[(owner, name)] = original

            def guard(*args, _original=original, _what=what, **kwargs):
                # Popen._execute_child(self, args, ...): the command line is the second argument.
                shown = _describe(args[1:]) if _what.endswith("Popen)") else ""
                self.started.append(f"{_what}{': ' + shown if shown else ''}")
                return _original(*args, **kwargs)

            setattr(owner, name, guard)

    def unwatch(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()


def failure(nodeid: str, started: list[str]) -> str | None:
    """The message for a test outside the slow tier that started `started` (None when it started nothing)."""
    if not started:
        return None
    listed = "; ".join(dict.fromkeys(started))
    return (
        f"{nodeid} is in the fast tier (no `slow` mark) but started {listed}. A test that starts a process or a "
        "server belongs to the slow tier: add `@pytest.mark.slow` (or `pytestmark = pytest.mark.slow` for the file); "
        "`.ci/run` runs it after the README's test command."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("slow") is not None:
        yield
        return
    tracker = Tracker()
    tracker.watch()
    item.stash[_STARTED] = tracker.started
    try:
        yield
    finally:
        tracker.unwatch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_STARTED, None)
    if call.when != "teardown" or started is None:
        return
    message = failure(item.nodeid, started)
    if message is not None and report.outcome != "skipped":
        report.outcome = "failed"
        report.longrepr = message


_STARTED = pytest.StashKey[list]()


def install(config) -> None:
    """Registers this module's two hooks with pytest (once per session, whichever conftest calls first).

    The standard library's `platform.processor()` starts `uname -p` the first time a process asks (then caches it);
    the commands record the machine with it. It is asked here, before any test, so that the check charges no test with
    it, whichever test happens to run first in its process."""
    if not config.pluginmanager.has_plugin("rpg-trl-tiers"):
        platform.processor()
        config.pluginmanager.register(sys.modules[__name__], "rpg-trl-tiers")
