# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A reward cannot hang the run.

- The math reward's time limit holds in any thread. math-verify bounds parsing and comparison with `signal.alarm`,
  which only the main thread can use; TRL's asynchronous rollout worker calls a synchronous reward through
  `asyncio.to_thread`, where the answers below never finished. Off the main thread `accuracy_reward` scores in a worker
  process (the tests that start one are slow-tier tests), killed past `WORKER_TIMEOUT_SECONDS`.
- A reward function that overruns `reward_timeout` ends the run with a `RewardTimeoutError` naming the function and
  the completion (the reward guard), with any function: tested with functions that wait on an event the test holds.

Expected rewards are written by hand: every hostile answer is not the reference "1" (or would need astronomically
long to evaluate), so it scores 0.0, and the well-formed "Answer: 1" scores 1.0.
"""

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from datasets import Dataset

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.math_task import rewards
from rpg_trl.math_task.rewards import accuracy_reward
from rpg_trl.reliability.reward_guard import RewardFunctionError, RewardGuard, RewardTimeoutError
from rpg_trl.testing import build_char_tokenizer

from helpers.tiny_runs import tiny_run_args


#: Answers on which math-verify never finished off the main thread (issue 73); in the main thread each took ~5 s.
HOSTILE = {
    "power tower of four 9s": r"\boxed{9^{9^{9^{9}}}}",
    "power tower of three 9s": r"\boxed{9^{9^{9}}}",
    "10^(10^8)": r"\boxed{10^{10^{8}}}",
    "triple factorial": r"\boxed{((99!)!)!}",
    "450-digit power": "\\boxed{" + "7" * 450 + "^{" + "3" * 450 + "}}",
    "integral": r"\boxed{\int_0^{10^{100}} x^{10^{10}} e^{-x} \, dx}",
}


@pytest.fixture
def one_second_limits(monkeypatch):
    """math-verify's limits at 1 s (its `signal.alarm` takes whole seconds) instead of 5: the same code path, faster
    tests. The reference cache is keyed by the limit, so no parse made under another limit is reused."""
    monkeypatch.setattr(rewards, "PARSING_TIMEOUT_SECONDS", 1)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_SECONDS", 1)


def _in_thread(function, how: str):
    """`function()` run in a `threading.Thread` or through `asyncio.to_thread`, as TRL's rollout worker calls a
    synchronous reward; fails (instead of hanging the test) if it has not returned within 120 s."""
    results, errors = [], []

    def body():
        try:
            if how == "thread":
                results.append(function())
            else:
                results.append(asyncio.run(asyncio.to_thread(function)))
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), (
        "the reward did not return within 120 s: its time limit does not hold off the main thread"
    )
    assert errors == []
    return results[0]


def _running(process: psutil.Process) -> bool:
    """Whether `process` still runs: not ended, not a zombie (an orphan waits for its reaper), not a recycled pid."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ==================================================================================================== the math reward
@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_answer_scores_zero_in_the_main_thread_with_a_warning(one_second_limits, answer, caplog):
    """In the main thread math-verify's own limits end the parse or the comparison; the completion scores 0.0, the
    well-formed one next to it 1.0, and the time-out is reported naming the answer."""
    rewards._timeouts = 0  # the warning comes at the 1st, 10th, 100th, ... time-out of the process
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        assert accuracy_reward([answer, "So it is one.\nAnswer: 1"], ["1", "1"]) == [0.0, 1.0]
    assert "was not verified within the time limit" in caplog.text
    assert f"its answer: {rewards.extract_answer(answer)!r}"[:60] in caplog.text  # long answers are cut


@pytest.mark.slow  # starts the worker process
@pytest.mark.parametrize("how", ["thread", "asyncio.to_thread"])
def test_hostile_answers_score_zero_off_the_main_thread(one_second_limits, how):
    """Every hostile answer of the issue in one batch, scored from a thread: each is cut short by math-verify's limit
    inside the worker process and scores 0.0; the reward returns, and the well-formed completion still scores 1.0."""
    completions = [*HOSTILE.values(), "Answer: 1"]
    assert _in_thread(lambda: accuracy_reward(completions, ["1"] * len(completions)), how) == [0.0] * len(HOSTILE) + [
        1.0
    ]


