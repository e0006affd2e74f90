"""The scripts of research/gpu/ (not a package: run as `python research/gpu/<name>.py`) loaded as modules for the tests."""

import importlib.util
from pathlib import Path
from types import ModuleType


GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "gpu"


def load_gpu_script(name: str) -> ModuleType:
    """research/gpu/`name`.py as a module, executed afresh."""
    spec = importlib.util.spec_from_file_location(name, GPU_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
