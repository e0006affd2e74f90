"""CI's proof that the GPU suite still imports and runs: a few of `tests/test_gpu.py`'s tests in its CPU dry run
(`RPG_GPU_DRY_RUN=1`: the tiny Qwen3 of `rpg_trl.tools.toy` instead of the 0.5B model, same test functions), through pytest
in a subprocess. The whole dry run is `RPG_GPU_DRY_RUN=1 python -m pytest -q tests/test_gpu.py` (about 3 minutes on
2 CPU cores); on a GPU, `python -m pytest -q -m gpu tests/test_gpu.py` (see docs/benchmarks.md)."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


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
