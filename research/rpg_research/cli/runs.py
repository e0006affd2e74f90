# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""One run of ``rpg-trl bench-algos``, shared by its two tables ([`rpg_research.cli.bench_algos`] and
[`rpg_research.cli.bench_kl`]): the specification its cached result is keyed by, the warm start it starts from with
its held-out evaluation, quiet training, and the summary of the run (held-out accuracy, stability, collapse)."""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path


#: Collapse: the run ends this far below its warm start (held-out accuracy), or its training reward (moving average)
#: falls this far below its running maximum.
COLLAPSE_ACCURACY_DROP = 0.05
COLLAPSE_REWARD_DROP = 0.20


def run_summary(history: list[dict], curve: list[dict], seconds: float, regime: int) -> dict:
    """
    The numbers of one run from its `log_history` and held-out `curve`: [`heldout_summary`]'s (Last, Gain, Best,
    largest reward drop), whether it collapsed, the entropy at the end (mean over the last generation batch's steps)
    and the means over training of the logged KL, clipped fraction and importance-weight extremes (None where the
    trainer does not log them).
    """
    from ..toy.curves import metric_series
    from .warm_start_bench import heldout_summary

    _, rewards = metric_series(history, "reward")

    def mean_of(key: str, last: int | None = None) -> float | None:
        values = metric_series(history, key)[1]
        values = values[-last:] if last else values
        return statistics.fmean(values) if values else None

    summary = heldout_summary(
        curve,
        rewards,
        seconds,
        entropy_end=mean_of("entropy", last=regime),
        kl=mean_of("kl"),
        clip_region=mean_of("clip_ratio/region_mean"),
        importance_weight_max=mean_of("importance_weight/max"),
        importance_weight_min=mean_of("importance_weight/min"),
    )
    summary["collapsed"] = (
        summary["last"] < summary["initial"] - COLLAPSE_ACCURACY_DROP
        or summary["max_reward_drop"] > COLLAPSE_REWARD_DROP
    )
    return summary


def quiet(trainer) -> None:
    """No per-run progress bar nor printed log lines (runs share the terminal; the command counts them)."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def warm_started(spec: dict, **heldout_kwargs):
    """The seed's splits of `spec`'s task (``spec["task"]``, [`rpg_research.cli.bench_tasks`]; the two-digit additions
    without one), the warm start of `spec` (model, tokenizer) and a held-out callback on them
    ([`rpg_research.toy.evaluation.heldout_accuracy_callback`]; by default the task's reward and completion length,
    `heldout_kwargs` replace them): what every run starts from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..toy.addition import evaluation_seed
    from ..toy.evaluation import heldout_accuracy_callback
    from .bench_tasks import bench_task, task_splits

    seed = spec["seed"]
    task = spec.get("task", "addition")
    splits = task_splits(task, seed, spec["eval_problems"], spec["sft_steps"])
    model = AutoModelForCausalLM.from_pretrained(spec["sft_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["sft_dir"])
    demo_task = bench_task(task).demo_task
    heldout_kwargs = {
        "reward_funcs": {"accuracy": demo_task.reward},
        "max_new_tokens": demo_task.max_completion_length,
        **heldout_kwargs,
    }
    heldout = heldout_accuracy_callback(
        model,
        tokenizer,
        splits.eval,
        every=spec["eval_every"],
        num_samples=spec["eval_samples"],
        seed=evaluation_seed(seed),
        **heldout_kwargs,
    )
    return splits, model, tokenizer, heldout


def train_quietly(trainer) -> float:
    """Train without progress bar nor printed logs ([`quiet`]), save the trainer state; return the seconds taken."""
    quiet(trainer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    return seconds


@functools.cache
def library_versions() -> dict[str, str]:
    """What, besides its settings, defines a run's result: the versions of Python and of the libraries that train it, and
    a digest of the source that trains (the library ``rpg_trl`` and this package outside its command line: the toy task,
    the CPU rollouts), so that a cached result is not read back after the code that produced it changed. Computed once
    per command (every run's specification holds a copy)."""
    import hashlib
    import importlib.metadata
    import platform

    import rpg_research
    import rpg_trl

    digest = hashlib.sha256()
    for package in (Path(rpg_trl.__file__).parent, Path(rpg_research.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            relative = path.relative_to(package.parent).as_posix()
            if relative.startswith("rpg_research/cli/"):
                continue  # tables and figures, not training
            digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    versions = {"python": platform.python_version(), "rpg_trl_source": digest.hexdigest()[:16]}
    for name in ("rpg_trl", "torch", "transformers", "trl", "accelerate"):
        versions[name] = importlib.metadata.version(name)
    return versions


def off_default_settings(args) -> dict:
    """`args`'s model size and device where they are not the defaults ("small", "cpu"; commands without these options
    have neither): part of a run's specification only then, so that the runs cached before these options existed stay
    valid."""
    defaults = (("model_size", "small"), ("device", "cpu"))
    return {key: getattr(args, key) for key, default in defaults if getattr(args, key, default) != default}


def run_spec(args, sft_dirs: dict[int, str], seed: int, *, config: dict, **arm) -> dict:
    """The specification of one run, what its cached result is keyed by: the `arm`'s name and settings, its trainer
    `config` (the overrides it trains with, the defaults it relies on resolved), the task, the seed and its warm start (folder
    and settings), the budget and evaluation shared by every run of the command, and [`library_versions`]."""
    return {
        **arm,
        "config": config,
        "task": args.task,
        "seed": seed,
        "sft_dir": sft_dirs[seed],
        "sft_steps": args.sft_steps,
        "sft_extra_rounds": args.sft_extra_rounds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_problems": args.eval_problems,
        "eval_samples": args.eval_samples,
        "versions": dict(library_versions()),
        **off_default_settings(args),
    }


def describe_run(spec: dict, result: dict) -> str:
    what = spec.get("algorithm") or spec.get("arm")
    where = f"spg {spec['regime']}, " if "regime" in spec else ""
    return (
        f"[{where}lr {spec['learning_rate']:.2e}, seed {spec['seed']}] {what}: held-out {result['initial']:.3f} -> "
        f"{result['last']:.3f} (best {result['best']:.3f}) in {result['seconds']:.0f} s"
    )
