"""The research package's tests: the same set-up as the library's (tests/helpers/fixtures.py; `helpers` is on the path
through setup.cfg's `pythonpath`)."""

from helpers.fixtures import *  # noqa: F401,F403
