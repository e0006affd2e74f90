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
