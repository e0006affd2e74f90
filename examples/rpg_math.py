# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""
The paper's math recipe end to end: RPG (or a GRPO / DAPO baseline) on DAPO-Math-17k, evaluated on AIME24/25 and AMC23.

"On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning" (ICLR 2026), Sec. 5 and Appendix H.
Reads top to bottom: arguments, data, rewards, trainer, train, save. Every option of `RPGConfig` (all of TRL's
`GRPOConfig` plus RPG's) and of TRL's `ModelConfig` (model, dtype, LoRA) is a command-line flag or a key of the
`--config` YAML file (see `recipes/`); flags override the file.

    # one GPU, LoRA
    python examples/rpg_math.py --config recipes/lora_qwen3_1.7b.yaml
    # 8 GPUs, vLLM colocated (the paper's RPG-REINFORCE-URKL)
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml examples/rpg_math.py \
        --config recipes/rpg_reinforce_urkl.yaml
    # a baseline with TRL's own loss and the same budget
    accelerate launch ... examples/rpg_math.py --config recipes/dapo.yaml      # or grpo.yaml, rfpp.yaml, rfppb.yaml

`--algorithm rpg` trains with `RPGTrainer`; `grpo` and `dapo` train with TRL's `GRPOTrainer` (its `loss_type="grpo"` /
`"dapo"` losses, with the clip ranges and KL of the `BASELINES` table below); `rfpp` and `rfppb` train REINFORCE++ and
REINFORCE++-Baseline (`ReinforcePlusPlusTrainer` of the research package beside the library, `pip install -e
./research` in a clone: whitened returns, KL in the reward, TRL's clipped loss). All share everything else (data,
rewards, dynamic sampling, batch sizes, optimizer, schedule). Offline use: pass a local model folder and local data files
(`.jsonl`/`.json`/`.parquet`, with `problem`/`question` and `answer`/`solution` columns), and set HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field, fields

from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.config import DynamicSamplingArguments
from rpg_trl.dynamic_sampling import DynamicSamplingMixin
from rpg_trl.losses import PAPER_NAMES
from rpg_trl.math_task.data import DAPO_MATH_17K_ENG_ID, load_dapo_math_17k
from rpg_trl.math_task.rewards import accuracy_reward, format_reward, get_soft_overlong_punishment
from rpg_trl.reliability import ReliabilityMixin, shutdown_colocated_vllm

from eval_math import load_eval_sets  # the sibling script: benchmarks by name ('aime24', ...) or files


ALGORITHMS = ("rpg", "grpo", "dapo", "rfpp", "rfppb")
#: The baselines' loss settings (paper Sec. 5 and Appendix H). GRPO: TRL's per-sequence GRPO loss, symmetric clip
#: (0.1, 0.1) as in Appendix H (Sec. 5 says (0.2, 0.2)), advantages scaled by the group std, and β·k3 to a frozen
#: reference model (β from the config, 1e-4 in the recipes). DAPO: token-mean loss, clip-higher (0.2, 0.28), group std
#: scaling, no KL. REINFORCE++ (rfpp) and REINFORCE++-Baseline (rfppb), Tables 5-6: token-mean loss, PPO clip
#: (0.2, 0.2) (verl's default, which the paper's runs used), β·k1 to the frozen initial model in the reward (β from
#: the config, 1e-4 in the recipes); their advantage is set by `REINFORCE_PLUS_PLUS`. Edit here to run other baselines.
BASELINES = {
    # GRPO as the paper ran it (verl's k3 KL loss): the k3 penalty without the importance weight.
    "grpo": dict(loss_type="grpo", epsilon=0.1, epsilon_high=0.1, scale_rewards="group", use_bias_correction_kl=False),
    "dapo": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", beta=0.0),
    "rfpp": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
    "rfppb": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
}
#: `ReinforcePlusPlusConfig.advantage_estimator` of the REINFORCE++ baselines.
REINFORCE_PLUS_PLUS = {"rfpp": "reinforce_plus_plus", "rfppb": "reinforce_plus_plus_baseline"}