@pytest.mark.slow  # starts worker processes
def test_a_worker_past_its_deadline_is_killed_and_replaced(monkeypatch, caplog):
    """The backstop for what math-verify's limits cannot interrupt: a completion that the worker has not scored within
    `WORKER_TIMEOUT_SECONDS` scores 0.0 (not verified) with a warning, the worker process is killed (no process left
    behind), and the next completion is scored by a new worker."""
    monkeypatch.setattr(rewards, "WORKER_TIMEOUT_SECONDS", 0.5)  # well under math-verify's own 5 s limit
    rewards._timeouts = 0
    pids = []

    def score():
        scores = []
        for completion in (HOSTILE["power tower of three 9s"], "Answer: 1"):
            scores.extend(accuracy_reward([completion], ["1"]))
            pids.append([worker.process.pid for worker in rewards._POOL._workers if worker.process is not None])
        return scores

    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        assert _in_thread(score, "thread") == [0.0, 1.0]
    assert "A completion (given reward 0.0) was not verified" in caplog.text and "9^{9^{9}}" in caplog.text
    assert pids[0] == []  # the worker that overran was killed...
    assert len(pids[1]) == 1  # ...and a new one scored the next completion
    rewards._POOL.close()
    assert all(worker.process is None for worker in rewards._POOL._workers)


@pytest.mark.slow  # starts worker processes
def test_a_worker_ends_with_the_thread_that_started_it_and_the_next_request_is_still_scored():
    """A worker process ends when the thread that started it ends (Linux's `PR_SET_PDEATHSIG` follows the thread), so a
    pool of threads leaves none behind; the idle worker left in the pool is then dead, and the next thread's request
    starts a new one instead of scoring its completion 0.0."""
    rewards._POOL.close()
    pids = []

    def score():
        scores = accuracy_reward(["Answer: 1"], ["1"])
        pids.extend(worker.process.pid for worker in rewards._POOL._workers if worker.process is not None)
        return scores

    assert _in_thread(score, "thread") == [1.0]
    assert len(pids) == 1
    worker, deadline = psutil.Process(pids[0]), time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker), "the worker outlived the thread that started it"
    assert _in_thread(lambda: accuracy_reward(["Answer: 1", "Answer: 2"], ["1", "1"]), "thread") == [1.0, 0.0]
    rewards._POOL.close()


