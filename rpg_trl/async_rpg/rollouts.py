# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The completion requests of TRL's rollout worker, bounded by `vllm_request_timeout` ([`bound_rollout_requests`]).

TRL 1.16's `AsyncRolloutWorker` runs its rollout loop (`_AsyncRolloutLoop`) in a spawned child process. Each completion
there is one `POST /v1/completions` with TRL's `request_timeout` (600 s by default) per try, tried 3 times by `_post` and
each of those 30 times by `_generate_one_turn`: against a server that accepts requests and never answers, 90 tries of
10 min, with the child's heartbeat still ticking and the server's `/health` still answering, so the trainer waits on an
empty rollout queue for about 15 hours without a word. Here, with `vllm_request_timeout` set, the child runs
[`BoundedRolloutLoop`]: each try is bounded by `vllm_request_timeout`, a try that times out is not tried again (the
server hangs: the run stops, as RPGTrainer's does past the same bound), and any other transport error (refused
connection, reset, an HTTP error status) is tried at most [`REQUEST_ATTEMPTS`] times in all, TRL's back-off (1 s, 2 s)
between them. The child then ends with a [`VLLMServerError`] naming the server, the request and the bound, and the
trainer, which looks at the worker every [`POLL_INTERVAL`] seconds while it waits on the queue, raises it
([`NamedWorkerFailure`]). The child, which has ended, is then joined ([`guard_worker_stop`]: TRL's `stop()` would wait
forever for an ended child to acknowledge its stop event).

So a server that hangs is named within `vllm_request_timeout` + [`POLL_INTERVAL`] seconds of the request, and one that
keeps failing within `REQUEST_ATTEMPTS × vllm_request_timeout` + 3 s (the back-off) + [`POLL_INTERVAL`] of the first
try ([`failure_bound`]).
"""

from __future__ import annotations

import asyncio

from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from ..reliability.checkpoints import saved_checkpoints_sentence
from ..reliability.vllm_server import VLLMServerError


#: Tries of one completion request, in all, against a server that fails it (TRL: 3 × 30); a try that times out is not
#: tried again.
REQUEST_ATTEMPTS = 3
#: Seconds between two looks of the trainer at the rollout worker while it waits on an empty rollout queue (TRL: 5).
POLL_INTERVAL = 1.0
#: Seconds a rollout worker's process that has failed (its error already reported) is given to end by itself before it
#: is ended (it takes about 5 s to unwind a failure: its event loop, threads and queues).
FAILED_CHILD_GRACE = 2.0
#: The request the worker makes for each completion, as the errors name it.
COMPLETIONS_REQUEST = "POST /v1/completions"
#: The exception name under which a child's [`VLLMServerError`] reaches the trainer (TRL passes the child's failure
#: on as `"<type name>: <message>\n<traceback>"`).
_CHILD_ERROR_PREFIX = f"{VLLMServerError.__name__}: "


def failure_bound(seconds: float) -> float:
    """The seconds, at most, from the first try of a completion request to the trainer's [`VLLMServerError`] with the
    bound `seconds` (`vllm_request_timeout`): [`REQUEST_ATTEMPTS`] tries, TRL's back-off between them (1 s, then 2 s)
    and one [`POLL_INTERVAL`] for the trainer to read the failure (a hang: `seconds` + `POLL_INTERVAL`)."""
    backoff = sum(min(2 ** min(attempt, 4), 16) for attempt in range(REQUEST_ATTEMPTS - 1))
    return REQUEST_ATTEMPTS * seconds + backoff + POLL_INTERVAL


class BoundedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child process) whose completion requests are bounded: each try by
    `vllm_request_timeout` (TRL's `request_timeout` is replaced), no second try after a timeout, at most
    [`REQUEST_ATTEMPTS`] tries after other transport errors; then the child ends with a [`VLLMServerError`]."""

    def __init__(self, *, vllm_request_timeout: float, **kwargs):
        kwargs["request_timeout"] = vllm_request_timeout
        super().__init__(**kwargs)
        self.vllm_request_timeout = vllm_request_timeout

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        # One try per call: the tries are counted by the one `_retry` around it (TRL nests two: 3 × 30).
        return await super()._post(path, payload, timeout, max_retries=1)

    async def _retry(self, coro_factory, *, label: str, max_attempts: int = 1):
        timeouts = (asyncio.TimeoutError, TimeoutError)

        async def try_once():
            try:
                return await coro_factory()
            except timeouts as exc:  # the server hangs: no second try, the run stops
                raise VLLMServerError(self._hung_message()) from exc

        try:
            return await super()._retry(try_once, label=label, max_attempts=min(max_attempts, REQUEST_ATTEMPTS))
        except VLLMServerError:
            raise
        except Exception as exc:
            if max_attempts <= 1 or not isinstance(exc, _retryable_errors()):
                raise
            tries = min(max_attempts, REQUEST_ATTEMPTS)
            raise VLLMServerError(self._failed_message(tries, exc)) from exc

    def _hung_message(self) -> str:
        return (
            f"The vLLM server at {self.vllm_server_url} did not answer the generation request ({COMPLETIONS_REQUEST}, "
            f"one completion of the rollout worker) within {self.vllm_request_timeout:g} s (`vllm_request_timeout`): "
            "the server hangs or is overloaded. Restart it, or raise `vllm_request_timeout` if one completion takes "
            "longer."
        )

    def _failed_message(self, tries: int, exc: BaseException) -> str:
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: the trainer reads the first
        return (
            f"The vLLM server at {self.vllm_server_url} failed the generation request ({COMPLETIONS_REQUEST}, one "
            f"completion of the rollout worker) {tries} times in a row, the last with {cause} (each try bounded by "
            f"{self.vllm_request_timeout:g} s, `vllm_request_timeout`)."
        )


