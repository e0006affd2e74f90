# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""`rpg-trl bench-speed`: step time and peak memory of RPGTrainer against GRPOTrainer on the same batches.

Generation is replaced by a deterministic `rollout_func` (TRL's public hook) that returns the same fixed-length
completions to both trainers, so what is timed is everything a trainer does per optimizer step besides sampling:
scoring (old and reference log-probs), the loss, the backward pass and the optimizer step; no vLLM, random weights
(a Qwen3 built locally; `--vocab-size 151936` gives it Qwen3's vocabulary, so that the output layer and the log-softmax
weigh what they weigh in a real model), loaded in `--dtype` (float32, or bfloat16 as users load a model for training on
a GPU). Each configuration is repeated (`--repeats`, the order of the runs changing from repeat to repeat: a Williams
design when the repeats are a multiple of the runs, [`run_orders`]) and its per-step times saved; the report gives
medians with their range over the repeats, and per-repeat RPG/GRPO ratios, as their median and range and as their mean
with a 95 % Student-t interval, for

* (A/A) GRPO against GRPO, the same run twice: its spread is the noise band of the other ratios,
* (a) RPG with the sampling-policy anchor (one model) vs GRPO with `beta > 0` (policy + reference model): target, the
  anchor saves >= 90 % of the measured reference pass and, with full fine-tuning, one copy of the weights,
* (b) RPG with a reference model vs the same GRPO (equal settings): target, no difference detected (the ratio's
  interval holds 1.00; the A/A pair's interval says how large a difference the repeats could detect),
* (d) RPG with each position's KL exact over the vocabulary (``kl_estimate="vocabulary"``, sampling anchor) vs the
  sampled estimate of (a)'s run, and vs GRPO with `beta > 0` (d'): target, the step time's mean ratio to the sampled
  estimate's <= 1.15 and its peak memory's <= 1.10,
* (c) the loss alone on large tensors (default B=64, T=4096), in training mode ([`rpg_research.cli.bench_loss`]):
  target, the mean of the paired rounds' ratios <= 1.00 (with its 95 % interval, and what each loss dispatches:
  operators, kernels, waits for the device),

and where a step's time goes (each phase timed between device synchronisations), with the differences that explain a
missed target (the report: [`rpg_research.cli.bench_speed_report`]). Peak memory is `torch.cuda.max_memory_allocated` on CUDA and the process's peak resident set size on
CPU; so on CPU each run has its own process, and on CUDA the runs of one repeat share one (the previous trainer freed,
the peak statistics reset before each), which saves a process start per run. With `--output-json` the JSON is written
after every worker process from the processes finished so far (`processes`: finished of planned), so that a command
cut short (a timeout, a crash) keeps its finished repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench_speed_report import (
    COMPARISONS,
    PHASES,
    conditions,
    format_report,
    ratios,
    summarize,
    targets,
)


SCENARIOS = {
    # name: (trainer, config overrides)
    "grpo-ref": ("grpo", {"beta": 1e-4}),
    "grpo-ref-2": ("grpo", {"beta": 1e-4}),  # the A/A pair: the same run again
    "rpg-sampling": ("rpg", {"beta": 1e-4, "kl_anchor": "sampling"}),
    "rpg-reference": ("rpg", {"beta": 1e-4, "kl_anchor": "reference"}),
    # (d): each position's KL exactly over the vocabulary, beside the sampled estimate of rpg-sampling.
    "rpg-vocabulary": ("rpg", {"beta": 1e-4, "kl_anchor": "sampling", "kl_estimate": "vocabulary"}),
}
#: Qwen3's vocabulary (the tokenizer of every Qwen3 size): `--vocab-size` for a bench that weighs like a user's model.
QWEN3_VOCAB_SIZE = 151_936


