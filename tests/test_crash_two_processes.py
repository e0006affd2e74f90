"""A process of a 2-process run dies (SIGKILL) inside a training step or inside a save: the job ends in bounded time,
naming the rank that died, and the run resumed from its newest complete checkpoint continues exactly like the run that
was never interrupted. DDP over gloo (`torch.distributed.run`) and DeepSpeed ZeRO-2 (`accelerate launch` with
`accelerate_configs/deepspeed_zero2.yaml` and the CPU shims of `tests/helpers/cpu_launch.py`), 2 CPU processes, the
worker `tests/helpers/save_crash_two_proc.py`, the kill points of `tests/helpers/save_faults.py`.

The single-process crash tests (kill points inside a save, a full disk) are in `tests/test_guarantees.py`, the units of
`rpg_trl/reliability/checkpoints.py` in `tests/test_reliability.py` (docs/guarantees.md). The comparisons here are
bit-exact between two runs on the same kernels, so this module is not re-run under another ATen CPU capability.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpg_trl.reliability.checkpoints import last_complete_checkpoint
from rpg_trl.testing import sessions

from helpers import save_crash_two_proc, save_faults
from helpers.ports import free_port


ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="needs deepspeed (in the test extra: pip install -e '.[test]')",
)


CRASH_WORKER = Path(save_crash_two_proc.__file__)
#: How long a 2-process job may take to end after one of its processes was killed. torchrun's elastic agent (which
#: `accelerate launch` runs too) sees the dead worker within its monitor interval (0.1 s), sends SIGTERM to the others
#: and SIGKILLs those still alive 30 s later: the job ends within ~30 s whatever the survivors are doing (blocked in a
#: collective included). Measured on a 2-core CPU: 0.7-1.1 s (docs/guarantees.md).
END_WITHIN_SECONDS = 45


def _launch(model_dir, output_dir, *, kill=None, resume=False, zero2=False):
    """A 2-process run of `tests/helpers/save_crash_two_proc.py` (DDP with torchrun, or ZeRO-2 with `accelerate launch`
    and the CPU shims); returns (exit code, launcher output, seconds from the kill to the end of the job)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    stamp = Path(output_dir).parent / f"{Path(output_dir).name}-killed-at"
    env.pop(save_faults.ENV, None)
    if kill:
        env.update({save_faults.ENV: kill, "RPG_TEST_KILL_STAMP": str(stamp)})
    script = [str(CRASH_WORKER), str(model_dir), str(output_dir), *(["--resume"] if resume else [])]
    if zero2:
        config = ROOT / "accelerate_configs" / "deepspeed_zero2.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd += ["--num_processes", "2", "--num_machines", "1"]
        cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        cmd += [str(ROOT / "tests" / "helpers" / "cpu_launch.py"), *script]
        env["TORCH_EXTENSIONS_DIR"] = str(Path(output_dir).parent / "torch_extensions")
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(free_port()), *script]
    proc = sessions.popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the 2-process run hung:\n{output[-6000:]}")
    ended = time.time()
    seconds = ended - float(stamp.read_text()) if kill else None
    return proc.returncode, output, seconds


def _result(output_dir):
    return json.loads((Path(output_dir) / "result.json").read_text())


def _after(result, step):
    skip = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}
    return [{k: v for k, v in h.items() if k not in skip} for h in result["log_history"] if h["step"] > step]


@pytest.fixture(scope="module")
def two_process_full_runs(tiny_model_dir, tmp_path_factory):
    """The uninterrupted 2-process runs (DDP, ZeRO-2), launched on first use."""
    cache = {}

    def get(zero2=False):
        if zero2 not in cache:
            output_dir = tmp_path_factory.mktemp("full") / ("zero2" if zero2 else "ddp")
            returncode, output, _ = _launch(tiny_model_dir, output_dir, zero2=zero2)
            assert returncode == 0, output[-6000:]
            cache[zero2] = _result(output_dir)
            assert cache[zero2]["num_processes"] == 2
            assert cache[zero2]["distributed_type"] == ("DEEPSPEED" if zero2 else "MULTI_CPU")
        return cache[zero2]

    return get


def _check_killed_then_resume(model_dir, output_dir, full, kill, zero2=False):
    """Launch with `kill` (`POINT:STEP:RANK`): the job ends within END_WITHIN_SECONDS, torchrun names the killed rank,
    and the run resumed from its newest complete checkpoint continues exactly like the uninterrupted `full` run."""
    rank = kill.split(":")[2]
    returncode, output, seconds = _launch(model_dir, output_dir, kill=kill, zero2=zero2)
    assert returncode != 0 and seconds is not None, output[-6000:]
    assert seconds < END_WITHIN_SECONDS, (seconds, output[-3000:])
    # torchrun's summary of the failure: the rank, its exit code and the signal that ended it
    assert re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s+exitcode\s*:\s*-9", output), output[-3000:]
    assert "Signal 9 (SIGKILL)" in output
    assert last_complete_checkpoint(str(output_dir)) == str(Path(output_dir) / "checkpoint-2")

    returncode, output, _ = _launch(model_dir, output_dir, resume=True, zero2=zero2)
    assert returncode == 0, output[-6000:]
    resumed = _result(output_dir)
    assert [h["step"] for h in _after(resumed, 2)] == [3, 4, 5, 5]
    assert _after(resumed, 2) == _after(full, 2)  # losses, rewards, learning rates, grad norms, KL: all equal
    assert resumed["policy"] == full["policy"]  # bit-identical final weights
    return seconds


@pytest.mark.parametrize(
    "kill",
    [
        "step:3:1",  # process 1, inside the loss of step 3 (process 0 then waits in the gradient all-reduce)
        "rng:4:1",  # process 1, inside the save of checkpoint-4, after its RNG state, before its generation state
        "trainer-state:4:0",  # process 0, after trainer_state.json (the last file transformers writes)
    ],
)
def test_a_killed_process_ends_the_job_in_bounded_time_and_the_run_resumes_exactly(
    two_process_full_runs, tiny_model_dir, tmp_path, kill
):
    full = two_process_full_runs()
    seconds = _check_killed_then_resume(tiny_model_dir, tmp_path / "run", full, kill)
    print(f"{kill}: the job ended {seconds:.1f} s after the kill")


@needs_deepspeed
def test_zero2_killed_inside_a_save_resumes_exactly(two_process_full_runs, tiny_model_dir, tmp_path):
    """DeepSpeed ZeRO-2, process 1 killed right after DeepSpeed wrote the optimizer partitions of checkpoint-4."""
    full = two_process_full_runs(zero2=True)
    seconds = _check_killed_then_resume(tiny_model_dir, tmp_path / "run", full, "optimizer:4:1", zero2=True)
    print(f"ZeRO-2: the job ended {seconds:.1f} s after the kill")
