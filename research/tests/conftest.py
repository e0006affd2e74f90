"""The research package's tests: the same set-up as the library's, its pytest plugin
(rpg_trl/testing/pytest_plugin.py); nothing of tests/ is imported."""

pytest_plugins = ["rpg_trl.testing.pytest_plugin"]
