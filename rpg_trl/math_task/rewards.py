# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""Reward functions for the paper's math-reasoning setup (Sec. 5 and Appendix H).

The paper trains on DAPO-Math-17k and evaluates on AIME24, AIME25 and AMC23 with a rule-based, verifiable reward: the
prompt (see [`rpg_trl.math_task.data.PROMPT_TEMPLATE`]) asks the model to end its response with a line
``Answer: $Answer``, the answer on that line is compared with the reference answer, and the reward is 1 when they agree
and 0 otherwise. Long responses are additionally shaped with DAPO's soft overlong punishment (buffer 512 at a 2K
context, penalty factor 1).

**The authors' reward scale.** The authors' code (a verl fork) scores with DAPO's rule, +1 for a correct answer and -1
otherwise, then adds the overlong penalty: r = s + o with s = 2a - 1, where a is [`accuracy_reward`]'s 1/0. With
TRL's `reward_weights=[2.0, 1.0]` for `[accuracy_reward, overlong punishment]` the trainer's reward is
2a + o = r + 1, and a constant cancels in every group-relative advantage: with `scale_rewards="none"` (the paper's
advantage, reward - group mean) the advantages are exactly the authors'; divided by the group std (the GRPO and DAPO
baselines) they agree up to the std's epsilon. With the 1/0 reward unweighted, the accuracy part of every advantage is
exactly half the authors' (a - mean(a) = (s - mean(s)) / 2), so the KL coefficient β and the overlong penalty would
weigh twice as much against it. The project's training recipes (the YAML configurations of the paper's runs) set
these weights; the per-function metric `rewards/accuracy_reward/mean` stays the accuracy (TRL logs each function's
reward before weighting). An unscorable reference answer (accuracy `None`) counts as incorrect, as the authors'
exact-match score does.

Every function follows TRL's reward-function convention, so it can be passed directly as ``reward_funcs`` to
[`~trl.GRPOTrainer`] or [`rpg_trl.RPGTrainer`]:

```python
def reward(completions, **kwargs) -> list[float | None]
```

``completions`` are plain strings (standard format) or lists of ``{"role", "content"}`` messages (conversational
format); dataset columns such as ``solution`` arrive as keyword arguments. A ``None`` reward tells the trainer that the
function does not apply to that sample.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from functools import lru_cache


# math-verify is the `math` extra's (`pip install "rpg_trl[math]"`): without it the module imports, and
# [`accuracy_reward`] refuses to score, naming the extra (as TRL's own accuracy reward checks it at use).
try:
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException
except ImportError as exc:
    _MATH_VERIFY_MISSING: ImportError | None = exc
else:
    _MATH_VERIFY_MISSING = None


__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_COMPLETION_CHARS",
    "MAX_VERIFY_WORKERS",
    "PARSING_TIMEOUT_SECONDS",
    "VERIFY_TIMEOUT_SECONDS",
    "WORKER_TIMEOUT_SECONDS",
    "accuracy_reward",
    "extract_answer",
    "format_reward",
    "get_soft_overlong_punishment",
]


logger = logging.getLogger(__name__)

#: Only the last ``MAX_COMPLETION_CHARS`` characters of a completion are searched for the answer. The answer line is
#: the last line of a well-formed response, so this loses nothing for well-formed responses and keeps huge (e.g.
#: degenerate, repetitive) completions as cheap to score as short ones.
MAX_COMPLETION_CHARS = 4096

#: Extracted answers longer than this are scored 0 without calling the parser: no answer in the paper's benchmarks
#: (integers for AIME and DAPO-Math-17k, short expressions for AMC) comes close, and sympy can be slow on long input.
MAX_ANSWER_CHARS = 1000

#: Seconds allowed to math-verify for parsing one expression and for one comparison. math-verify implements these
#: limits with ``signal.alarm``, which only works in the main thread of a process: off the main thread, completions are
#: scored in a worker process, where they hold again (see [`accuracy_reward`]).
PARSING_TIMEOUT_SECONDS = 5
VERIFY_TIMEOUT_SECONDS = 5

