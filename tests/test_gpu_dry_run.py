"""CI's proof that the GPU suite still imports and runs: a few of `tests/test_gpu.py`'s tests in its CPU dry run
(`RPG_GPU_DRY_RUN=1`: the tiny Qwen3 of `rpg_trl.tools.toy` instead of the 0.5B model, same test functions), through pytest
in a subprocess. The whole dry run is `RPG_GPU_DRY_RUN=1 python -m pytest -q tests/test_gpu.py` (about 3 minutes on
2 CPU cores); on a GPU, `python -m pytest -q -m gpu tests/test_gpu.py` (see docs/benchmarks.md)."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
#: One divergence x estimator in bf16 with gradient checkpointing, and LoRA with the "ref" adapter sync.
SUBSET = "urkl-reinforce or lora_one_gpu"


def test_gpu_suite_dry_run_on_cpu(tmp_path):
    report = tmp_path / "report.xml"
    env = {**os.environ, "RPG_GPU_DRY_RUN": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py", "-k", SUBSET]
    proc = subprocess.run(
        cmd + [f"--junitxml={report}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": 2, "failures": 0, "errors": 0, "skipped": 0}, counts
    names = sorted(case.get("name") for case in suite.iter("testcase"))
    assert names == [
        "test_bf16_every_variant_finite_with_gradient_checkpointing[urkl-reinforce]",
        "test_lora_one_gpu_with_ref_adapter_sync",
    ]


def _load_gpu_wheels():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "examples" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires] + ['Requires-Dist: pyarrow>=99; extra == "never"']
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_carried_datasets_is_chosen_by_the_installed_pyarrow(tmp_path):
    """examples/gpu_run.sh installs the carried datasets whose pyarrow requirement the GPU image's pyarrow meets: the
    version CI tests, else the newest fallback tier (with the packages it pins), else it stops naming the versions."""
    gpu_wheels = _load_gpu_wheels()
    trl = _fake_wheel(tmp_path, "trl", "1.16.0", "datasets>=4.7.0")
    main = [trl, _fake_wheel(tmp_path, "datasets", "5.2.0", "pyarrow>=24.0.0", "fsspec<=2026.9.0")]
    main.append(_fake_wheel(tmp_path, "fsspec", "2026.9.0"))
    tier21 = [_fake_wheel(tmp_path / "fallback" / "pyarrow21", "datasets", "5.0.1", "pyarrow>=21.0.0")]
    tier21.append(_fake_wheel(tmp_path / "fallback" / "pyarrow21", "fsspec", "2026.6.0"))
    tier15 = [_fake_wheel(tmp_path / "fallback" / "pyarrow15", "datasets", "4.0.0", "pyarrow>=15.0.0")]
    assert gpu_wheels.choose(tmp_path, "26.0.1") == sorted(main)
    assert gpu_wheels.choose(tmp_path, "24.0.0") == sorted(main)
    assert gpu_wheels.choose(tmp_path, "23.0.1") == sorted([trl] + tier21)
    assert gpu_wheels.choose(tmp_path, "18.1.0") == sorted([trl, main[2]] + tier15)
    with pytest.raises(SystemExit, match=r"pyarrow 14.0.2 is installed here, and no carried datasets accepts it"):
        gpu_wheels.choose(tmp_path, "14.0.2")


def test_carried_pins_fail_rather_than_fall_back_to_a_bare_name():
    gpu_wheels = _load_gpu_wheels()
    assert gpu_wheels.pins(["pytest"]) == [f"pytest=={pytest.__version__}"]
    with pytest.raises(SystemExit, match=r"\['no-such-package-rpg'\] not installed"):
        gpu_wheels.pins(["pytest", "no-such-package-rpg"])
