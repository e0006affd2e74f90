# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""`rpg-trl bench-speed`: step time and peak memory of RPGTrainer against GRPOTrainer on the same batches.

Generation is replaced by a deterministic `rollout_func` (TRL's public hook) that returns the same fixed-length
completions to both trainers, so what is timed is everything a trainer does per optimizer step besides sampling:
scoring (old and reference log-probs), the loss, the backward pass and the optimizer step. Each configuration runs in
its own process (peak memory is per process) and is repeated; the report gives medians and RPG/GRPO ratios for

* (a) RPG with the sampling-policy anchor (one model) vs GRPO with `beta > 0` (policy + reference model),
* (b) RPG with a reference model vs the same GRPO (equal settings),
* (c) the loss alone on large tensors (default B=64, T=4096): `RPGTrainer._compute_loss` vs
  `GRPOTrainer._compute_loss` with the model forward replaced by precomputed log-probs.

Peak memory is `torch.cuda.max_memory_allocated` on CUDA and the process's peak resident set size on CPU.
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


SCENARIOS = {
    # name: (trainer, config overrides)
    "grpo-ref": ("grpo", {"beta": 1e-4}),
    "rpg-sampling": ("rpg", {"beta": 1e-4, "kl_anchor": "sampling"}),
    "rpg-reference": ("rpg", {"beta": 1e-4, "kl_anchor": "reference"}),
}
#: Where a step's time goes (the report's table of that name): each phase timed between device synchronisations,
#: averaged over the timed steps (the scoring, done once per generation, spread over its steps); "rest of the step" is
#: the step time less the phases (TRL's input preparation and logging, the Trainer's bookkeeping, gradient clipping).
PHASES = (
    "scoring: policy log-probs",
    "scoring: reference log-probs",
    "scoring: rollout, rewards, rest",
    "forward and loss",
    "backward",
    "optimizer step",
    "rest of the step",
)
COMPARISONS = [
    ("(a) RPG sampling anchor vs GRPO beta>0", "rpg-sampling", "grpo-ref"),
    ("(b) RPG reference model vs GRPO beta>0", "rpg-reference", "grpo-ref"),
]


def _peak_memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def shared_model(opts, path) -> str:
    """The benchmark's Qwen3 (hidden `opts.hidden_size` x `opts.num_layers`) saved at `path`: built there when `path`
    holds no model, else checked against the options and reused (one model for all the workers of a command)."""
    from rpg_trl.tools.toy.models import build_char_tokenizer, save_tiny_model

    path = Path(path)
    config_file = path / "config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        found = (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"])
        if found[:2] != (opts.hidden_size, opts.num_layers) or found[2] < opts.completion_length + 64:
            raise ValueError(
                f"--model-dir {path} holds a model of hidden {found[0]} x {found[1]} layers and "
                f"{found[2]} positions; this benchmark needs hidden {opts.hidden_size} x {opts.num_layers} layers and "
                f"at least {opts.completion_length + 64} positions: give an empty or new folder"
            )
        return str(path)
    return save_tiny_model(
        path,
        build_char_tokenizer(),
        hidden_size=opts.hidden_size,
        num_hidden_layers=opts.num_layers,
        num_attention_heads=max(opts.hidden_size // 64, 2),
        num_key_value_heads=max(opts.hidden_size // 128, 1),
        intermediate_size=4 * opts.hidden_size,
        max_position_embeddings=opts.completion_length + 64,
    )


def _worker(opts) -> dict:
    """Train one scenario for `opts.steps` optimizer steps on fixed rollouts; return timings and memory. Its
    temporary folder (the model, unless `--model-dir` gives one, and the output folder) is removed at the end."""
    workdir = Path(tempfile.mkdtemp(prefix="rpg-bench-"))
    try:
        return _train_scenario(opts, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _train_scenario(opts, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.tools.toy.models import build_char_tokenizer
    from rpg_trl.tools.toy.rollouts import make_fixed_rollout
    from rpg_trl.tools.toy.training import activation_checkpointing

    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    kind, overrides = SCENARIOS[opts.scenario]
    use_cuda = opts.device == "cuda"
    tokenizer = build_char_tokenizer()
    model_dir = shared_model(opts, opts.model_dir or workdir / "model")
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})

    def reward(completions, **kwargs):
        return [float(c.count("7")) for c in completions]

    common = dict(
        output_dir=str(workdir / "out"),
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
    return {
        "scenario": opts.scenario,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "peak_memory_bytes": _peak_memory_bytes(trainer.accelerator.device),
        "model_weight_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
        "weights_in_memory_bytes": sum(p.numel() * p.element_size() for m in models for p in m.parameters()),
        "has_ref_model": trainer.ref_model is not None,
        "breakdown_s": breakdown,
    }


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


def _loss_only(opts) -> dict:
    """Time `_compute_loss` (forward + backward of the loss only) of both trainers on (B, T) random log-probs."""
    import torch

    from rpg_trl.tools.toy.models import build_char_tokenizer

    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    device = torch.device(opts.device)
    B, T = opts.loss_batch, opts.loss_length
    g = torch.Generator().manual_seed(0)
    old = (-torch.rand(B, T, generator=g) * 3).to(device)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long, device=device),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long, device=device),
        "completion_ids": torch.zeros(B, T, dtype=torch.long, device=device),
        "completion_mask": (torch.rand(B, T, generator=g) > 0.1).long().to(device),
        "advantages": torch.randn(B, generator=g).to(device),
        "old_per_token_logps": old,
        "ref_per_token_logps": old + 0.1 * torch.randn(B, T, generator=g).to(device),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    logps_value = old + 0.1 * torch.randn(B, T, generator=g).to(device)
    entropies = torch.rand(B, T, generator=g).to(device)
    tokenizer = build_char_tokenizer()
    workdir = Path(tempfile.mkdtemp(prefix="rpg-bench-loss-"))
    try:
        return _time_losses(opts, device, inputs, logps_value, entropies, tokenizer, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _time_losses(opts, device, inputs, logps_value, entropies, tokenizer, workdir: Path) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.tools.toy.models import save_tiny_model

    model_dir = save_tiny_model(workdir / "model", tokenizer)
    dataset = Dataset.from_dict({"prompt": ["1+1="] * 4})
    common = dict(
        output_dir=str(workdir / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        beta=1e-4,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        report_to="none",
        use_cpu=device.type != "cuda",
    )
    trainers, holders = {}, {}
    for name, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("rpg", RPGTrainer, RPGConfig, {"kl_anchor": "reference"}),
    ):
        trainer = trainer_cls(
            model_dir,
            lambda completions, **kw: [0.0] * len(completions),
            args=config_cls(**common, **extra),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = 1
        holder = holders[name] = {}

        def fake_forward(*args, _holder=holder, **kwargs):
            return _holder["logps"], entropies, None

        trainer._get_per_token_logps_and_entropies = fake_forward
        trainers[name] = trainer
    # The two losses alternate, repeat after repeat, so that drift (frequency, caches, other jobs) hits both alike.
    times = {name: [] for name in trainers}
    for i in range(opts.loss_warmup + opts.loss_repeats):
        for name, trainer in trainers.items():
            holders[name]["logps"] = logps_value.clone().requires_grad_(True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= opts.loss_warmup:
                times[name].append(time.perf_counter() - start)
    results = {name: statistics.median(t) for name, t in times.items()}
    return {"grpo_loss_s": results["grpo"], "rpg_loss_s": results["rpg"], "ratio": results["rpg"] / results["grpo"]}


def _run_scenario(opts, scenario: str, model_dir: str) -> dict:
    cmd = [sys.executable, "-m", "rpg_trl.tools.cli.bench_speed", "--_worker", scenario] + _forwarded_flags(opts)
    cmd.append(f"--model-dir={model_dir}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bench-speed worker for {scenario!r} failed:\n{out.stderr[-4000:]}")
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
    ]
    if opts.num_threads:
        flags.append(f"--num-threads={opts.num_threads}")
    if opts.lora:
        flags.append("--lora")
    if opts.gradient_checkpointing:
        flags.append("--gradient-checkpointing")
    return flags


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def environment(device: str) -> dict:
    """Where and when the numbers were measured: device name, versions, UTC date, and the machine as every command
    records it ([`rpg_trl.tools.cli.machine`]: the CPU model, the ATen kernels, the torch threads, the package versions)."""
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

    if opts.quick:
        opts.repeats, opts.steps, opts.warmup = 1, 2, 1
        opts.hidden_size, opts.num_layers, opts.completion_length = 64, 2, 32
        opts.loss_batch, opts.loss_length, opts.loss_repeats, opts.loss_warmup = 8, 256, 2, 1
    spg = opts.steps_per_generation
    opts.steps, opts.warmup = -(-opts.steps // spg) * spg, -(-opts.warmup // spg) * spg
    runs: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    order = [name for _ in range(opts.repeats) for name in SCENARIOS]  # interleaved, so drift hits all alike
    # One saved model for every worker (each used to build and save its own: 1.76 GB at hidden 1024 x 28 layers).
    scratch = None if opts.model_dir else tempfile.mkdtemp(prefix="rpg-bench-model-")
    try:
        model_dir = shared_model(opts, opts.model_dir or Path(scratch) / "model")
        for name in tqdm(order, desc="bench-speed", unit="run"):
            runs[name].append(_run_scenario(opts, name, model_dir))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            "step_time_s": statistics.median(r["step_time_s"] for r in results),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "peak_memory_bytes": statistics.median(r["peak_memory_bytes"] for r in results),
            "model_weight_bytes": results[0]["model_weight_bytes"],
            "weights_in_memory_bytes": results[0]["weights_in_memory_bytes"],
            "has_ref_model": results[0]["has_ref_model"],
            "breakdown_s": {phase: statistics.median(r["breakdown_s"][phase] for r in results) for phase in PHASES},
        }
    loss = _loss_only(opts)
    report = {"settings": settings(opts), "environment": environment(opts.device), "runs": summary}
    report["loss_only"] = loss
    lines = [
        f"device: {report['environment']['device_name']} ({opts.device}), {report['environment']['date_utc'][:10]}, "
        f"model: hidden {opts.hidden_size} x {opts.num_layers} layers, "
        f"{opts.batch_size} completions x {opts.completion_length} tokens per micro-batch, "
        f"steps_per_generation={opts.steps_per_generation}, LoRA={opts.lora}, repeats={opts.repeats}, "
        f"{opts.steps} timed steps each, torch threads: {opts.num_threads or 'default'}",
        "",
        "| run | step time (s) | tokens/s | peak memory (MiB) | weights held (MiB) |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['step_time_s']:.4f} | {s['tokens_per_s']:.0f} | {_mib(s['peak_memory_bytes'])} | "
            f"{_mib(s['weights_in_memory_bytes'])} |"
        )
    lines += [
        "",
        "| comparison | step time ratio | peak memory ratio | peak memory saved (MiB) |",
        "|---|---|---|---|",
    ]
    report["ratios"] = {}
    for label, num, den in COMPARISONS:
        t = summary[num]["step_time_s"] / summary[den]["step_time_s"]
        m = summary[num]["peak_memory_bytes"] / summary[den]["peak_memory_bytes"]
        saved = summary[den]["peak_memory_bytes"] - summary[num]["peak_memory_bytes"]
        report["ratios"][label] = {"step_time": t, "peak_memory": m, "peak_memory_saved_bytes": saved}
        lines.append(f"| {label} | {t:.3f} | {m:.3f} | {_mib(saved)} |")
    lines += ["", breakdown_table(summary), ""]
    lines += [
        f"(c) loss alone, B={opts.loss_batch}, T={opts.loss_length}: RPG {loss['rpg_loss_s'] * 1e3:.1f} ms, "
        f"GRPO {loss['grpo_loss_s'] * 1e3:.1f} ms, ratio {loss['ratio']:.3f}",
        f"one model's weights: {_mib(summary['grpo-ref']['model_weight_bytes'])} MiB",
    ]
    text = "\n".join(lines)
    print(text)
    if opts.output_json:
        Path(opts.output_json).write_text(json.dumps(report, indent=2))
    return report


def breakdown_table(runs: dict) -> str:
    """Markdown: milliseconds per step of each phase of [`PHASES`] (rows) for each run (columns)."""
    names = list(runs)
    lines = [
        "| where a step's time goes (ms per step) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(f"{runs[n]['breakdown_s'][phase] * 1e3:.1f}" for n in names) + " |")
    lines.append("| step | " + " | ".join(f"{runs[n]['step_time_s'] * 1e3:.1f}" for n in names) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks that the command works")
    parser.add_argument("--device", default="cuda" if _cuda_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="processes per scenario (medians are reported)")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per micro-batch")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of the full model")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--loss-batch", type=int, default=64, help="B of the loss-only benchmark (c)")
    parser.add_argument("--loss-length", type=int, default=4096, help="T of the loss-only benchmark (c)")
    parser.add_argument("--loss-repeats", type=int, default=30, help="timed repeats of each loss (alternating)")
    parser.add_argument("--loss-warmup", type=int, default=3)
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads per process (default: torch's own choice)"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed to each worker process")
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
        prog="python -m rpg_trl.tools.cli.bench_speed", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    parser.add_argument("--_worker", default=None, choices=list(SCENARIOS), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts._worker:
        opts.scenario = opts._worker
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(_worker(opts)))
        return
    run(opts)


if __name__ == "__main__":
    main()