@dataclass
class MathScriptArguments:
    """Data, rewards and algorithm of the run (everything else is in `RPGConfig` and `ModelConfig`)."""

    algorithm: str = field(
        default="rpg",
        metadata={
            "help": "'rpg' trains with RPGTrainer (the variant chosen by `divergence` and `estimator`); 'grpo' and "
            "'dapo' train the baselines with TRL's GRPOTrainer and its own losses; 'rfpp' and 'rfppb' train "
            "REINFORCE++ and REINFORCE++-Baseline (the research package's rpg_research.reinforce_plus_plus). "
            "Settings in BASELINES.",
            "choices": list(ALGORITHMS),
        },
    )
    train_dataset: str = field(
        default=DAPO_MATH_17K_ENG_ID,
        metadata={
            "help": "Training problems: a Hub dataset id or a local .jsonl/.json/.parquet file or folder. Default: the "
            "authors' English subset of DAPO-Math-17k (dapo-math-17k-eng.parquet), the paper's training set."
        },
    )
    train_split: str = field(default="train", metadata={"help": "Split of `train_dataset`."})
    train_max_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training problems."})
    english_only: bool = field(
        default=False,
        metadata={
            "help": "Drop problems with CJK characters: approximates the English subset the paper trains on from the "
            "full release (BytedTsinghua-SIA/DAPO-Math-17k); the default training file is that subset already."
        },
    )
    eval_datasets: list[str] = field(
        default_factory=lambda: ["aime24", "aime25", "amc23"],
        metadata={
            "help": "Evaluation sets for `eval_strategy != 'no'`: 'aime24', 'aime25', 'amc23' (the paper's) or local "
            "files/folders or Hub ids (named by their file stem). The trainer logs "
            "`eval_<name>_rewards/accuracy_reward/mean`, the mean@k accuracy with k = num_generations_eval."
        },
    )
    eval_split: str = field(default="test", metadata={"help": "Split of the eval sets given as files or Hub ids."})
    eval_max_samples: int | None = field(default=None, metadata={"help": "Keep only the first N problems per set."})
    overlong_buffer: int = field(
        default=0,
        metadata={
            "help": "DAPO's soft overlong punishment: the reward falls linearly from 0 to -1 over the last "
            "`overlong_buffer` tokens before max_completion_length (paper: 512 at a 2K context). 0: off."
        },
    )
    format_reward: bool = field(
        default=False,
        metadata={"help": "Add a reward for ending with a line 'Answer: ...' (rpg_trl.math_task.format_reward)."},
    )


@dataclass
class BaselineConfig(DynamicSamplingArguments, GRPOConfig):
    """TRL's GRPOConfig plus the dynamic-sampling fields that RPGConfig declares (one declaration, shared), read by
    `DynamicSamplingMixin` (filled from the parsed RPGConfig by `baseline_config`, never parsed itself)."""

    def __post_init__(self):
        super().__post_init__()
        self.check_dynamic_sampling_arguments()


