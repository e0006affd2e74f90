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
weigh twice as much against it. The recipes in `recipes/` set these weights; the per-function metric
`rewards/accuracy_reward/mean` stays the accuracy (TRL logs each function's reward before weighting). An unscorable
reference answer (accuracy `None`) counts as incorrect, as the authors' exact-match score does.

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

import logging
import re
import threading
from collections.abc import Callable
from functools import lru_cache

from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
from trl.rewards import get_soft_overlong_punishment as _trl_get_soft_overlong_punishment


__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_COMPLETION_CHARS",
    "PARSING_TIMEOUT_SECONDS",
    "VERIFY_TIMEOUT_SECONDS",
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
#: limits with ``signal.alarm``, which only works in the main thread; elsewhere the limits are disabled (see
#: [`accuracy_reward`]).
PARSING_TIMEOUT_SECONDS = 5
VERIFY_TIMEOUT_SECONDS = 5

# "Answer:" (any case, optionally in markdown bold, e.g. "**Answer:**" or "**Answer**:"), then the first non-empty
# line after it. `\s*` may cross a line break, so "Answer:\n42" yields "42", as in the DAPO verifier.
_ANSWER_RE = re.compile(r"answer[ \t*_]*:[ \t*_]*\s*([^\n]+)", re.IGNORECASE)
# The paper's format: the last non-empty line reads "Answer: <something>" (markdown bold around the marker allowed).
_FORMAT_LINE_RE = re.compile(r"^(?:\*\*)?Answer(?:\*\*)?[ \t]*:(?:\*\*)?[ \t]*\S")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_LATEX_CONFIG = [LatexExtractionConfig(boxed_match_priority=0)]

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


def _parse_boxed(answer: str, timeout: int | None) -> list:
    # Wrapping the bare answer in \boxed{} makes math-verify parse the whole string as one LaTeX expression. Parsing a
    # bare "3\sqrt{3}" with the default extraction would instead pick out the plain number "3".
    return parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX_CONFIG, parsing_timeout=timeout)


@lru_cache(maxsize=4096)
def _parse_gold(solution: str, timeout: int | None) -> list:
    """Parsed reference answer (cached: every prompt's solution is scored once per sampled completion)."""
    boxed = _last_boxed_content(solution)
    answer = _clean_answer(boxed if boxed is not None else solution)
    if not answer:
        return []
    return _parse_boxed(answer, timeout)


def _warn_once(exc: BaseException) -> None:
    global _warned_exception
    if not _warned_exception:
        logger.warning(
            "A completion could not be scored and got reward 0.0 (%s: %s). Further failures are not reported.",
            type(exc).__name__,
            exc,
        )
        _warned_exception = True


def accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    r"""
    Verifiable correctness reward of the paper (Sec. 5, Appendix H): 1.0 if the final answer of a completion is
    mathematically equal to the reference answer, 0.0 otherwise.

    The answer is read with [`extract_answer`] (the last ``Answer:`` line, else the last ``\boxed{}``) and compared
    with the reference by [math-verify](https://github.com/huggingface/Math-Verify), so that e.g. ``\frac{1}{2}``,
    ``0.5`` and ``2/4`` are equal. A completion without an answer scores 0.0. The reference may be a bare answer
    (``"42"``, ``"\frac{1}{2}"``), an answer in math delimiters or a worked solution ending in ``\boxed{...}``.

    The function never raises on a completion: empty, garbled or huge completions score 0.0, and an unexpected error
    while scoring one completion gives it 0.0 (logged once). math-verify bounds parsing and comparison time with
    ``signal.alarm``, which only works in the main thread; when called from another thread the time limits are
    disabled ([`MAX_COMPLETION_CHARS`] and [`MAX_ANSWER_CHARS`] still bound the input size).

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
    if len(completions) != len(solution):
        raise ValueError(
            f"`completions` and `solution` must have the same length; got {len(completions)} and {len(solution)}."
        )
    in_main_thread = threading.current_thread() is threading.main_thread()
    parsing_timeout = PARSING_TIMEOUT_SECONDS if in_main_thread else None
    verify_timeout = VERIFY_TIMEOUT_SECONDS if in_main_thread else None

    rewards: list[float | None] = []
    extracted: list[str] = []
    for completion, gold in zip(completions, solution):
        answer = None
        try:
            gold_parsed = _parse_gold(str(gold), parsing_timeout) if gold is not None else []
        except (Exception, TimeoutException) as exc:
            _warn_once(exc)
            gold_parsed = []
        if not gold_parsed:
            rewards.append(None)
            extracted.append("[unparseable solution]")
            continue
        try:
            answer = extract_answer(_completion_text(completion))
            if answer is None or len(answer) > MAX_ANSWER_CHARS:
                reward = 0.0
            else:
                answer_parsed = _parse_boxed(answer, parsing_timeout)
                correct = bool(answer_parsed) and verify(gold_parsed, answer_parsed, timeout_seconds=verify_timeout)
                reward = 1.0 if correct else 0.0
        except (Exception, TimeoutException) as exc:
            _warn_once(exc)
            reward = 0.0
        rewards.append(reward)
        extracted.append("[no answer]" if answer is None else answer)

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
    return _trl_get_soft_overlong_punishment(max_completion_len, soft_punish_cache)
