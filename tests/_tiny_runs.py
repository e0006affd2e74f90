"""What the tests that train a tiny local Qwen3 on CPU share: the prompts and the settings of a short, quiet run."""

from datasets import Dataset


#: 100 "a+b=" prompts, all covered by the character tokenizer of `rpg_trl.tiny`.
PROMPTS = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})


def quiet_cpu_args(output_dir, **overrides) -> dict:
    """`RPGConfig` keyword arguments of a short CPU run that logs every step with seed 0 and writes nothing else (no
    report, no checkpoint, no progress bar); `overrides` add to or replace them."""
    return {
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }


def tiny_run_args(output_dir, **overrides) -> dict:
    """[`quiet_cpu_args`] of a 2-step run on the tiny Qwen3: 2 groups of 4 completions of 8 tokens per step,
    learning rate 1e-2, no gradient checkpointing; `overrides` add to or replace them."""
    defaults = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        gradient_checkpointing=False,
        learning_rate=1e-2,
    )
    return quiet_cpu_args(output_dir, **{**defaults, **overrides})