def _peak_memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def shared_model(opts, path) -> str:
    """The benchmark's Qwen3 (hidden `opts.hidden_size` x `opts.num_layers`, vocabulary `opts.vocab_size` or the
    character tokenizer's, weights in `opts.dtype`) saved at `path`: built there when `path` holds no model, else
    checked against the options and reused (one model for all the workers of a command)."""
    from rpg_research.toy.models import build_char_tokenizer, save_tiny_model

    path = Path(path)
    tokenizer = build_char_tokenizer()
    vocab_size = opts.vocab_size or len(tokenizer)
    config_file = path / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        saved_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        if saved_dtype != opts.dtype:
            raise ValueError(
                f"--model-dir {path} holds {saved_dtype} weights; this benchmark loads {opts.dtype} (--dtype "
                f"{opts.dtype}): give an empty or new folder, or --dtype {saved_dtype}"
            )
        found = (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
        positions = config["max_position_embeddings"]
        if found != (opts.hidden_size, opts.num_layers, vocab_size) or positions < opts.completion_length + 64:
            raise ValueError(
                f"--model-dir {path} holds a model of hidden {found[0]} x {found[1]} layers, vocabulary {found[2]} and "
                f"{positions} positions; this benchmark needs hidden {opts.hidden_size} x {opts.num_layers} layers, "
                f"vocabulary {vocab_size} and at least {opts.completion_length + 64} positions: give an empty or new "
                "folder"
            )
        return str(path)
    return save_tiny_model(
        path,
        tokenizer,
        hidden_size=opts.hidden_size,
        num_hidden_layers=opts.num_layers,
        num_attention_heads=max(opts.hidden_size // 64, 2),
        num_key_value_heads=max(opts.hidden_size // 128, 1),
        intermediate_size=4 * opts.hidden_size,
        max_position_embeddings=max(opts.completion_length + 64, opts.max_positions or 0),
        vocab_size=vocab_size,
        dtype=opts.dtype,
    )


def _worker(opts) -> list[dict]:
    """Train each scenario of `opts.scenarios_here` in turn, each for `opts.steps` optimizer steps on fixed rollouts,
    the previous one freed first; return their timings and memory. Its temporary folder (the model, unless
    `--model-dir` gives one, and the output folders) is removed at the end."""
    import gc

    import torch

    workdir = Path(tempfile.mkdtemp(prefix="rpg-bench-"))
    results = []
    try:
        for scenario in opts.scenarios_here:
            resident = torch.cuda.memory_allocated() if opts.device == "cuda" else None
            results.append({**_train_scenario(opts, scenario, workdir), "resident_before_bytes": resident})
            gc.collect()
            if opts.device == "cuda":
                torch.cuda.empty_cache()
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _train_scenario(opts, scenario: str, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rpg_research.toy.models import build_char_tokenizer
    from rpg_research.toy.rollouts import make_fixed_rollout
    from rpg_research.toy.training import activation_checkpointing
    from rpg_trl import RPGConfig, RPGTrainer

    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    kind, overrides = SCENARIOS[scenario]
    use_cuda = opts.device == "cuda"
    tokenizer = build_char_tokenizer()
    model_dir = shared_model(opts, opts.model_dir or workdir / "model")
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})

    def reward(completions, **kwargs):
        return [float(c.count("7")) for c in completions]

    common = dict(
        output_dir=str(workdir / scenario),
        per_device_train_batch_size=opts.batch_size,
        num_generations=opts.num_generations,
        max_completion_length=opts.completion_length,
        steps_per_generation=opts.steps_per_generation,
        max_steps=opts.warmup + opts.steps,
        learning_rate=1e-5,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="none",
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not use_cuda,
        bf16=use_cuda,
        **activation_checkpointing(opts.gradient_checkpointing),
        seed=0,
        # TRL loads a model given by its path in float32 unless told otherwise (reference model included).
        model_init_kwargs={"dtype": opts.dtype},
        **overrides,
    )
    if kind == "grpo":
        args, trainer_cls = GRPOConfig(**common), GRPOTrainer
    else:
        args, trainer_cls = RPGConfig(**common), RPGTrainer
    peft_config = None
    if opts.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = make_fixed_rollout(opts.completion_length, 2, len(tokenizer), seed=0)
    trainer = trainer_cls(
        model_dir,
        reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
        peft_config=peft_config,
    )

    step_times: list[float] = []
    phases = _PhaseTimer(trainer, use_cuda)

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            phases.sync()
            phases.new_step()
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            phases.sync()
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            phases.sync()
            phases.add("optimizer step", time.perf_counter() - self.optimizer_start)

        def on_step_end(self, args, state, control, **kwargs):
            phases.sync()
            step_times.append(time.perf_counter() - self.start)

    trainer.add_callback(Timer())
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    # Whole generation cycles are timed (`run` rounds to multiples of steps_per_generation), so the scoring work done
    # once per generation (old and reference log-probs) is spread over its steps as in a real run.
    step_time = statistics.fmean(step_times[opts.warmup :])
    breakdown = phases.mean_per_step(opts.warmup, step_time)
    tokens = opts.batch_size * opts.completion_length * trainer.args.gradient_accumulation_steps
    models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    result = {
        "scenario": scenario,
        "step_time_s": step_time,
        "step_times_s": step_times,  # every step, the warm-up's first
        "tokens_per_s": tokens / step_time,
        "peak_memory_bytes": _peak_memory_bytes(trainer.accelerator.device),
        "model_weight_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
        "weights_in_memory_bytes": sum(p.numel() * p.element_size() for m in models for p in m.parameters()),
        "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for m in models for p in m.parameters()}),
        "has_ref_model": trainer.ref_model is not None,
        "vocab_size": trainer.model.config.vocab_size,
        "breakdown_s": breakdown,
    }
    trainer.accelerator.free_memory()  # the next scenario of this process starts from an empty device
    del trainer, models  # a cycle with the callbacks and the phase timer: the caller collects it
    return result


class _PhaseTimer:
    """Times the phases of [`PHASES`] in each optimizer step of `trainer` by wrapping, on the instance, TRL's scoring
    (`_generate_and_score_completions`, and within it each log-prob pass, told apart by the model it runs: the
    reference model, or the PEFT model with its adapter disabled or set to "ref"), `compute_loss` and the backward
    pass; the optimizer step is added by the caller's callback."""

    def __init__(self, trainer, use_cuda: bool):
        self.trainer, self.use_cuda = trainer, use_cuda
        self.steps: list[dict[str, float]] = []
        self.scoring = False
        self._wrap(trainer, "_generate_and_score_completions", self._scoring)
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._logps)
        self._wrap(trainer, "compute_loss", lambda call, args: self._timed("forward and loss", call))
        self._wrap(trainer.accelerator, "backward", lambda call, args: self._timed("backward", call))

    @staticmethod
    def _wrap(owner, name, around):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            return around(lambda: inner(*args, **kwargs), args)

        setattr(owner, name, wrapper)

    def sync(self):
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()

    def new_step(self):
        self.steps.append(dict.fromkeys(PHASES, 0.0))

    def add(self, phase: str, seconds: float):
        if self.steps:
            self.steps[-1][phase] += seconds

    def _timed(self, phase, call):
        self.sync()
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.sync()
            self.add(phase, time.perf_counter() - start)

    def _scoring(self, call, args):
        self.scoring = True
        self.sync()
        start = time.perf_counter()
        before = dict(self.steps[-1]) if self.steps else None
        try:
            return call()
        finally:
            self.scoring = False
            self.sync()
            elapsed = time.perf_counter() - start
            if before is not None:
                logps = sum(self.steps[-1][k] - before[k] for k in PHASES[:2])
                self.add("scoring: rollout, rewards, rest", elapsed - logps)

    def _logps(self, call, args):
        if not self.scoring:  # the training forward pass: part of `compute_loss`
            return call()
        phase = PHASES[1] if self._is_reference(args[0]) else PHASES[0]
        return self._timed(phase, call)

    def _is_reference(self, model) -> bool:
        trainer = self.trainer
        if trainer.ref_model is not None:
            return model is trainer.ref_model
        inner = trainer.accelerator.unwrap_model(model)
        if not hasattr(inner, "peft_config"):
            return False
        from peft.tuners.tuners_utils import BaseTunerLayer

        layer = next((m for m in inner.modules() if isinstance(m, BaseTunerLayer)), None)
        return layer is not None and (layer.disable_adapters or "ref" in layer.active_adapters)

    def mean_per_step(self, warmup: int, step_time: float) -> dict[str, float]:
        """Each phase's mean seconds per timed step (the steps after `warmup`); the rest is `step_time` less them."""
        timed = self.steps[warmup:]
        means = {phase: statistics.fmean(step[phase] for step in timed) for phase in PHASES[:-1]}
        means[PHASES[-1]] = step_time - sum(means.values())
        return means


def williams_design(n: int) -> list[list[int]]:
    """A Williams design for `n` treatments: orders of `0 .. n-1` in which each treatment is at each position equally
    often and each ordered pair of neighbours (a run directly after another, which may carry over its warm caches or
    its heat) occurs equally often. For even n, n orders: the first is 0, 1, n-1, 2, n-2, ..., the others it shifted
    by 1, 2, ... (mod n), each position once and each ordered pair once; for odd n, those n and their reverses (2n
    orders, each position twice and each ordered pair twice)."""
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    orders = [[(t + shift) % n for t in first] for shift in range(n)]
    return orders if n % 2 == 0 or n == 1 else orders + [order[::-1] for order in orders]


def run_orders(scenarios: list[str], repeats: int) -> tuple[list[list[str]], str]:
    """The order of the runs in each repeat, and how it balances, in words (for `conditions`). When `repeats` is a
    multiple of the number of runs n, the orders of [`williams_design`] in turn: each run first, second, ... equally
    often, and with whole designs (n orders for even n, 2n for odd) each run directly after each other equally often.
    Otherwise repeat r runs `scenarios` rotated by r (so that no run is always first), which is unbalanced: the
    words say how often each ran first."""
    n = len(scenarios)
    if repeats % n == 0:
        design = williams_design(n)
        orders = [[scenarios[t] for t in design[r % len(design)]] for r in range(repeats)]
        if repeats % len(design) == 0:
            return orders, (
                "in a Williams design (each run at each position equally often, each run directly after each other "
                "equally often)"
            )
        return orders, (
            f"in the first {repeats} orders of a Williams design of {len(design)} (each run at each position equally "
            "often; the neighbours not balanced)"
        )
    orders = [scenarios[r % n :] + scenarios[: r % n] for r in range(repeats)]
    first = ", ".join(f"{name} {sum(order[0] == name for order in orders)}" for name in scenarios)
    return orders, (
        f"in rotated order, unbalanced ({repeats} repeats of {n} runs, not a multiple; times first: {first})"
    )


def plan(scenarios: list[str], repeats: int, one_process_per_run: bool) -> list[list[str]]:
    """The worker processes of a command, in order, each the list of scenarios it runs in turn: repeat r runs the
    scenarios in the r-th order of [`run_orders`], in one process, or each run in its own."""
    processes = []
    for order in run_orders(scenarios, repeats)[0]:
        processes += [[name] for name in order] if one_process_per_run else [order]
    return processes


def _run_worker(opts, scenarios: list[str], model_dir: str) -> list[dict]:
    cmd = [sys.executable, "-m", "rpg_research.cli.bench_speed", "--_worker", ",".join(scenarios)]
    cmd += _forwarded_flags(opts) + [f"--model-dir={model_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout * len(scenarios))
    if out.returncode != 0:
        raise RuntimeError(f"bench-speed worker for {scenarios} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forwarded_flags(opts) -> list[str]:
    flags = [
        f"--device={opts.device}",
        f"--hidden-size={opts.hidden_size}",
        f"--num-layers={opts.num_layers}",
        f"--completion-length={opts.completion_length}",
        f"--batch-size={opts.batch_size}",
        f"--num-generations={opts.num_generations}",
        f"--steps-per-generation={opts.steps_per_generation}",
        f"--steps={opts.steps}",
        f"--warmup={opts.warmup}",
        f"--dtype={opts.dtype}",
    ]
    if opts.vocab_size:
        flags.append(f"--vocab-size={opts.vocab_size}")
    if opts.num_threads:
        flags.append(f"--num-threads={opts.num_threads}")
    if opts.lora:
        flags.append("--lora")
    if opts.gradient_checkpointing:
        flags.append("--gradient-checkpointing")
    return flags


def environment(device: str) -> dict:
    """Where and when the numbers were measured: device name, versions, UTC date, and the machine as every command
    records it ([`rpg_research.cli.machine`]: the CPU model, the ATen kernels, the torch threads, the package versions)."""
    import torch
    import trl

    from . import machine

    host = machine()
    cuda = device == "cuda" and torch.cuda.is_available()
    return {
        "device_name": torch.cuda.get_device_name() if cuda else host["cpu"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "trl": trl.__version__,
        "cpu_capability": host["cpu_capability"],
        "date_utc": host["date_utc"],
        "machine": host,
    }


def run(opts) -> dict:
    """Run the benchmark described by the parsed `opts` and print a markdown report; returns the results dict."""
    from tqdm.auto import tqdm

    from .bench_loss import loss_only

    if opts.quick:
        opts.repeats, opts.steps, opts.warmup = 1, 2, 1
        opts.hidden_size, opts.num_layers, opts.completion_length = 64, 2, 32
        opts.loss_batch, opts.loss_length, opts.loss_repeats, opts.loss_warmup, opts.loss_number = 8, 256, 2, 1, 2
    if opts.loss_only:
        return run_loss_only(opts)
    spg = opts.steps_per_generation
    opts.steps, opts.warmup = -(-opts.steps // spg) * spg, -(-opts.warmup // spg) * spg
    scenarios = _scenarios(opts.scenarios)
    # The CPU's peak memory (the process's peak RSS) cannot be reset: a process per run, but with --quick (a check that
    # the command works, which runs the CUDA way: every run of a repeat in one process).
    one_process_per_run = opts.device != "cuda" and not opts.quick
    runs: dict[str, list[dict]] = {name: [] for name in scenarios}
    orders, order_words = run_orders(scenarios, opts.repeats)
    processes = plan(scenarios, opts.repeats, one_process_per_run)
    env = environment(opts.device)

    def report_now(finished: int, loss: dict | None) -> dict:
        return build_report(
            opts, runs, orders, order_words, env, one_process_per_run, (finished, len(processes)), loss
        )

    # One saved model for every worker (each used to build and save its own: 1.76 GB at hidden 1024 x 28 layers).
    scratch = None if opts.model_dir else tempfile.mkdtemp(prefix="rpg-bench-model-")
    try:
        model_dir = shared_model(opts, opts.model_dir or Path(scratch) / "model")
        for finished, names in enumerate(tqdm(processes, desc="bench-speed", unit="process"), 1):
            for result in _run_worker(opts, names, model_dir):
                runs[result["scenario"]].append(result)
            if opts.output_json:  # the last one too: the loss alone, measured next, may fail
                write_json(opts.output_json, report_now(finished, None))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    report = report_now(len(processes), loss_only(opts) if opts.loss_repeats > 0 else None)  # 0: (c) not measured
    if opts.output_json:  # before the report is printed: a closed stdout does not lose the numbers
        write_json(opts.output_json, report)
    print(format_report(report, opts))
    return report


def run_loss_only(opts) -> dict:
    """`--loss-only`: (c) alone, the loss of each trainer on `--loss-batch` x `--loss-length` log-probs, no trainer
    run (a check of the loss's cost in seconds, e.g. before a GPU run)."""
    from .bench_loss import loss_only
    from .bench_speed_report import loss_details

    if opts.loss_repeats < 1:
        raise ValueError(f"--loss-only with --loss-repeats {opts.loss_repeats}: give at least one timed round")
    env = environment(opts.device)
    loss = loss_only(opts)
    report = {"settings": settings(opts), "environment": env, "loss_only": loss}
    if opts.output_json:
        write_json(opts.output_json, report)
    print(
        f"device: {env['device_name']} ({opts.device}), {env['date_utc'][:10]}, torch threads: "
        f"{opts.num_threads or 'default'}\n"
        f"(c) loss alone, B={opts.loss_batch}, T={opts.loss_length}, training mode: RPG {loss['rpg_loss_s'] * 1e3:.3f} ms, "
        f"GRPO {loss['grpo_loss_s'] * 1e3:.3f} ms (medians over {loss['rounds']} rounds of {loss['calls_per_round']} "
        "calls)\n" + "\n".join(loss_details(loss))
    )
    return report


def build_report(
    opts,
    runs: dict[str, list[dict]],
    orders: list[list[str]],
    order_words: str,
    env: dict,
    one_process_per_run: bool,
    processes: tuple[int, int],
    loss: dict | None,
) -> dict:
    """The results dict from the runs finished so far (`runs`: each scenario's results in repeat order), of
    `processes` = (finished, planned) worker processes: a command cut short keeps what it measured."""
    done = {name: results for name, results in runs.items() if results}
    summary = {name: summarize(results) for name, results in done.items()}
    report = {"settings": settings(opts), "environment": env, "runs": summary}
    finished, planned = processes
    words = conditions(opts, next(iter(summary.values()))["vocab_size"], one_process_per_run, order_words)
    if finished < planned:
        words += f" Cut short: {finished} of {planned} worker processes finished."
    report["conditions"] = words
    report["processes"] = {"finished": finished, "planned": planned}
    report["orders"] = orders
    report["per_repeat"] = {name: [r["step_times_s"] for r in results] for name, results in done.items()}
    report["per_repeat_breakdown_s"] = {name: [r["breakdown_s"] for r in results] for name, results in done.items()}
    report["ratios"] = ratios(done)
    aa = report["ratios"].get(COMPARISONS[0][0])
    report["noise_band"] = None if aa is None or aa["repeats"] < 2 else aa["band"]
    report["loss_only"] = loss
    report["targets"] = targets(
        summary, done, report["ratios"], report["noise_band"], loss, opts.lora, opts.device == "cuda"
    )
    return report


def write_json(path, report: dict) -> None:
    """`report` to `path` whole or not at all (a temporary file renamed over it): a command killed while it writes
    leaves the previous one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)


def _scenarios(names) -> list[str]:
    """The runs of `--scenarios` (default: every run of [`SCENARIOS`], but rpg-vocabulary on a TRL older than the
    exact per-position KL needs)."""
    from packaging.version import Version

    from rpg_trl.trl_release import installed_trl_release
    from rpg_trl.vocabulary_kl import VOCABULARY_KL_TRL

    if not names:
        names = list(SCENARIOS)
        if Version(installed_trl_release()) < Version(VOCABULARY_KL_TRL):
            names.remove("rpg-vocabulary")
    else:
        names = [n for n in names.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or "grpo-ref" not in names:
        raise ValueError(f"--scenarios {names}: give names among {list(SCENARIOS)}, grpo-ref (the baseline) included")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks that the command works")
    parser.add_argument(
        "--loss-only", action="store_true", help="measure (c), the loss alone, and nothing else (no trainer run)"
    )
    parser.add_argument("--device", default="cuda" if _cuda_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="repeats of each run (medians, ranges and 95 %% intervals reported); a multiple of the runs orders them "
        "in a Williams design, else in rotated order",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the weights as loaded by both trainers (and saved in --model-dir): bfloat16 as users load a model to "
        "train on a GPU",
    )
    parser.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated runs among {list(SCENARIOS)} (default all; grpo-ref, the baseline, always included)",
    )
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"rows of the model's vocabulary (default: the character tokenizer's; {QWEN3_VOCAB_SIZE} is Qwen3's)",
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="positions of the model built in --model-dir (default: the completion length + 64; the longest of the "
        "commands that share the folder, so that one model serves them all)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="completions per micro-batch")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of the full model")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--loss-batch", type=int, default=64, help="B of the loss-only benchmark (c)")
    parser.add_argument("--loss-length", type=int, default=4096, help="T of the loss-only benchmark (c)")
    parser.add_argument(
        "--loss-repeats", type=int, default=15, help="timed rounds of each loss (alternating); 0: (c) not measured"
    )
    parser.add_argument("--loss-number", type=int, default=10, help="calls per round (their mean is the round's time)")
    parser.add_argument("--loss-warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads per process (default: torch's own choice)"
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=1800,
        help="seconds allowed to each run (a worker process: this per run it holds)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="the saved model every worker loads: built there if the folder holds none, else checked and reused, and "
        "kept (several commands can share it); default: one temporary folder for the command, removed at its end",
    )
    parser.add_argument("--output-json", default=None, help="also write the results as JSON here")


def settings(opts) -> dict:
    """The benchmark's options (those [`add_arguments`] declares) from parsed `opts`, for the JSON report: the
    `rpg-trl` command line adds entries of its own to the namespace (the subcommand, its `run` function)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return {name: getattr(opts, name) for name in vars(parser.parse_args([]))}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench-speed` on the `rpg-trl` command line."""
    parser = subparsers.add_parser("bench-speed", help="step time and peak memory of RPGTrainer vs GRPOTrainer")
    add_arguments(parser)
    return parser


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m rpg_research.cli.bench_speed", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)  # the scenarios of one process
    opts = parser.parse_args(argv)
    if opts._worker:
        opts.scenarios_here = opts._worker.split(",")
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(_worker(opts)))
        return
    run(opts)


if __name__ == "__main__":
    main()