def _retryable_errors() -> tuple[type[BaseException], ...]:
    from trl.experimental.async_grpo import async_rollout_worker

    return async_rollout_worker._RETRYABLE_HTTP_ERRORS


def bound_rollout_requests(worker, seconds: float | None) -> bool:
    """Make TRL's `AsyncRolloutWorker` `worker` (before it starts) run [`BoundedRolloutLoop`] with the bound `seconds`;
    `None`, or another worker (one passed as `rollout_worker`), is left alone. Returns whether it is bounded."""
    if seconds is None or not isinstance(worker, AsyncRolloutWorker) or worker._loop_cls is not _AsyncRolloutLoop:
        return False
    worker._loop_cls = BoundedRolloutLoop  # pickled by reference: the child imports this module
    worker._loop_kwargs["vllm_request_timeout"] = float(seconds)
    return True


def guard_worker_stop(worker) -> bool:
    """Make `stop()` of TRL's `AsyncRolloutWorker` `worker` end a child that has failed or died without hanging.

    TRL's `stop()` sets the `multiprocessing.Event` that the child's stop watcher thread waits on; `Event.set()` waits
    for each process that sleeps on the event to wake up and say so, and a child that has ended (a failure, e.g. a
    bounded request: `VLLMServerError`, or a crash) never will: the trainer's `train()` would hang in its `finally`
    forever. Here a child that has failed is joined ([`FAILED_CHILD_GRACE`] seconds, then ended with SIGTERM, then
    SIGKILL) and one that has ended is reaped, without the event; a running child is stopped by TRL's `stop()`. Returns whether `worker` is
    TRL's worker (another is left alone)."""
    if not isinstance(worker, AsyncRolloutWorker) or getattr(worker.stop, "__rpg_guarded__", False):
        return False
    trl_stop = worker.stop

    def stop() -> None:
        process = worker._process
        if process is None or process._popen is None:  # never started: TRL's stop() has nothing to wait for
            return trl_stop()
        if not worker._failed_event.is_set() and process.is_alive():  # running: TRL's stop event wakes it
            return trl_stop()
        process.join(timeout=FAILED_CHILD_GRACE)
        if process.is_alive():  # its error is reported; what is left of its exit (seconds) is not waited for
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        worker._process = None

    stop.__rpg_guarded__ = True
    worker.stop = stop
    return True


class NamedWorkerFailure:
    """The rollout worker's health check (`check_health(stale_after_s)`, run by TRL's rollout queue every
    `poll_interval_s` while it is empty) with a child that ended on a [`VLLMServerError`] raised as one, in the
    trainer: its message, the training step and the checkpoints saved (TRL raises a `RuntimeError` whose cause holds
    the child's traceback)."""

    def __init__(self, worker, trainer):
        self.worker, self.trainer = worker, trainer

    def __call__(self, stale_after_s: float) -> None:
        try:
            self.worker.check_health(stale_after_s)
        except RuntimeError as exc:
            child = str(exc.__cause__ or "") or self._late_child_error()
            if not child.startswith(_CHILD_ERROR_PREFIX):
                raise
            message = child.split("\n", 1)[0][len(_CHILD_ERROR_PREFIX) :]
            raise VLLMServerError(
                f"{message} The run stopped at training step {self.trainer.state.global_step}. "
                + saved_checkpoints_sentence(self.trainer.args.output_dir)
            ) from exc

    def _late_child_error(self) -> str:
        # The child puts its error on a `multiprocessing` queue just before it flags the failure; the queue's feeder
        # thread may not have delivered it yet when TRL looks (`get_nowait`): wait for it a little.
        import queue

        try:
            type_name, message, _ = self.worker._exception_info_queue.get(timeout=2.0)
        except (queue.Empty, AttributeError, ValueError, OSError):
            return ""
        return f"{type_name}: {message}"
