# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The GPU run's pytest plugin (`python -m pytest -p pytest_times`, research/gpu/ on the path; research/gpu/gpu_run.sh's
tests stage): what survives a stage cut at its deadline, and a per-test time limit that stays inside it.

- `RPG_TEST_TIMES=PATH`: one JSON line per test, written and flushed as the test's call ends (or its set-up fails or
  skips), and one for a teardown that fails: nodeid, outcome, phase, the call's and the set-up's seconds, and the
  reason of a failure or a skip. The first line lists the tests collected, so that
  research/gpu/gpu_stages.py can say which had not finished. pytest writes its JUnit XML only at its end, which a
  stage killed at its deadline never reaches (the GPU run of 2026-11-27 lost every test's time so).
- `RPG_STAGE_DEADLINE=EPOCH_SECONDS`: each test's pytest-timeout limit (its mark or --timeout) is cut to the seconds
  left before the deadline less DEADLINE_MARGIN, so that a test past it fails alone and pytest still ends by itself,
  writing its XML, before the stage's deadline kills it.

Inactive without these variables.
"""

from __future__ import annotations

import json
import os
import time

import pytest


#: Seconds kept before the stage's deadline: pytest-timeout's end of a test, the XML and the stage's check.
DEADLINE_MARGIN = 10


def _append(path: str, record: dict, mode: str = "a") -> None:
    with open(path, mode) as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def pytest_collection_finish(session):
    path = os.environ.get("RPG_TEST_TIMES")
    if path:  # a new file: the records of this session only
        _append(path, {"collected": [item.nodeid for item in session.items]}, mode="w")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    path = os.environ.get("RPG_TEST_TIMES")
    if not path:
        return
    if report.when == "setup":
        # Kept for the call's line; a set-up that fails or skips has no call.
        _SETUP_SECONDS[report.nodeid] = report.duration
        if report.passed:
            return
    elif report.when == "teardown" and report.passed:
        return
    record = {
        "nodeid": report.nodeid,
        "outcome": report.outcome,
        "when": report.when,
        "duration": round(report.duration, 3) if report.when == "call" else 0.0,
        "setup": round(_SETUP_SECONDS.pop(report.nodeid, 0.0), 3),
        "end": round(time.time(), 3),
    }
    if not report.passed:  # pytest prints its reasons at its end, which a cut stage never reaches
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            record["message"] = crash.message[:500]
        elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
            record["message"] = str(report.longrepr[2])[:500]
        else:
            record["message"] = report.longreprtext.strip()[-500:]
    _append(path, record)


_SETUP_SECONDS: dict[str, float] = {}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Outermost wrapper: pytest-timeout's own wrapper reads the test's limit (its closest `timeout` mark) after this.
    deadline = os.environ.get("RPG_STAGE_DEADLINE")
    if deadline and item.config.pluginmanager.has_plugin("timeout"):
        left = float(deadline) - time.time() - DEADLINE_MARGIN
        marker = item.get_closest_marker("timeout")
        current = marker.args[0] if marker and marker.args else item.config.getoption("timeout", None)
        current = float(current) if current else float("inf")
        if left < current:
            # 0 would mean no limit to pytest-timeout: a test reached past the margin gets one second.
            item.add_marker(pytest.mark.timeout(max(1.0, left)), append=False)
    return (yield)
