r"""The math reward cannot stall `AsyncRPGTrainer` (issue 73, item 3): TRL's rollout worker (a spawned process) calls
the synchronous `accuracy_reward` through `asyncio.to_thread`, off the main thread, where math-verify's `signal.alarm`
limits cannot run; there the reward scores each completion in a worker process it can kill. Here every completion the
stand-in vLLM server returns is a hostile answer (`\boxed{9^{9^{9}}}`, which sympy would expand without end):
`train()` returns within the reward's stated bound, every completion scores 0, and no process of the run is left. On
a TRL older than 1.16 the module skips, as tests/test_async.py."""

# ruff: noqa: E402 - the skip below comes before the imports of TRL's asynchronous trainer, which TRL 1.14 lacks

import threading
import time

import psutil
import pytest

from helpers.trl_release import skip_module_without_async_trl


skip_module_without_async_trl()

from rpg_trl.math_task.rewards import WORKER_START_TIMEOUT_SECONDS, WORKER_TIMEOUT_SECONDS, accuracy_reward
from rpg_trl.testing.cpu_rollouts import cpu_backend

from helpers import async_server_faults
from helpers.async_harness import async_args


#: The completion of every sample: an answer that never finished parsing off the main thread before the worker.
HOSTILE = r"\boxed{9^{9^{9}}}"
#: Two groups of two completions at most are scored (the step's group and the one in the worker's hands at the stop):
#: each hostile completion takes math-verify's 5 s parse limit in the reward's worker process.
NUM_GENERATIONS = 2
#: The marks of this run's processes in their command lines: TRL's rollout worker (`multiprocessing`'s spawn) and the
#: reward's math-verify workers (`rpg_trl.math_task.rewards._WORKER_BOOT`).
ROLLOUT_MARK, REWARD_MARK = "spawn_main", "_rpg_math_verify_worker"


@pytest.fixture(scope="module")
def printable_model_dir(tmp_path_factory):
    """The tiny Qwen3 with the tokenizer whose chat template TRL's rollout worker parses (`helpers.async_vllm_worker`):
    it spells every printable character, so the stand-in can return the hostile answer token by token."""
    from rpg_trl.testing import save_tiny_model

    from helpers.async_vllm_worker import printable_tokenizer

    return save_tiny_model(tmp_path_factory.mktemp("tiny-printable"), tokenizer=printable_tokenizer())


@pytest.fixture
def stand_in_worker(monkeypatch):
    """TRL's rollout worker on the stand-in server, on the CPU (undone after the test)."""
    async_server_faults.patch_trl(lambda obj, name, value: monkeypatch.setattr(obj, name, value))
    with cpu_backend():
        yield


class ProcessWatch:
    """Records, while it runs, every descendant of this process whose command line holds a mark (TRL's rollout worker
    and, under it, the reward's workers): `seen[mark]` is a set of `psutil.Process` (pid and start time, so that a
    recycled pid is not taken for a process of the run)."""

    def __init__(self, marks, every: float = 0.1):
        self.seen = {mark: set() for mark in marks}
        self._every, self._stop = every, threading.Event()
        self._thread = threading.Thread(target=self._watch, name="process-watch", daemon=True)

    def _watch(self):
        while not self._stop.wait(self._every):
            for process in psutil.Process().children(recursive=True):
                try:
                    cmdline = " ".join(process.cmdline())
                except psutil.Error:
                    continue
                for mark, seen in self.seen.items():
                    if mark in cmdline:
                        seen.add(process)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _alive(processes, wait: float = 5.0) -> list[int]:
    """The pids of `processes` still running (`is_running` compares the start time too) and not zombies after `wait`
    seconds: the kernel kills a reward worker when the rollout worker's process ends, and its exit takes a moment."""

    def running(process):
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + wait
    while any(running(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [process.pid for process in processes if running(process)]


@pytest.mark.slow
def test_async_trainer_with_hostile_answers_and_the_math_reward_finishes_with_reward_zero_and_no_process_left(
    stand_in_worker, printable_model_dir, tmp_path
):
    r"""Every completion is `\boxed{9^{9^{9}}}` and the reward is `accuracy_reward` against ordinary numbers: one
    optimizer step on 2 completions of one prompt. `train()` returns within a generous bound derived from the reward's
    own: each completion scored at most `WORKER_TIMEOUT_SECONDS` (20 s) in one worker (TRL scores a group in one call,
    one group at a time), for the step's group and the one the rollout worker may still be scoring when stopped, plus
    `WORKER_START_TIMEOUT_SECONDS` (120 s) for the rollout process and the reward's worker to start on a loaded machine.
    Without the worker (math-verify off the main thread) the first completion never finishes. The logged reward is 0
    (`reward` and `rewards/accuracy_reward`); the reward ran in its worker processes (seen during the run), and
    afterwards neither they nor the rollout worker's process is left."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rpg_trl.async_rpg import AsyncRPGConfig, AsyncRPGTrainer

    tokenizer = AutoTokenizer.from_pretrained(printable_model_dir)
    hostile_ids = tokenizer.encode(HOSTILE, add_special_tokens=False)
    assert tokenizer.decode(hostile_ids) == HOSTILE  # the stand-in spells the answer exactly
    # The reference answers are ordinary numbers ("a+b=" and its sum), never equal to the hostile answer.
    pairs = [(a, b) for a in range(10) for b in range(10)]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs],
            "solution": [str(a + b) for a, b in pairs],
        }
    )
    server = async_server_faults.AnsweringServer(printable_model_dir, completion_ids=hostile_ids)
    try:
        args = AsyncRPGConfig(
            **async_args(
                tmp_path,
                vllm_server_base_url=server.url,
                per_device_train_batch_size=NUM_GENERATIONS,
                num_generations=NUM_GENERATIONS,
                max_completion_length=len(hostile_ids),
                max_inflight_tasks=NUM_GENERATIONS,
                max_steps=1,
                vllm_request_timeout=30.0,
            )
        )
        trainer = AsyncRPGTrainer(
            printable_model_dir,
            reward_funcs=accuracy_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            weight_transfer=async_server_faults.NullWeightTransfer(),
        )
        with ProcessWatch((ROLLOUT_MARK, REWARD_MARK)) as watch:
            start = time.monotonic()
            trainer.train()
            took = time.monotonic() - start
    finally:
        server.close()

    scored = 2 * NUM_GENERATIONS  # the step's group, and at most one more in the rollout worker's hands at the stop
    bound = scored * WORKER_TIMEOUT_SECONDS + WORKER_START_TIMEOUT_SECONDS
    assert took < bound, (took, bound)
    assert trainer.state.global_step == 1
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged, trainer.state.log_history
    for entry in logged:
        assert entry["reward"] == 0.0, entry
        assert entry["rewards/accuracy_reward"] == 0.0, entry
    # The run went through the reward's worker processes (off the main thread), under the rollout worker's process.
    assert watch.seen[ROLLOUT_MARK] and watch.seen[REWARD_MARK], watch.seen
    assert trainer.rollout_worker._process is None
    assert _alive(watch.seen[ROLLOUT_MARK]) == []
    assert _alive(watch.seen[REWARD_MARK]) == []
