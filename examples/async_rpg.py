# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""
RPG with asynchronous rollouts: TRL's AsyncGRPOTrainer pipeline (a `trl vllm-serve` server generates while the trainer
updates) with the RPG loss, on DAPO-Math-17k. Guide and measurements: docs/async.md.

"On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning" (ICLR 2026), Sec. 3-5. Every rollout
of an asynchronous trainer was sampled by a policy version that lags the trainer (up to `max_staleness` versions):
RPG's importance-weighted KL and RPG-Style Clip are the exact off-policy forms for such data. Reads top to bottom:
arguments, data, rewards, trainer, train, save. Every option of `AsyncRPGConfig` (TRL's `AsyncGRPOConfig` plus RPG's
loss fields) is a command-line flag or a key of the `--config` YAML file (see `recipes/async/rpg_urkl.yaml`).

    # 1. the generation server, on its own GPU(s), serving the model in the trainer's dtype
    CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model Qwen/Qwen3-1.7B --dtype float32
    # 2. the trainer, on the other GPU(s)
    CUDA_VISIBLE_DEVICES=1 python examples/async_rpg.py --config recipes/async/rpg_urkl.yaml
    # TRL's own asynchronous GRPO loss, everything else identical
    CUDA_VISIBLE_DEVICES=1 python examples/async_rpg.py --config recipes/async/rpg_urkl.yaml --algorithm grpo

The rollout worker scores completions in a spawned process, so reward functions must be picklable module-level
functions (here `rpg_trl.math_task.rewards.accuracy_reward` and `format_reward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl import TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from rpg_trl import AsyncRPGConfig, AsyncRPGTrainer
from rpg_trl.losses import PAPER_NAMES
from rpg_trl.math_task.data import DAPO_MATH_17K_ENG_ID, load_dapo_math_17k
from rpg_trl.math_task.rewards import accuracy_reward, format_reward


ALGORITHMS = ("rpg", "grpo")


@dataclass
class AsyncScriptArguments:
    """Model, data, rewards and algorithm of the run (everything else is in `AsyncRPGConfig`)."""

    model_name_or_path: str = field(
        default="Qwen/Qwen3-1.7B",
        metadata={"help": "Model to train: a Hub id or a local folder; the vLLM server must serve the same model."},
    )
    algorithm: str = field(
        default="rpg",
        metadata={
            "help": "'rpg' trains with AsyncRPGTrainer (the variant chosen by `divergence` and `estimator`); 'grpo' "
            "with TRL's AsyncGRPOTrainer and its PPO-clip loss (the same pipeline, no KL term; RPG's fields unused).",
            "choices": list(ALGORITHMS),
        },
    )
    train_dataset: str = field(
        default=DAPO_MATH_17K_ENG_ID,
        metadata={"help": "Training problems: a Hub dataset id or a local .jsonl/.json/.parquet file or folder."},
    )
    train_split: str = field(default="train", metadata={"help": "Split of `train_dataset`."})
    train_max_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training problems."})
    format_reward: bool = field(
        default=False,
        metadata={"help": "Add a reward for ending with a line 'Answer: ...' (rpg_trl.math_task.format_reward)."},
    )


def grpo_config(args: AsyncRPGConfig) -> AsyncGRPOConfig:
    """The same run with TRL's `AsyncGRPOConfig`: every field it has, taken from `args` (RPG's fields are dropped)."""
    values = {f.name: getattr(args, f.name) for f in fields(AsyncGRPOConfig) if f.init}
    return AsyncGRPOConfig(**values)


def main(script_args: AsyncScriptArguments, training_args: AsyncRPGConfig):
    # ---- data: the paper's prompt around every problem, `prompt` (chat messages) and `solution` columns
    train_dataset = load_dapo_math_17k(
        script_args.train_dataset, script_args.train_split, max_samples=script_args.train_max_samples
    )

    # ---- rewards: verifiable accuracy (+ format); scored by the rollout worker's child process
    reward_funcs = [accuracy_reward, format_reward] if script_args.format_reward else [accuracy_reward]

    # ---- trainer: RPG, or TRL's asynchronous GRPO with everything else identical
    if script_args.algorithm == "rpg":
        trainer_cls, args = AsyncRPGTrainer, training_args
        name = PAPER_NAMES[(args.divergence, args.estimator)]
    else:
        trainer_cls, args, name = AsyncGRPOTrainer, grpo_config(training_args), "AsyncGRPO (PPO clip, no KL)"
    trainer = trainer_cls(
        model=script_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
    )
    trainer.accelerator.print(
        f"Training {name} on {len(train_dataset)} problems, rollouts from {args.vllm_server_base_url} at most "
        f"{args.max_staleness} policy versions stale, rewards {[f.__name__ for f in reward_funcs]}."
    )

    # ---- train (TRL's progress bar; `staleness/*`, `importance_weight/*`, `kl`, `clip_ratio/*` in the logs), save
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    trainer.accelerator.print(f"Model saved to {args.output_dir}.")


if __name__ == "__main__":
    main(*TrlParser((AsyncScriptArguments, AsyncRPGConfig)).parse_args_and_config())
