# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Every process of a multi-process run learns of a failure that the main process saw, and the main process reports it.

In a run with several processes, the main process alone talks to the vLLM server (TRL broadcasts the server's answers
to the others). When the server fails, the main process raises; the others wait in a collective that nothing else
ends. Here:

1. the main process posts the failure in the process group's store under its trainer's key ([`tell_other_processes`])
   and waits, at most [`NOTICE_TIMEOUT`] seconds, until every watching process has taken note of it; then it raises, so
   that the user's `finally` blocks, the trackers and the `atexit` handlers run as for any error;
2. every other process runs a watcher thread ([`FailureWatcher`]) that reads the post, logs the message as its own
   error and then waits for the main process to end: the main process marks its exit in the store from its last
   `atexit` handler, with its machine and process id ([`_mark_exits`]); a watcher on the same machine then waits for
   that process to have ended (its interpreter shuts down after the mark, which takes seconds on a loaded machine), a
   watcher on another machine takes the mark for the end; it then gives the launcher [`EXIT_GRACE`] seconds to end the
   job (`torchrun` and `accelerate launch` see the main process's failure first and name it), and ends its process with
   status 1 if it is still running. If the main process has not ended `main_process_exit_timeout` seconds (a field of
   the trainer's config, default [`MAIN_EXIT_TIMEOUT`]) after the post, the watcher ends its process anyway, saying
   so: every process stops within a bound, and a main process whose cleanup takes longer is ended by the launcher;
3. a watcher runs while the trainer may use the server: during `train()`, `evaluate()` and `predict()` ([`watching`],
   which nests); it is stopped and joined when the outermost of them returns and, at the latest, by an `atexit` handler
   that runs before the process group is destroyed: no thread of the trainer is left inside a call to the store while the interpreter
   shuts down (a daemon thread that returns from C++ into a finalizing interpreter is ended by `pthread_exit`, which
   aborts the process: "terminate called without an active exception", SIGABRT, after a run that finished).

A watcher whose store fails says so in a warning and deregisters, so the main process does not wait for its note; a
store call whose failure costs time (a note or a mark the other side then waits for in vain) is named in a warning too.
Each
trainer has its own key (trainers are numbered in the order a process builds them, the same on every process), so two
trainers in one process group do not count each other's watchers.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import socket
import sys
import threading
import time

from transformers.utils import logging


logger = logging.get_logger(__name__)

#: Prefix of the keys, in the store of the default process group, under which a trainer's main process posts a failure
#: (the message of the error it raises); one key per trainer: `{FAILURE_KEY}/{n}`.
FAILURE_KEY = "rpg_trl/failure"
#: Seconds between two looks of a watcher at its key.
WATCH_INTERVAL = 0.5
#: Seconds the main process waits, at most, for every watcher to take note of a failure before it raises.
NOTICE_TIMEOUT = 10.0
#: Seconds a watcher that took note of a failure waits for the main process to end before it ends its own process (the
#: default of the config field `main_process_exit_timeout`).
MAIN_EXIT_TIMEOUT = 60.0
#: Seconds a watcher waits, once the main process has ended (or, on another machine, marked its exit), for the launcher
#: to end the job.
EXIT_GRACE = 5.0


def check_seconds(name: str, value, default: float, allow_none: bool = False) -> None:
    """Raise a `ValueError` naming the option `name` (whose default is `default`) unless `value` is a finite number of
    seconds > 0, or None where `allow_none` (no bound)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
        none = ", or None for no bound" if allow_none else ""
        raise ValueError(
            f"`{name}` must be a finite number of seconds > 0{none} (default {default:g}); got {value!r}."
        )


def check_exit_timeout(timeout, name: str = "main_process_exit_timeout") -> None:
    """Raise a `ValueError` naming `name` unless `timeout` is a finite number of seconds > 0."""
    check_seconds(name, timeout, MAIN_EXIT_TIMEOUT)


_TRAINER_NUMBERS = itertools.count()
_WATCHERS: list[FailureWatcher] = []
#: The (store, key) of each failure this process posted: its exit is marked there.
_POSTED: list[tuple[object, str]] = []
_STOP_REGISTERED = False


def _default_store():
    """A client of the default process group's store of its own (usable from a thread); None without a process group.
    A group whose store cannot be cloned is named in a warning (torch >= 2.8 has `Store.clone`, setup.cfg's floor)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, RuntimeError, ValueError) as exc:
        logger.warning(
            f"The process group's store cannot be cloned ({type(exc).__name__}: {exc}): a failure that the main process "
            "sees (e.g. of the vLLM server) is not passed to the other processes, which wait until the launcher ends "
            "them."
        )
        return None


def failure_key(trainer) -> str:
    """The key of `trainer`'s failure record, numbered when first asked (call it on every process as the trainer is
    built, so that the numbers agree)."""
    key = getattr(trainer, "_rpg_failure_key", None)
    if key is None:
        key = trainer._rpg_failure_key = f"{FAILURE_KEY}/{next(_TRAINER_NUMBERS)}"
    return key


class FailureWatcher:
    """On a process other than the main one: a thread that waits for the main process to post a failure under the
    trainer's key, then logs it as this process's error and ends the process once the main process has ended (see the
    module). `subject` names what is watched (for the warning about a failed store), `error_name` the error the main
    process raises (the watcher's line on stderr reads `{error_name} on process {rank}: {message}`)."""

    def __init__(self, trainer, subject: str, error_name: str):
        self.key = failure_key(trainer)
        self.rank = trainer.accelerator.process_index
        #: Seconds to wait for the main process to end after its failure (`args.main_process_exit_timeout`).
        self.main_exit_timeout = float(
            getattr(getattr(trainer, "args", None), "main_process_exit_timeout", None) or MAIN_EXIT_TIMEOUT
        )
        self.subject, self.error_name = subject, error_name
        self.seen = threading.Event()
        self._stop = threading.Event()
        self._thread = None
        self._store = None
        self._registered = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Register with the main process and start the thread (idempotent). Returns whether it runs."""
        global _STOP_REGISTERED
        if self.running:
            return True
        store = _default_store()
        if store is None:
            return False
        try:
            store.add(f"{self.key}/watchers", 1)  # the main process waits for as many notes
        except Exception as exc:  # noqa: BLE001 - any store error: named, and no watcher
            logger.warning(
                f"Process {self.rank} does not watch for a failure of {self.subject}: the store failed ({exc})."
            )
            return False
        self._store, self._registered = store, True
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="rpg-trl-failure-watch", daemon=True)
        self._thread.start()
        _WATCHERS.append(self)
        if not _STOP_REGISTERED:
            # Registered after `teardown.hold_process_group_until_exit`'s handler: it runs before it (last in, first
            # out), while the process group exists.
            atexit.register(stop_all_watchers)
            _STOP_REGISTERED = True
        return True

    def stop(self) -> None:
        """Stop the thread, wait for it to end and deregister (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        with contextlib.suppress(ValueError):
            _WATCHERS.remove(self)
        if not self.seen.is_set():
            self._deregister()

    def _deregister(self) -> None:
        """The main process no longer waits for this watcher's note (once)."""
        if self._registered:
            self._registered = False
            try:
                self._store.add(f"{self.key}/watchers", -1)
            except Exception as exc:  # noqa: BLE001 - any store error: the main process would wait for a note in vain
                logger.warning(
                    f"Process {self.rank} could not withdraw its failure watcher from the process group's store "
                    f"({type(exc).__name__}: {exc}): if the main process reports a failure, it waits up to "
                    f"{NOTICE_TIMEOUT:g} s for this process's note before it raises."
                )

    def _watch(self) -> None:
        store = self._store
        try:
            while not store.check([self.key]):
                if self._stop.wait(WATCH_INTERVAL):
                    return
            message = store.get(self.key).decode()
        except Exception as exc:  # noqa: BLE001 - a store that stops answering
            if not self._stop.is_set():
                logger.warning(
                    f"Process {self.rank} stopped watching for a failure of {self.subject}: the process group's store "
                    f"failed ({type(exc).__name__}: {exc}). If the main process reports one, this process learns of it "
                    "from the launcher only."
                )
                self._deregister()  # the main process does not wait for this one's note
            return
        self.seen.set()
        _hold_uncaught_exceptions()
        logger.error(f"Process {self.rank} stops: {message}")
        sys.stderr.write(f"{self.error_name} on process {self.rank}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            store.add(f"{self.key}/noted", 1)
        except Exception as exc:  # noqa: BLE001 - the main process then waits NOTICE_TIMEOUT for this note
            logger.warning(
                f"Process {self.rank} could not tell the main process that it took note of the failure "
                f"({type(exc).__name__}: {exc}): the main process waits up to {NOTICE_TIMEOUT:g} s for it."
            )
        timeout = self.main_exit_timeout
        deadline = time.monotonic() + timeout
        try:
            while not store.check([f"{self.key}/main_exited"]) and time.monotonic() < deadline:
                time.sleep(WATCH_INTERVAL)
            if time.monotonic() < deadline:
                # The mark is set before the main process's interpreter shuts down: on its machine, wait for the end.
                mark = store.get(f"{self.key}/main_exited")
                while _still_running(mark) and time.monotonic() < deadline:
                    time.sleep(WATCH_INTERVAL)
        except Exception as exc:  # noqa: BLE001 - the store went with the main process (a store it hosted): it has ended
            logger.info(
                f"Process {self.rank}: the process group's store stopped answering ({type(exc).__name__}: {exc}); "
                f"taken as the end of the main process, which hosts it. This process ends in {EXIT_GRACE:g} s."
            )
        else:
            if time.monotonic() >= deadline:
                sys.stderr.write(
                    f"Process {self.rank}: the main process did not end within {timeout:g} s of the failure "
                    f"(main_process_exit_timeout={timeout:g}); this process ends now, and the launcher ends the main "
                    "process, cutting its cleanup short. Raise main_process_exit_timeout in the config if the main "
                    "process needs longer to clean up (its `finally` blocks, trackers and `atexit` handlers).\n"
                )
                sys.stderr.flush()
                os._exit(1)
        time.sleep(EXIT_GRACE)  # the launcher ends the job, naming the main process, within this time
        os._exit(1)


def _this_process() -> str:
    """This process as the main process marks its exit (``host/pid``; read by [`_still_running`])."""
    return f"{socket.gethostname()}/{os.getpid()}"


def _still_running(mark: bytes) -> bool:
    """Whether the process that marked its exit with `mark` ([`_this_process`]) still runs. Known only on its machine
    (anywhere else, and for a mark without a process id, False: the mark stands for the end); a process that has ended
    but is not yet reaped by its launcher (a zombie) has ended."""
    import psutil

    host, _, pid = mark.decode(errors="replace").rpartition("/")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # NoSuchProcess: ended and reaped
        return False


def stop_all_watchers() -> None:
    """Stop and join every watcher of this process (an `atexit` handler; the trainers stop theirs after `train()`)."""
    for watcher in list(_WATCHERS):
        watcher.stop()


def _hold_uncaught_exceptions() -> None:
    """Once this process has taken note of the main process's failure, an error of its own main thread (e.g. a
    collective whose peer ended) is the consequence, not the cause: it is not printed, and the main thread waits for
    the watcher to end the process."""
    original = sys.excepthook

    def hold(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return original(exc_type, exc, tb)
        while True:
            time.sleep(60)

    sys.excepthook = hold


def tell_other_processes(trainer, message: str) -> None:
    """On the main process of a multi-process run: log `message` (the failure this process is about to raise), post it
    for the other processes' watchers under the trainer's key, and wait until each watcher has taken note of it, at
    most [`NOTICE_TIMEOUT`] seconds (a warning names how many did not). Its exit is then marked for them by an `atexit`
    handler."""
    accelerator = trainer.accelerator
    if accelerator.num_processes == 1 or not accelerator.is_main_process:
        return
    logger.error(message)
    store = _default_store()
    if store is None:
        return
    key = failure_key(trainer)
    try:
        if store.check([key]):  # told already (a second error on the way out)
            return
        store.set(key, message)
        _POSTED.append((store, key))
        watchers = store.add(f"{key}/watchers", 0)
        deadline = time.monotonic() + NOTICE_TIMEOUT
        while (noted := store.add(f"{key}/noted", 0)) < watchers and time.monotonic() < deadline:
            time.sleep(0.1)
            watchers = store.add(f"{key}/watchers", 0)  # a watcher whose store failed deregisters
    except Exception as exc:  # noqa: BLE001 - the others are told by the launcher then; the error is raised all the same
        logger.warning(f"The other processes could not be told of the failure: the store failed ({exc}).")
        return
    if noted < watchers:
        logger.warning(
            f"{watchers - noted} of {watchers} watching process(es) did not take note of the failure within "
            f"{NOTICE_TIMEOUT:.0f} s; the launcher ends them when this process exits."
        )


def _mark_exits() -> None:
    """Mark, for the watchers, that this process (a main process that posted a failure) is ending, naming it
    ([`_this_process`]): on its machine, a watcher then waits for the process itself to end."""
    failed = []
    for store, key in _POSTED:
        try:
            store.set(f"{key}/main_exited", _this_process())
        except Exception as exc:  # noqa: BLE001 - any store error: the others then wait their longer bound
            failed.append(f"{key} ({type(exc).__name__}: {exc})")
    if failed:
        logger.warning(
            f"The main process could not mark its exit for the other processes in the process group's store "
            f"({'; '.join(failed)}): they wait up to main_process_exit_timeout (default {MAIN_EXIT_TIMEOUT:g} s) "
            f"after the failure instead of {EXIT_GRACE:g} s after this exit, unless the launcher ends them first."
        )


# Registered when the module is first imported, before a trainer (and its trackers) registers anything: it runs after
# their handlers (last in, first out), so the main process's cleanup is over when the others are let go.
atexit.register(_mark_exits)


@contextlib.contextmanager
def watching(trainer):
    """Around `train()`, `evaluate()` and `predict()` (every call in which the trainer may use the server): the
    trainer's watcher (if it has one) runs, and is stopped and joined when the outermost such call ends (an evaluation
    inside `train()` leaves it running)."""
    watcher = getattr(trainer, "_rpg_failure_watcher", None)
    if watcher is None:
        yield
        return
    depth = getattr(trainer, "_rpg_watch_depth", 0)
    trainer._rpg_watch_depth = depth + 1
    if depth == 0:
        watcher.start()
    try:
        yield
    finally:
        trainer._rpg_watch_depth = depth
        if depth == 0 and not watcher.seen.is_set():
            watcher.stop()


@contextlib.contextmanager
def deadline(trainer, seconds: float, message, error_name: str):
    """On the main process: if the block has not finished within `seconds`, log `message` (a string, or a function
    that returns it then), post it for the other processes ([`tell_other_processes`]), write
    `{error_name}: {message}` on stderr and end the process with status 1 (its main thread is then inside a call that
    no Python code can interrupt, e.g. a transfer to a server that died in the middle of it). The other processes do
    nothing here (their watchers end them)."""
    if not trainer.accelerator.is_main_process:
        yield
        return
    done = threading.Event()

    def expire():
        if done.wait(seconds):
            return
        text = message() if callable(message) else message
        tell_other_processes(trainer, text)
        sys.stderr.write(f"{error_name}: {text}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        _mark_exits()
        os._exit(1)

    thread = threading.Thread(target=expire, name="rpg-trl-deadline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
