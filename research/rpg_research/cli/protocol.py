# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""What a comparison fixed in advance needs, shared by the tables of ``rpg-trl bench-algos``: intervals over seeds,
paired differences, a selection rule, and runs spread over worker processes and cached on disk.

* [`mean_interval`] and [`paired_difference`]: a mean over seeds with its two-sided 95 % Student-t confidence interval,
  and the same for the per-seed difference of two methods run on the same seeds (paired: the warm start of a seed is
  shared, so most of the spread between seeds cancels).
* [`select_best`]: the selection rule (the highest mean score, ties to the smaller value).
* [`run_jobs`] with [`job_pool`]: runs independent jobs in worker processes (one torch thread each: results do not depend on how
  many workers run, only the wall time does), each writing ``result.json`` into its own folder; a job whose folder
  holds the result of the same specification is read back instead of run again, so an interrupted protocol resumes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


#: Two-sided 95 % quantiles of Student's t distribution, t_{0.975, df}, for df = 1 ... 30 (standard tables).
T_975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
#: The normal quantile, used beyond the table (df > 30).
Z_975 = 1.960

RESULT_NAME = "result.json"


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width of a 95 % interval is this times the standard error."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"`df` (degrees of freedom) must be an integer >= 1; got {df!r}.")
    return T_975[df - 1] if df <= len(T_975) else Z_975


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean of `values` and the half-width of its 95 % Student-t confidence interval (NaN for a single value)."""
    values = list(values)
    if not values:
        raise ValueError("`values` is empty: an interval needs at least one value.")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, math.nan
    return mean, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired_difference(values: dict, baseline: dict) -> tuple[float, float, int]:
    """
    Mean of `values[seed] − baseline[seed]` over the seeds both hold, the half-width of its 95 % interval, and the
    number of seeds. Raises when they share no seed (the comparison would not be paired).
    """
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        raise ValueError("A paired difference needs runs on the same seeds; these share none.")
    mean, half = mean_interval([values[s] - baseline[s] for s in seeds])
    return mean, half, len(seeds)


def select_best(scores: dict[float, list[float]]) -> float:
    """The selection rule: the key (e.g. a learning rate) with the highest mean score; ties go to the smaller key."""
    if not scores or any(not v for v in scores.values()):
        raise ValueError("Every candidate needs at least one score to select among them.")
    return max(sorted(scores), key=lambda key: (statistics.fmean(scores[key]), -key))


def format_interval(mean: float, half: float, *, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    """``mean ± half`` scaled by `scale` (e.g. 100 for points), with a sign on the mean when `sign`; ``mean`` alone when
    the interval is undefined (one seed)."""
    text = f"{mean * scale:+.{digits}f}" if sign else f"{mean * scale:.{digits}f}"
    return text if math.isnan(half) else f"{text} ± {half * scale:.{digits}f}"


def _canonical(spec: dict) -> dict:
    """`spec` with each folder (a key ending in ``_dir``) by the real path it names, so that a folder reached through
    another output directory or a link is the same specification."""
    return {k: os.path.realpath(v) if k.endswith("_dir") and isinstance(v, str) else v for k, v in spec.items()}


def cached_result(run_dir: Path, spec: dict) -> dict | None:
    """The result stored in `run_dir` by [`run_jobs`] if it was computed for `spec` (folders compared by their real
    path), else None."""
    path = Path(run_dir) / RESULT_NAME
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    stored_spec = stored.get("spec")
    return stored["result"] if isinstance(stored_spec, dict) and _canonical(stored_spec) == _canonical(spec) else None


def _run_one(worker: Callable, spec: dict, run_dir: str, num_threads: int) -> dict:
    """Run `worker(spec, run_dir)` with `num_threads` torch threads and store its result next to `spec`."""
    from ..toy.training import cpu_session

    with cpu_session(num_threads):
        result = worker(spec, run_dir)
    path = Path(run_dir) / RESULT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"spec": spec, "result": result}, indent=2) + "\n")
    tmp.replace(path)  # a result is stored whole or not at all
    return result


@contextmanager
def job_pool(num_workers: int):
    """The worker processes that [`run_jobs`] spreads its jobs over (spawned, so each imports torch afresh; None
    with a single worker, which runs the jobs in this process). One pool serves every phase of a command."""
    if num_workers <= 1:
        yield None
        return
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=num_workers, mp_context=get_context("spawn")) as pool:
        yield pool


def run_jobs(
    jobs: list[tuple[dict, str]],
    worker: Callable,
    *,
    pool=None,
    num_threads: int = 1,
    desc: str,
    describe: Callable[[dict, dict], str] | None = None,
) -> list[dict]:
    """
    Run `worker(spec, run_dir)` for each `(spec, run_dir)` of `jobs` and return the results in the order of `jobs`.

    A job whose `run_dir` already holds the result of the same `spec` is not run again. With a `pool` of
    [`job_pool`] the jobs run in its processes (`worker` must be a module-level function, `spec` JSON-serialisable),
    else one after the other in this process. A progress bar counts the jobs; `describe(spec, result)`, when given,
    prints one line per finished job.
    """
    from concurrent.futures import as_completed

    from tqdm.auto import tqdm

    results: list[dict | None] = [cached_result(Path(run_dir), spec) for spec, run_dir in jobs]
    todo = [i for i, result in enumerate(results) if result is None]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc, leave=True)

    def done(index: int, result: dict) -> None:
        results[index] = result
        bar.update()
        if describe is not None:
            tqdm.write(describe(jobs[index][0], result))

    try:
        if pool is None:
            for index in todo:
                done(index, _run_one(worker, jobs[index][0], jobs[index][1], num_threads))
        else:
            futures = {pool.submit(_run_one, worker, *jobs[i], num_threads): i for i in todo}
            for future in as_completed(futures):
                done(futures[future], future.result())
    finally:
        bar.close()
    return results