#: Off the main thread, the seconds one completion may take in the worker process (reference and answer parsed, then
#: compared) before the worker is killed and the completion scores 0.0. math-verify's own limits end a slow parse or
#: comparison inside the worker first (the worker runs them in its main thread); this deadline is the backstop for
#: whatever they cannot interrupt, e.g. a long computation inside one C call. It exceeds the longest run of those
#: limits on one completion (two parses and one comparison, 5 s each).
WORKER_TIMEOUT_SECONDS = 20.0

#: Most worker processes alive at once: one per thread that is scoring, further threads wait for a free one. Each
#: worker is a Python interpreter with math-verify and sympy loaded (about 100 MB), idle between completions.
MAX_VERIFY_WORKERS = 2

#: Seconds a new worker process may take to start (import math-verify and sympy) before [`accuracy_reward`] raises.
WORKER_START_TIMEOUT_SECONDS = 120.0

# "Answer:" (any case, optionally in markdown bold, e.g. "**Answer:**" or "**Answer**:"), then the first non-empty
# line after it. `\s*` may cross a line break, so "Answer:\n42" yields "42", as in the DAPO verifier.
_ANSWER_RE = re.compile(r"answer[ \t*_]*:[ \t*_]*\s*([^\n]+)", re.IGNORECASE)
# The paper's format: the last non-empty line reads "Answer: <something>" (markdown bold around the marker allowed).
_FORMAT_LINE_RE = re.compile(r"^(?:\*\*)?Answer(?:\*\*)?[ \t]*:(?:\*\*)?[ \t]*\S")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_LATEX_CONFIG = [LatexExtractionConfig(boxed_match_priority=0)] if _MATH_VERIFY_MISSING is None else []

_warned_exception = False