@pytest.mark.slow  # starts a Python process and its worker
def test_a_worker_busy_on_a_hostile_answer_ends_at_once_when_its_process_is_killed(tmp_path):
    """A process killed with SIGKILL (as TRL's rollout worker is stopped) runs no exit handler; its worker, busy on a
    hostile answer (math-verify inside sympy, where the end of its stdin is not read), is killed by the kernel with
    it, instead of computing on as an orphan."""
    script = textwrap.dedent(
        f"""
        import threading, time
        from rpg_trl.math_task import rewards

        # No limit ends the parse within the test: only the kernel can end the worker in time.
        rewards.PARSING_TIMEOUT_SECONDS = rewards.VERIFY_TIMEOUT_SECONDS = 600
        rewards.WORKER_TIMEOUT_SECONDS = 600.0
        threading.Thread(target=rewards.accuracy_reward, args=([{HOSTILE["power tower of four 9s"]!r}], ["1"])).start()
        while not [worker for worker in rewards._POOL._workers if worker.process is not None]:
            time.sleep(0.05)
        print(rewards._POOL._workers[0].process.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        time.sleep(2)  # the worker started, read the request and is scoring it
        assert _running(worker)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 5
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker), "the worker outlived its killed process"


@pytest.mark.slow  # starts the worker process
def test_the_worker_scores_like_the_main_thread():
    """The worker runs the same scoring as the main thread: equal answers, wrong answers, an unparseable reference."""
    completions = ["Half of it.\nAnswer: 0.5", "Answer: 3", "no answer", "Answer: 2"]
    solutions = [r"\frac{1}{2}", r"\frac{1}{2}", "7", ""]
    expected = [1.0, 0.0, 0.0, None]
    assert accuracy_reward(completions, solutions) == expected
    assert _in_thread(lambda: accuracy_reward(completions, solutions), "thread") == expected


# ==================================================================================================== the reward guard
def _batch(*completions):
    return dict(prompts=[f"p{i}" for i in range(len(completions))], completions=list(completions))


def test_without_a_limit_the_reward_runs_in_the_calling_thread():
    """No limit (the default): the reward function is called in the caller's thread, as before, so that functions
    relying on the main thread (math-verify's signals) keep working."""
    threads = []

    def reward(completions, **kwargs):
        threads.append(threading.current_thread())
        return [1.0] * len(completions)

    assert RewardGuard().wrap(reward, "reward")(**_batch("a", "b")) == [1.0, 1.0]
    assert threads == [threading.current_thread()]


def test_a_reward_within_the_limit_returns_its_values_and_logs():
    logged = {}

    def reward(completions, log_extra, **kwargs):
        log_extra("length", [len(c) for c in completions])
        return [float(len(c)) for c in completions]

    guarded = RewardGuard().wrap(reward, "reward", timeout=30.0)
    assert guarded(**_batch("a", "bb"), log_extra=lambda column, values: logged.update({column: values})) == [1.0, 2.0]
    assert logged == {"length": [1, 2]}


def test_a_reward_past_the_limit_ends_with_an_error_naming_the_function_and_the_completion():
    """A function that hangs on one completion (it waits on an event the test holds): the call ends after the limit
    with a RewardTimeoutError naming the function, the sample (index, prompt, completion), the limit and what happens
    to the stuck call; that call goes on in a daemon thread, and its later `log_extra` call is ignored."""
    release = threading.Event()
    logged = []

    def stalling_reward(completions, log_extra, **kwargs):
        if any("hang" in c for c in completions):
            release.wait(60)
            log_extra("late", [0.0] * len(completions))
        return [0.0] * len(completions)

    guarded = RewardGuard().wrap(stalling_reward, "stalling_reward", process_index=0, timeout=0.3)
    try:
        with pytest.raises(RewardTimeoutError) as error:
            guarded(**_batch("fine", "also fine", "please hang here"), log_extra=lambda *a: logged.append(a))
        message = str(error.value)
        assert "Reward function 'stalling_reward' did not return within reward_timeout=0.3 s" in message
        assert "on a batch of 3 completions" in message
        assert "called on sample 2 alone it did not return within the limit either" in message
        assert "Prompt: 'p2'. Completion: 'please hang here'" in message
        assert "goes on in a daemon thread" in message and "raise `reward_timeout`" in message
        assert isinstance(error.value, RewardFunctionError)  # caught wherever reward failures are
        stuck = [t for t in threading.enumerate() if t.name == "reward-stalling_reward"]
        assert stuck and all(t.daemon and t.is_alive() for t in stuck)
    finally:
        release.set()
    for thread in stuck:
        thread.join(timeout=10)
    assert logged == []  # the abandoned calls' logging went nowhere


def test_a_batch_that_is_slow_as_a_whole_is_reported_as_such():
    """Each sample takes 0.2 s alone, the batch of 4 more than the limit of 0.5 s: no single sample is blamed."""

    def slow_reward(completions, **kwargs):
        time.sleep(0.2 * len(completions))
        return [0.0] * len(completions)

    with pytest.raises(RewardTimeoutError, match=r"none exceeded the limit: the batch as a whole takes too long"):
        RewardGuard().wrap(slow_reward, "slow_reward", timeout=0.5)(**_batch("a", "b", "c", "d"))


def test_an_async_reward_past_the_limit_is_cancelled_and_named():
    cancelled = []

    async def stalling_async_reward(completions, **kwargs):
        try:
            if "hang" in completions[0]:
                await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(completions[0])
            raise
        return [1.0] * len(completions)

    guarded = RewardGuard().wrap(stalling_async_reward, "stalling_async_reward", timeout=0.3)
    with pytest.raises(RewardTimeoutError, match=r"'stalling_async_reward' did not return.*Completion: 'hang'"):
        asyncio.run(guarded(**_batch("hang", "ok")))
    assert cancelled == ["hang", "hang"]  # the batch call, then the call on sample 0 alone


def test_reward_timeout_ends_training_with_the_error(tiny_model_dir, tmp_path):
    """Through `RPGTrainer`: a reward function that stalls on the prompt "2+2=" ends `train()` with the error naming
    it, within the limit (set in `RPGConfig.reward_timeout`), instead of stalling."""
    release = threading.Event()

    def stalling_reward(prompts, completions, **kwargs):
        if "2+2=" in prompts:
            release.wait(60)
        return [0.0] * len(prompts)

    args = RPGConfig(**tiny_run_args(tmp_path, shuffle_dataset=False, steps_per_generation=1, reward_timeout=0.5))
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    trainer = RPGTrainer(
        tiny_model_dir, stalling_reward, args=args, train_dataset=dataset, processing_class=build_char_tokenizer()
    )
    try:
        with pytest.raises(RewardTimeoutError, match=r"'stalling_reward' did not return within reward_timeout=0.5 s"):
            trainer.train()
    finally:
        release.set()


def test_reward_timeout_is_an_rpg_config_field_off_by_default():
    config = RPGConfig(output_dir="unused", use_cpu=True, report_to="none")
    assert config.reward_timeout is None
    assert RPGConfig(output_dir="unused", use_cpu=True, report_to="none", reward_timeout=2.5).reward_timeout == 2.5
