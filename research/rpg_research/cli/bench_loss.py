# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The loss alone, (c) of `rpg-trl bench-speed` ([`rpg_research.cli.bench_speed`]): `RPGTrainer._compute_loss` against
`GRPOTrainer._compute_loss`, forward and backward, on (B, T) random log-probs (the model's forward replaced by them),
both trainers in training mode (`model.training` True, the branch training runs). Timed with
`torch.utils.benchmark.Timer` (its warm-up, and CUDA synchronisation around each measurement), in rounds that
alternate the two losses so that drift hits both alike; reported as the median over rounds with the interquartile
range, and the median of the per-round ratios with their range."""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
from pathlib import Path

from .protocol import mean_interval


def loss_only(opts) -> dict:
    """Time both losses on `opts.loss_batch` x `opts.loss_length` tokens on `opts.device`: `opts.loss_repeats` rounds
    of `opts.loss_number` calls each, after `opts.loss_warmup` untimed rounds."""
    import torch

    from rpg_research.toy.models import build_char_tokenizer

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
    workdir = Path(tempfile.mkdtemp(prefix="rpg-bench-loss-"))
    try:
        trainers = _trainers(device, entropies, build_char_tokenizer(), workdir)
        return _time(opts, trainers, inputs, logps_value)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _trainers(device, entropies, tokenizer, workdir: Path) -> dict:
    """GRPOTrainer (beta > 0) and RPGTrainer (reference anchor) on a tiny model, in training mode, each with its model
    forward replaced by the log-probs put in its holder."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rpg_research.toy.models import save_tiny_model
    from rpg_trl import RPGConfig, RPGTrainer

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
        # Within the tiny model's positions (the log-probs are given, so the length the loss sees is the bench's T):
        # the trainers' check of prompt plus completion length against the model stays quiet.
        max_completion_length=8,
        report_to="none",
        use_cpu=device.type != "cuda",
    )
    trainers = {}
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
        trainer.model.train()  # what training calls: the "train" branch of the loss and its metrics
        holder = {"training": []}

        def fake_forward(model, *args, _holder=holder, **kwargs):
            _holder["training"].append(model.training)
            return _holder["logps"], entropies, None

        trainer._get_per_token_logps_and_entropies = fake_forward
        trainers[name] = (trainer, holder)
    return trainers


def _time(opts, trainers: dict, inputs: dict, logps_value) -> dict:
    from torch.utils.benchmark import Timer

    def step(trainer, holder):
        holder["logps"] = logps_value.clone().requires_grad_(True)
        trainer._compute_loss(trainer.model, inputs).backward()

    timers = {
        name: Timer("step(trainer, holder)", globals={"step": step, "trainer": trainer, "holder": holder})
        for name, (trainer, holder) in trainers.items()
    }
    rounds = {name: [] for name in timers}
    for i in range(opts.loss_warmup + opts.loss_repeats):
        for name, timer in timers.items():
            seconds = timer.timeit(opts.loss_number).mean  # one call's mean over `loss_number` calls
            if i >= opts.loss_warmup:
                rounds[name].append(seconds)
    ratios = [r / g for r, g in zip(rounds["rpg"], rounds["grpo"])]
    result = {"rounds": opts.loss_repeats, "calls_per_round": opts.loss_number, "timer": "torch.utils.benchmark.Timer"}
    # The rounds are paired (the two losses alternate within a round): the mean of the per-round ratios with its 95 %
    # Student-t interval, and the rounds in which RPG's loss was the slower.
    mean, half_width = mean_interval(ratios) if ratios else (math.nan, math.nan)
    result["ratio_mean"], result["ratio_half_width"] = mean, half_width
    result["rpg_slower_rounds"] = sum(ratio > 1 for ratio in ratios)
    # What each loss asks of the device in one call, forward and backward (counted once, untimed).
    for name, (trainer, holder) in trainers.items():
        result[f"{name}_dispatch"] = dispatch_counts(lambda: step(trainer, holder))
    for name, values in rounds.items():
        result[f"{name}_loss_s"] = statistics.median(values)
        result[f"{name}_loss_iqr_s"] = _iqr(values)
        result[f"{name}_loss_rounds_s"] = values
    result["ratio"] = result["rpg_loss_s"] / result["grpo_loss_s"]
    result["ratio_per_round"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    result["model_training"] = all(all(holder["training"]) for _, holder in trainers.values())
    return result


#: Operators that launch no kernel on the device: views and metadata, and the scalars PyTorch wraps on the host.
NO_KERNEL = frozenset(
    "detach select unbind view slice expand unsqueeze squeeze alias t transpose permute as_strided _unsafe_view "
    "_reshape_alias split scalar_tensor promote_types lift_fresh".split()
)
#: Operators that make the host wait for the device: a value read on the host, or an output whose size depends on
#: the data.
WAITS = frozenset(("_local_scalar_dense", "nonzero", "masked_select"))


def dispatch_counts(call) -> dict:
    """What `call()` asks of the device, counted at the ATen dispatcher (the same on CPU and CUDA, up to the kernels
    each backend fuses): `operators` (every ATen operator dispatched), `kernels` (those that launch one on the device:
    not the views and metadata of [`NO_KERNEL`]), `waits` (those of [`WAITS`], each a synchronisation; a copy to the
    host, e.g. `.tolist()`, is counted under `copies_to_host`), and `copies_to_host`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"operators": 0, "kernels": 0, "waits": 0, "copies_to_host": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts["operators"] += 1
            counts["kernels"] += name not in NO_KERNEL
            counts["waits"] += name in WAITS
            device = (kwargs or {}).get("device")
            counts["copies_to_host"] += name == "_to_copy" and device is not None and str(device) == "cpu"
            return func(*args, **(kwargs or {}))

    with Count():
        call()
    return counts


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1
