"""AsyncRPGTrainer against a vLLM server that hangs or keeps failing (issue 73, item 2): TRL's own rollout worker (a
spawned process) samples from the stand-in server of `helpers.hung_server`; `vllm_request_timeout` bounds its completion
requests, and `train()` ends with a `VLLMServerError` naming the server, the request and the bound, with no process or
thread of the run left. TRL alone retries each completion 3 × 30 times at its `request_timeout` (600 s), while the
trainer waits on an empty queue without a word. On a TRL older than 1.16 the module skips, as tests/test_async.py."""

# ruff: noqa: E402 - the skip below comes before the imports of TRL's asynchronous trainer, which TRL 1.14 lacks

import dataclasses
import threading
import time

import psutil
import pytest

from helpers.trl_release import skip_module_without_async_trl


skip_module_without_async_trl()

from rpg_trl.async_rpg import AsyncRPGConfig
from rpg_trl.async_rpg.rollouts import REQUEST_ATTEMPTS, failure_bound
from rpg_trl.reliability import VLLMServerError
from rpg_trl.reliability.vllm_server import REQUEST_TIMEOUT
from rpg_trl.testing.cpu_rollouts import cpu_backend

from helpers import async_server_faults, hung_server
from helpers.async_harness import async_args


#: The bound of the tests, short so that they are fast.
SECONDS = 1.0
#: Threads that any run leaves, idle, and that no stop would end: TRL's rollout-trace logger (one per rollout queue
#: dataset, in every run), and the process-wide helpers of huggingface_hub (telemetry) and tqdm (monitor), started once.
NOT_OF_THE_RUN = ("rollout-trace-logger", "_telemetry_worker", "TMonitor")


@pytest.fixture(scope="module")
def printable_model_dir(tmp_path_factory):
    """The tiny Qwen3 with the tokenizer whose chat template TRL's rollout worker parses (`helpers.async_vllm_worker`)."""
    from rpg_trl.testing import save_tiny_model

    from helpers.async_vllm_worker import printable_tokenizer

    return save_tiny_model(tmp_path_factory.mktemp("tiny-printable"), tokenizer=printable_tokenizer())


@pytest.fixture
def stand_in_worker(monkeypatch):
    """TRL's rollout worker on the stand-in server, on the CPU (undone after the test)."""
    async_server_faults.patch_trl(lambda obj, name, value: monkeypatch.setattr(obj, name, value))
    with cpu_backend():
        yield


def test_async_config_takes_vllm_request_timeout_with_rpg_configs_default_and_checks(tmp_path):
    """`AsyncRPGConfig.vllm_request_timeout`: RPGConfig's default (600 s), `None` allowed, other values refused naming
    the option, as RPGConfig refuses them."""
    from rpg_trl import RPGConfig

    rpg_default = {f.name: f.default for f in dataclasses.fields(RPGConfig)}["vllm_request_timeout"]
    assert AsyncRPGConfig(**async_args(tmp_path)).vllm_request_timeout == rpg_default == REQUEST_TIMEOUT == 600.0
    assert AsyncRPGConfig(**async_args(tmp_path, vllm_request_timeout=None)).vllm_request_timeout is None
    for bad in (0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match="`vllm_request_timeout` must be a finite number of seconds > 0"):
            AsyncRPGConfig(**async_args(tmp_path, vllm_request_timeout=bad))


def test_failure_bound_is_the_tries_the_back_off_and_one_poll():
    """The stated bound: 3 tries of `vllm_request_timeout`, TRL's back-off between them (1 s, 2 s), and one poll of the
    trainer (1 s): 3 × 2 + 3 + 1 = 10 s at a 2 s bound."""
    assert REQUEST_ATTEMPTS == 3
    assert failure_bound(2.0) == 10.0


def _children_of_the_run():
    """This process's children started by `multiprocessing` (TRL's rollout worker), its resource tracker excepted."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _faulty_run(server, model, output_dir):
    """Train against `server` until `VLLMServerError`: its message, the seconds from the first completion request's
    arrival to the error, and the threads (but [`NOT_OF_THE_RUN`]) and worker processes left afterwards."""
    before = set(threading.enumerate())
    first_request = {}
    answer = server._answer

    def timed_answer(handler):
        first_request.setdefault(handler.path, time.monotonic())
        return answer(handler)

    server._answer = timed_answer
    try:
        trainer = async_server_faults.build_trainer(model, output_dir, server.url, SECONDS)
        with pytest.raises(VLLMServerError) as error:
            trainer.train()
        waited = time.monotonic() - first_request["/v1/completions"]
    finally:
        server.close()
    threads = [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and not any(name in t.name for name in NOT_OF_THE_RUN)
    ]
    return str(error.value), waited, trainer, threads, _children_of_the_run()


@pytest.mark.slow
def test_async_trainer_with_a_vllm_server_that_hangs_ends_naming_the_server_request_and_bound(
    stand_in_worker, printable_model_dir, tmp_path
):
    """The stand-in accepts every completion request and never answers: TRL's worker would retry each 90 times; here
    `train()` raises `VLLMServerError` naming the server's URL, the request, the bound and the option, at step 0, no
    sooner than the bound and within it plus one poll (a generous margin for a loaded machine); the worker process has
    ended and no thread of the run is left."""
    assert not _children_of_the_run()
    server = hung_server.HangingServer(printable_model_dir, hang_on="/v1/completions", hang_at=1)
    message, waited, trainer, threads, children = _faulty_run(server, printable_model_dir, tmp_path)
    assert message.startswith(
        f"The vLLM server at {server.url} did not answer the generation request (POST /v1/completions, one completion "
        f"of the rollout worker) within 1 s (`vllm_request_timeout`): the server hangs or is overloaded."
    ), message
    assert "The run stopped at training step 0. No complete checkpoint was saved" in message, message
    assert SECONDS <= waited < SECONDS + 1.0 + 10.0, waited  # the bound, one poll, and slack for a loaded machine
    assert trainer.state.global_step == 0
    assert server.counts["/v1/completions"] <= 4  # the in-flight requests (`max_inflight_tasks=4`), none tried again
    assert children == [] and trainer.rollout_worker._process is None
    assert threads == [], threads


@pytest.mark.slow
def test_async_trainer_with_a_vllm_server_that_keeps_failing_ends_after_the_capped_retries(
    stand_in_worker, printable_model_dir, tmp_path
):
    """The stand-in answers every completion request with HTTP 500: TRL's worker would try each one 90 times (about
    20 min of back-off); here each is tried 3 times in all, then `train()` raises `VLLMServerError` naming the server,
    the request, the tries, the last error and the bound, within `failure_bound` (plus slack for a loaded machine)."""
    server = async_server_faults.FailingServer(printable_model_dir, fail_on="/v1/completions")
    message, waited, trainer, threads, children = _faulty_run(server, printable_model_dir, tmp_path)
    assert message.startswith(
        f"The vLLM server at {server.url} failed the generation request (POST /v1/completions, one completion of the "
        "rollout worker) 3 times in a row, the last with ClientResponseError: 500"
    ), message
    assert "(each try bounded by 1 s, `vllm_request_timeout`)" in message, message
    assert "The run stopped at training step 0." in message, message
    assert 3.0 <= waited < failure_bound(SECONDS) + 10.0, waited  # TRL's back-off of 1 s + 2 s comes first
    # Each of the 4 in-flight completions is tried at most 3 times (TRL: 90).
    assert 3 <= server.counts["/v1/completions"] <= 4 * REQUEST_ATTEMPTS, server.counts
    assert children == [] and trainer.rollout_worker._process is None
    assert threads == [], threads
