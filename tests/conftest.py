"""The library's tests: their set-up is shared with the research package's tests (helpers/fixtures.py)."""

from helpers.fixtures import *  # noqa: F401,F403