class PerBenchmarkEvalMetrics:
    """Names TRL's evaluation metrics after the benchmark (`eval_aime25_rewards/accuracy_reward/mean`, the mean@k
    accuracy): with several eval sets TRL logs each set's generation metrics under the same `eval_<metric>` keys."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        self._eval_prefix = metric_key_prefix  # "eval_<name>" for each set of a dict of eval sets
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._eval_prefix = "eval"

    def log(self, logs, start_time=None):
        prefix = getattr(self, "_eval_prefix", "eval")
        if not self.model.training and prefix.startswith("eval_"):  # TRL prepends "eval_" to these keys
            name = prefix.removeprefix("eval_")
            self._metrics["eval"] = defaultdict(list, {f"{name}_{k}": v for k, v in self._metrics["eval"].items()})
        super().log(logs, start_time)


class MathRPGTrainer(PerBenchmarkEvalMetrics, RPGTrainer):
    """RPGTrainer with per-benchmark evaluation metrics."""


class BaselineTrainer(PerBenchmarkEvalMetrics, ReliabilityMixin, DynamicSamplingMixin, GRPOTrainer):
    """TRL's GRPOTrainer, unchanged loss, with what RPGTrainer adds around its loss (reward guard, exact resume,
    checks: `rpg_trl.reliability`; DAPO dynamic sampling: `rpg_trl.dynamic_sampling`), so that the baselines differ from
    RPG in the loss only, and per-benchmark evaluation metrics."""


def reinforce_plus_plus():
    """The research package's REINFORCE++ module (`rpg_research.reinforce_plus_plus`), which `--algorithm rfpp` and
    `rfppb` need; a clear error without it."""
    try:
        from rpg_research import reinforce_plus_plus
    except ImportError as exc:
        raise ImportError(
            "--algorithm rfpp and rfppb train the REINFORCE++ baselines of rpg_trl's research package, which is not "
            "installed: `pip install -e ./research` in a clone of rpg_trl."
        ) from exc
    return reinforce_plus_plus


def reinforce_plus_plus_trainer() -> type:
    """REINFORCE++ (dynamic sampling built in, advantages whitened over the final batch) with per-benchmark
    evaluation metrics."""

    class ReinforcePlusPlusBaselineTrainer(PerBenchmarkEvalMetrics, reinforce_plus_plus().ReinforcePlusPlusTrainer):
        __doc__ = reinforce_plus_plus_trainer.__doc__

    return ReinforcePlusPlusBaselineTrainer


def baseline_config(args: RPGConfig, algorithm: str) -> GRPOConfig:
    """The RPGConfig's shared settings (batch, optimizer, schedule, generation, logging) with the baseline's loss."""
    preset = BASELINES[algorithm]
    ignored = {key: getattr(args, key) for key, value in preset.items() if getattr(args, key) != value}
    if ignored:
        warnings.warn(
            f"--algorithm {algorithm} runs the paper's baseline with {preset}; the values {ignored} from the config "
            "or command line are not used (edit BASELINES in this script to change them).",
            stacklevel=2,
        )
    config_class = (
        reinforce_plus_plus().ReinforcePlusPlusConfig if algorithm in REINFORCE_PLUS_PLUS else BaselineConfig
    )
    values = {f.name: getattr(args, f.name) for f in fields(config_class) if f.init and hasattr(args, f.name)}
    values["generation_batch_size"] = None  # derived again from steps_per_generation
    values.update(preset)
    if algorithm in REINFORCE_PLUS_PLUS:
        values["advantage_estimator"] = REINFORCE_PLUS_PLUS[algorithm]
    return config_class(**values)


def make_parser() -> TrlParser:
    return TrlParser((MathScriptArguments, RPGConfig, ModelConfig))


def main(script_args: MathScriptArguments, training_args: RPGConfig, model_args: ModelConfig):
    # ---- model: a Hub id or a local folder; dtype/attention from ModelConfig, LoRA if --use_peft
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    peft_config = get_peft_config(model_args)

    # ---- data: the paper's prompt around every problem, `prompt` (chat messages) and `solution` columns
    train_dataset = load_dapo_math_17k(
        script_args.train_dataset,
        script_args.train_split,
        max_samples=script_args.train_max_samples,
        english_only=script_args.english_only,
    )
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_eval_sets(script_args.eval_datasets, script_args.eval_split, script_args.eval_max_samples)

    # ---- rewards: verifiable accuracy (+ DAPO's soft overlong punishment, + format)
    reward_funcs = [accuracy_reward]
    if script_args.overlong_buffer > 0:
        reward_funcs.append(
            get_soft_overlong_punishment(training_args.max_completion_length, script_args.overlong_buffer)
        )
    if script_args.format_reward:
        reward_funcs.append(format_reward)

    # ---- trainer: RPG, or a baseline with TRL's own loss and everything else identical
    if script_args.algorithm == "rpg":
        trainer_cls, args = MathRPGTrainer, training_args
        name = PAPER_NAMES[(args.divergence, args.estimator)]
    else:
        args = baseline_config(training_args, script_args.algorithm)
        trainer_cls = BaselineTrainer
        name = f"{script_args.algorithm.upper()} {BASELINES[script_args.algorithm]}"
        if script_args.algorithm in REINFORCE_PLUS_PLUS:
            trainer_cls = reinforce_plus_plus_trainer()
            name = (
                f"{reinforce_plus_plus().BASELINE_NAMES[args.advantage_estimator]} {BASELINES[script_args.algorithm]}"
            )
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.accelerator.print(
        f"Training {name} on {len(train_dataset)} problems with {trainer.accelerator.num_processes} process(es), "
        f"rewards {[f.__name__ for f in reward_funcs]}, dynamic sampling {'on' if args.dynamic_sampling else 'off'}."
    )

    # ---- train (TRL's progress bar; periodic evaluation with eval_strategy/eval_steps), save
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    trainer.accelerator.print(f"Model saved to {args.output_dir}.")
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.train_dataset)
    # A colocated vLLM engine first, while its process groups exist (else vLLM's own shutdown at exit fails on them);
    # then the trackers and the process group (`Trainer.end()` in recent transformers does only this).
    shutdown_colocated_vllm(trainer)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
