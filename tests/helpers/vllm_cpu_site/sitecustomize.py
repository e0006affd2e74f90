"""Loaded at start-up by the training subprocesses of `tests/test_vllm.py` (`accelerate launch ...`), whose PYTHONPATH
puts this folder and `tests/` first: installs the trainer-side CPU stand-ins of `tests/helpers/vllm_cpu.py` there too
(only with RPG_VLLM_CPU_BRIDGES=1)."""

import os


if os.environ.get("RPG_VLLM_CPU_BRIDGES") == "1":
    from helpers import vllm_cpu

    vllm_cpu.install_cpu_bridges_for_subprocess()