def _last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or `None` if there is none."""
    starts = [match.end() for match in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for index in range(start, len(text)):
            char = text[index]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[start:index]
    return None


def _clean_answer(answer: str) -> str:
    """Strips markdown emphasis, a trailing full stop and math delimiters around a whole answer."""
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().strip("*").strip()
        if answer.endswith("."):
            answer = answer[:-1].rstrip()
        for left, right in _MATH_DELIMITERS:
            if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
                answer = answer[len(left) : -len(right)]
                break
    return answer


def extract_answer(text: str) -> str | None:
    r"""
    Extracts the final answer from a model response written in the paper's format.

    The prompt of the paper (Sec. 5, Appendix H) asks for a last line of the form ``Answer: $Answer``. The answer is
    taken from the **last** ``Answer:`` marker (case-insensitive, markdown bold allowed; if nothing follows the marker
    on its line, the next non-empty line is used). If the response has no such marker, the content of the last
    ``\boxed{...}`` is used instead. A ``\boxed{...}`` on the answer line is unwrapped, and surrounding math delimiters
    (``$...$``, ``\(...\)``, ``\[...\]``), markdown asterisks and a trailing full stop are removed.

    Only the last [`MAX_COMPLETION_CHARS`] characters of `text` are searched, so the cost does not grow with the
    length of the response.

    Args:
        text (`str`):
            Model response. Anything that is not a string gives `None`.

    Returns:
        `str` or `None`: The answer as written by the model (not normalised), or `None` if the response contains no
        answer.

    Example:
    ```python
    >>> from rpg_trl.math_task.rewards import extract_answer

    >>> extract_answer("The sum is 2 + 2.\nAnswer: $4$.")
    '4'
    >>> extract_answer(r"so the result is \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> extract_answer("no final answer here") is None
    True
    ```
    """
    if not isinstance(text, str):
        return None
    text = text[-MAX_COMPLETION_CHARS:]
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        answer = matches[-1].group(1)
        # "Answer: Answer: 5" (or a marker on the line right after an empty one) nests a second marker.
        while (nested := _ANSWER_RE.search(answer)) is not None:
            answer = nested.group(1)
        boxed = _last_boxed_content(answer)
        answer = _clean_answer(boxed if boxed is not None else answer)
        if answer:
            return answer
    boxed = _last_boxed_content(text)
    if boxed is not None:
        boxed = _clean_answer(boxed)
        if boxed:
            return boxed
    return None


def _completion_text(completion) -> str:
    """Text of a completion: the string itself, or the content of the last assistant message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)) or not completion:
        return ""
    messages = [message for message in completion if isinstance(message, dict)]
    assistant = [message for message in messages if message.get("role") == "assistant"]
    candidates = assistant or messages
    if not candidates:
        return ""
    content = candidates[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal content: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _parse_boxed(answer: str, timeout: int | None) -> tuple[list, bool]:
    """`(parsed, timed_out)`: math-verify's parse of `answer` ([] if it cannot be parsed), and whether parsing it took
    longer than `timeout` seconds (then `parsed` is [])."""
    # Wrapping the bare answer in \boxed{} makes math-verify parse the whole string as one LaTeX expression. Parsing a
    # bare "3\sqrt{3}" with the default extraction would instead pick out the plain number "3".
    try:
        # raise_on_error=True so that a timeout is told apart from an answer that does not parse (both give []).
        parsed = parse(
            f"\\boxed{{{answer}}}", extraction_config=_LATEX_CONFIG, parsing_timeout=timeout, raise_on_error=True
        )
    except TimeoutException:
        return [], True
    except Exception:
        return [], False
    return parsed, False


@lru_cache(maxsize=4096)
def _parse_gold(solution: str, timeout: int | None) -> tuple[list, bool]:
    """Parsed reference answer and whether parsing it timed out (cached: every prompt's solution is scored once per
    sampled completion)."""
    boxed = _last_boxed_content(solution)
    answer = _clean_answer(boxed if boxed is not None else solution)
    if not answer:
        return [], False
    return _parse_boxed(answer, timeout)


def _score(solution: str, answer: str | None, parsing_timeout: int, verify_timeout: int) -> tuple[float | None, bool]:
    """`(reward, timed_out)` of one completion whose extracted answer is `answer`: `None` for a reference that cannot
    be parsed, else 1.0 or 0.0; `timed_out` says that math-verify's time limit cut parsing short. Runs in the main
    thread of a process, where math-verify's ``signal.alarm`` limits work: the caller's, or a worker's."""
    gold_parsed, gold_timed_out = _parse_gold(solution, parsing_timeout)
    if not gold_parsed:
        return None, gold_timed_out
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0, False
    answer_parsed, timed_out = _parse_boxed(answer, parsing_timeout)
    # math-verify's `verify(gold, answer)` tries every pair of the two parses (a sympy expression and its string, at
    # most, for each) with one time limit per pair; pair by pair, and with raise_on_error=True, a time-out is seen.
    for gold_item, answer_item in itertools.product(gold_parsed, answer_parsed):
        try:
            if verify(gold_item, answer_item, timeout_seconds=verify_timeout, raise_on_error=True):
                return 1.0, False
        except TimeoutException:
            timed_out = True
        except Exception:  # math-verify's verify counts a comparison that fails as "not equal"
            pass
    return 0.0, timed_out


def _warn_once(exc: BaseException) -> None:
    global _warned_exception
    if not _warned_exception:
        logger.warning(
            "A completion could not be scored and got reward 0.0 (%s: %s). Further failures are not reported.",
            type(exc).__name__,
            exc,
        )
        _warned_exception = True


_timeouts_lock = threading.Lock()
_timeouts = 0


def _warn_timeout(what: str, text: str) -> None:
    """Count one completion (or reference) cut short by the time limit; warn at the 1st, 10th, 100th, ... of them."""
    global _timeouts
    with _timeouts_lock:
        _timeouts += 1
        count = _timeouts
    if str(count).rstrip("0") != "1":
        return
    shown = text if len(text) <= 200 else text[:197] + "..."
    logger.warning(
        "%s was not verified within the time limit (%s): math-verify's %d s per parse and %d s per comparison, "
        "and %g s per completion in a worker process off the main thread. This is time-out #%d of this process "
        "(reported at the 1st, 10th, 100th, ... time-out).",
        what,
        shown,
        PARSING_TIMEOUT_SECONDS,
        VERIFY_TIMEOUT_SECONDS,
        WORKER_TIMEOUT_SECONDS,
        count,
    )


# ---------------------------------------------------------------------------------------------------- worker processes
# math-verify bounds its work with `signal.alarm`, which only the main thread of a process can use. Off the main thread
# (TRL's asynchronous rollout worker calls a synchronous reward through `asyncio.to_thread`), each completion is scored
# by `_score` in the main thread of a worker process, where those limits hold, and the worker is killed if it does not
# answer within WORKER_TIMEOUT_SECONDS. The worker is a fresh interpreter (`subprocess`, not `fork`: forking a process
# that has torch and threads loaded is unsafe; not `multiprocessing`'s spawn either, which would re-import the user's
# `__main__` script) that loads this file alone, so it imports math-verify and sympy but not torch or TRL (under a
# second to start). Requests and answers are JSON lines on its stdin and on a copy of its stdout. A worker ends with
# the thread that started it (below), so that none outlives a process killed without running its exit handlers, such
# as TRL's rollout worker stopped by `terminate()`.

_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_rpg_math_verify_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(int(sys.argv[2]))\n"
)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _end_with_parent(parent: int) -> None:
    """On Linux, ask the kernel to kill this worker when the thread that started it ends (`PR_SET_PDEATHSIG`, which
    follows the starting thread, not its process): the end of stdin would come only after the current completion,
    and a parse stuck inside one C call can take minutes. Elsewhere the worker ends at the end of its stdin."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the request above
        os._exit(0)


def _worker_main(parent: int) -> None:
    """Loop of a worker process started by process `parent`: one JSON request per line on stdin, one JSON answer per
    line back."""
    import signal

    _end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which ends its workers
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # time-outs are reported by the calling process
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the answers
    channel.write("ready\n")
    channel.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reward, timed_out = _score(
                request["solution"], request["answer"], request["parsing_timeout"], request["verify_timeout"]
            )
            answer = {"reward": reward, "timed_out": timed_out}
        except BaseException as exc:  # reported to the caller, which scores the completion 0.0
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(answer) + "\n")
        channel.flush()


class _WorkerStartError(RuntimeError):
    """A worker process could not be started: not a property of a completion, so [`accuracy_reward`] raises it."""


class _Worker:
    """One worker process, started at its first request and again after it was killed."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> None:
        # The parent's import path, so that the worker finds math-verify wherever the parent found it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self._buffer = b""
        if self._read_line(time.monotonic() + WORKER_START_TIMEOUT_SECONDS) != b"ready":
            code = self.process.poll()
            self.kill()
            state = f"exited with code {code}" if code is not None else "did not start"
            raise _WorkerStartError(
                f"accuracy_reward's math-verify worker process ({sys.executable}) {state} within "
                f"{WORKER_START_TIMEOUT_SECONDS:g} s; off the main thread every completion is scored in such a "
                "worker, so the reward cannot run. Its error, if any, is on stderr above."
            )

    def _read_line(self, deadline: float) -> bytes | None:
        """The worker's next line, or None if it does not come before `deadline` (monotonic) or the worker ended."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                if time.monotonic() >= deadline:
                    return None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: the worker ended
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.strip()

    def score(self, request: dict) -> dict | None:
        """The worker's answer to `request`, or None if it took longer than [`WORKER_TIMEOUT_SECONDS`] or ended while
        scoring it; the worker is then killed, and started again at the next request. A worker that ended between two
        requests (the thread that started it ended) is started again first, so the request is still scored."""
        for _ in range(2):
            if self.process is not None and self.process.poll() is not None:
                self.kill()
            if self.process is None:
                self._start()
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                break
            except OSError:  # the worker ended since the check above
                self.kill()
        else:
            return None
        line = self._read_line(time.monotonic() + WORKER_TIMEOUT_SECONDS)
        if line is None:
            self.kill()
            return None
        return json.loads(line)

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.kill()
            process.wait()
            process.stdin.close()
            process.stdout.close()


class _WorkerPool:
    """At most [`MAX_VERIFY_WORKERS`] workers, each lent to one thread at a time; started lazily, kept for reuse."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._workers: list[_Worker] = []
        self._slots: threading.BoundedSemaphore | None = None
        self._pid = os.getpid()

    @contextmanager
    def worker(self):
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's workers are not its own
                self._idle, self._workers, self._slots, self._pid = [], [], None, os.getpid()
            if self._slots is None:
                self._slots = threading.BoundedSemaphore(MAX_VERIFY_WORKERS)
            slots = self._slots
        slots.acquire()
        try:
            with self._lock:
                if self._idle:
                    worker = self._idle.pop()
                else:
                    worker = _Worker()
                    self._workers.append(worker)
            try:
                yield worker
            finally:
                with self._lock:
                    self._idle.append(worker)
        finally:
            slots.release()

    def close(self) -> None:
        """Kill every worker of this process (at exit; the next request starts new ones)."""
        with self._lock:
            workers = self._workers if self._pid == os.getpid() else []
            self._idle, self._workers = [], []
        for worker in workers:
            worker.kill()


