"""The library's tests: their set-up is the library's pytest plugin (rpg_trl/testing/pytest_plugin.py), which the
research package's tests load too."""

pytest_plugins = ["rpg_trl.testing.pytest_plugin"]
