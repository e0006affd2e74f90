"""The test tiers (setup.cfg's `slow` mark, rpg_trl/testing/tiers.py): a test outside the slow tier that starts a process
or a server fails, naming what it started; with the mark, or starting nothing, it passes. Checked on tests run by
pytest itself (pytester, in this process)."""

import pytest

from rpg_trl.testing import tiers


INNER_TESTS = """
import socket
import subprocess
import sys

import pytest


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()


@pytest.mark.slow
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_starts_nothing():
    assert sum(range(4)) == 6
"""


def test_unmarked_tests_that_start_a_process_or_a_server_fail_and_marked_ones_pass(pytester, request):
    pytester.makeini("[pytest]\nmarkers =\n    slow: the slow tier\n")
    pytester.makeconftest(
        "from rpg_trl.testing import tiers\n\n\ndef pytest_configure(config):\n    tiers.install(config)\n"
    )
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:benchmark")
    # What the inner tests started is theirs: this test's own record of it is dropped.
    request.node.stash[tiers._STARTED].clear()
    result.assert_outcomes(passed=4, errors=2)
    output = result.stdout.str()
    assert "test_inner.py::test_starts_a_process is in the fast tier (no `slow` mark) but started a process" in output
    assert "-c pass" in output  # the command line it started
    assert "test_inner.py::test_listens is in the fast tier (no `slow` mark) but started a server" in output
    assert "test_marked_starts_a_process is in the fast tier" not in output
    assert "test_starts_nothing is in the fast tier" not in output


def test_the_failure_message_names_each_start_once():
    assert tiers.failure("t.py::test_x", []) is None
    message = tiers.failure("t.py::test_x", ["a server (socket.listen)", "a server (socket.listen)"])
    assert message.count("a server (socket.listen)") == 1 and "@pytest.mark.slow" in message


@pytest.mark.slow
def test_the_slow_tier_is_left_unwatched(request):
    assert tiers._STARTED not in request.node.stash


def test_the_platform_query_that_starts_uname_is_answered_before_any_test(request):
    """`platform.processor()` runs `uname -p` once per process; `install` asked it first, so a test that records the
    machine (as the commands do) starts no process, whichever test runs first."""
    import platform

    assert platform.processor() is not None
    assert request.node.stash[tiers._STARTED] == []