_POOL = _WorkerPool()
atexit.register(_POOL.close)


def _score_in_worker(worker: _Worker, solution: str, answer: str | None) -> tuple[float | None, bool]:
    """`_score` in `worker`; a completion that takes longer than [`WORKER_TIMEOUT_SECONDS`] scores 0.0, timed out."""
    request = {
        "solution": solution,
        "answer": answer,
        "parsing_timeout": PARSING_TIMEOUT_SECONDS,
        "verify_timeout": VERIFY_TIMEOUT_SECONDS,
    }
    result = worker.score(request)
    if result is None:
        return 0.0, True
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["reward"], result["timed_out"]


def accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    r"""
    Verifiable correctness reward of the paper (Sec. 5, Appendix H): 1.0 if the final answer of a completion is
    mathematically equal to the reference answer, 0.0 otherwise.

    The answer is read with [`extract_answer`] (the last ``Answer:`` line, else the last ``\boxed{}``) and compared
    with the reference by [math-verify](https://github.com/huggingface/Math-Verify), so that e.g. ``\frac{1}{2}``,
    ``0.5`` and ``2/4`` are equal. A completion without an answer scores 0.0. The reference may be a bare answer
    (``"42"``, ``"\frac{1}{2}"``), an answer in math delimiters or a worked solution ending in ``\boxed{...}``.

    The function never raises on a completion: empty, garbled or huge completions score 0.0, and an unexpected error
    while scoring one completion gives it 0.0 (logged once). It needs math-verify, the `math` extra's
    (`pip install "rpg_trl[math]"`): without it, it raises an `ImportError` that says so before scoring anything.

    **Time limit, in any thread.** math-verify bounds parsing ([`PARSING_TIMEOUT_SECONDS`], 5 s) and each comparison
    ([`VERIFY_TIMEOUT_SECONDS`], 5 s) with ``signal.alarm``, which only works in the main thread. Called from the main
    thread, the function uses those limits directly. Called from any other thread (TRL's asynchronous rollout worker
    calls a synchronous reward through `asyncio.to_thread`), it scores each completion in a worker process, in that
    process's main thread where the same limits hold, and kills the worker if one completion takes longer than
    [`WORKER_TIMEOUT_SECONDS`] (20 s; the next completion starts a new worker). Workers are started at the first call
    off the main thread (a Python interpreter with math-verify and sympy, not torch: under a second), reused, at most
    [`MAX_VERIFY_WORKERS`] at a time, and killed at exit; on Linux the kernel also ends a worker with the thread that
    started it, so none outlives a process killed without exit handlers (TRL stops its rollout worker so). A completion
    that exceeds a limit scores 0.0 ("not verified"; a reference that exceeds it gives `None`), with a warning at the
    1st, 10th, 100th, ... time-out.

    Bounded cost per completion: in the main thread at most 5 s to parse the answer and 5 s to compare it (plus 5 s
    to parse a reference the first time it is seen; references are cached); off the main thread at most
    [`WORKER_TIMEOUT_SECONDS`] plus the start of a new worker. Measured on answers that never finished off the main
    thread before (``\boxed{9^{9^{9^{9}}}}``, ``9^{9^{9}}``, ``10^{10^{8}}``, ``((99!)!)!``, a 450-digit power, an
    integral): 5.01-5.44 s each in the main thread and 5.01-5.46 s through `asyncio.to_thread` (math-verify's
    5 s limit ends each inside the worker; 2-core AMD EPYC, 2026-11-28, the command in docs: *Guarantees*, "How bad
    rewards are handled"); a worker killed at its deadline is replaced in 0.5-0.9 s
    (`test_a_worker_past_its_deadline_is_killed_and_replaced`). [`MAX_COMPLETION_CHARS`]
    and [`MAX_ANSWER_CHARS`] bound the input size.

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions in standard format (strings) or conversational format (lists of messages; the content of the
            last assistant message is scored).
        solution (`list[str]`):
            Reference answers, one per completion (the ``solution`` column of the dataset). Non-string values such as
            integers are converted with `str`.
        **kwargs:
            Other dataset columns and trainer-provided arguments. If the trainer passes a ``log_extra`` callable, the
            extracted answers are logged in the completions table under ``"extracted_answer"``.

    Returns:
        `list[float | None]`: 1.0 or 0.0 per completion, or `None` where the reference answer cannot be parsed (the
        trainer then ignores this reward for that sample).

    Example:
    ```python
    >>> from rpg_trl.math_task.rewards import accuracy_reward

    >>> completions = [
    ...     [{"role": "assistant", "content": "Half of 1 is 0.5.\nAnswer: 0.5"}],
    ...     [{"role": "assistant", "content": "Answer: 3"}],
    ... ]
    >>> accuracy_reward(completions, solution=[r"\frac{1}{2}", r"\frac{1}{2}"])
    [1.0, 0.0]
    ```
    """
    if _MATH_VERIFY_MISSING is not None:
        raise ImportError(
            "accuracy_reward compares answers with math-verify, which is not installed: "
            '`pip install "rpg_trl[math]"` (math-verify>=0.8).'
        ) from _MATH_VERIFY_MISSING
    if len(completions) != len(solution):
        raise ValueError(
            f"`completions` and `solution` must have the same length; got {len(completions)} and {len(solution)}."
        )
    rewards: list[float | None] = []
    extracted: list[str] = []
    with ExitStack() as stack:
        # math-verify's time limits use signal.alarm, which works in the main thread only: elsewhere, a worker process.
        in_main_thread = threading.current_thread() is threading.main_thread()
        worker = None if in_main_thread else stack.enter_context(_POOL.worker())
        for completion, gold in zip(completions, solution):
            answer = None
            try:
                answer = extract_answer(_completion_text(completion))
                if gold is None:
                    reward, timed_out = None, False
                elif worker is None:
                    reward, timed_out = _score(str(gold), answer, PARSING_TIMEOUT_SECONDS, VERIFY_TIMEOUT_SECONDS)
                else:
                    reward, timed_out = _score_in_worker(worker, str(gold), answer)
            except _WorkerStartError:
                raise
            except (Exception, TimeoutException) as exc:
                _warn_once(exc)
                reward, timed_out = 0.0, False
            if timed_out and reward is None:
                _warn_timeout("A reference answer (given reward None: not scored)", repr(str(gold)))
            elif timed_out:
                _warn_timeout("A completion (given reward 0.0)", f"its answer: {answer!r}")
            rewards.append(reward)
            extracted.append(
                "[unparseable solution]" if reward is None else "[no answer]" if answer is None else answer
            )

    log_extra = kwargs.get("log_extra")
    if callable(log_extra):
        log_extra("extracted_answer", extracted)
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    r"""
    Format reward: 1.0 if the last non-empty line of a completion has the form ``Answer: ...`` requested by the
    paper's prompt (Sec. 5, Appendix H), else 0.0.

    The marker must be spelled ``Answer:`` as in the prompt, optionally in markdown bold (``**Answer:** 42``), and be
    followed by a non-empty answer on the same line. Correctness is not checked (see [`accuracy_reward`]).

    Args:
        completions (`list[str]` or `list[list[dict[str, str]]]`):
            Completions in standard or conversational format (the last assistant message is checked).
        **kwargs:
            Ignored; accepted for compatibility with the trainer's reward-function interface.

    Returns:
        `list[float]`: 1.0 or 0.0 per completion.

    Example:
    ```python
    >>> from rpg_trl.math_task.rewards import format_reward

    >>> format_reward(["2 + 2 = 4\nAnswer: 4", "Answer: 4\nHope this helps!"])
    [1.0, 0.0]
    ```
    """
    rewards = []
    for completion in completions:
        lines = [line.strip() for line in _completion_text(completion).splitlines() if line.strip()]
        rewards.append(1.0 if lines and _FORMAT_LINE_RE.match(lines[-1]) else 0.0)
    return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    r"""
    DAPO's soft overlong punishment (DAPO paper, Eq. 13), used by the paper's recipes as overlong shaping (Sec. 5,
    Appendix H: a buffer of 512 tokens at a 2K context, penalty factor 1.0).

    $$
    R_{\text{length}}(y) = \begin{cases}
    0, & |y| \le L_{\max} - L_{\text{cache}} \\
    \dfrac{(L_{\max} - L_{\text{cache}}) - |y|}{L_{\text{cache}}}, & L_{\max} - L_{\text{cache}} < |y| \le L_{\max} \\
    -1, & L_{\max} < |y|
    \end{cases}
    $$

    This validates the arguments and returns TRL's implementation ([`trl.rewards.get_soft_overlong_punishment`]),
    which scores the ``completion_ids`` the trainer passes to reward functions.

    Args:
        max_completion_len (`int`):
            \\( L_{\max} \\), usually the trainer's `max_completion_length`.
        soft_punish_cache (`int`):
            \\( L_{\text{cache}} \\), the length of the buffer before \\( L_{\max} \\) over which the punishment grows
            linearly from 0 to -1. `0` gives a hard punishment of -1 beyond \\( L_{\max} \\) only.

    Returns:
        `Callable`: A reward function ``f(completion_ids, **kwargs) -> list[float]``.

    Example:
    ```python
    >>> from rpg_trl.math_task.rewards import get_soft_overlong_punishment

    >>> reward = get_soft_overlong_punishment(max_completion_len=2048, soft_punish_cache=512)
    >>> reward(completion_ids=[[0] * 1000, [0] * 1792, [0] * 2048])
    [0.0, -0.5, -1.0]
    ```
    """
    for name, value in (("max_completion_len", max_completion_len), ("soft_punish_cache", soft_punish_cache)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"`{name}` must be an integer number of tokens; got {value!r}.")
    if max_completion_len <= 0:
        raise ValueError(f"`max_completion_len` must be positive; got {max_completion_len}.")
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"`soft_punish_cache` must be between 0 and `max_completion_len` ({max_completion_len}); got "
            f"{soft_punish_cache}. The paper uses 512 with a 2048-token completion budget."
        )
    # Imported here: the module stays free of torch and TRL, so that a math-verify worker process can load it alone.
    from trl.rewards import get_soft_overlong_punishment as trl_get_soft_overlong_punishment

    return trl_get_soft_overlong_punishment(max_completion_len, soft_punish_cache)
