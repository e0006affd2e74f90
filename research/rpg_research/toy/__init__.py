# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The offline toy task that ``rpg-trl demo``, the benchmarks and their tests share; not part of the RPG library.

Everything here runs on a CPU without the hub: tiny Qwen3 models and character tokenizers built locally ([`models`],
from the library's testing package `rpg_trl.testing`, as are the activation-checkpointing setting and the deterministic
rollouts below), the two-digit addition task with its splits, datasets and exact-match reward ([`addition`]), held-out
accuracy and its trainer callback ([`evaluation`]), the supervised warm start that teaches the model to add and its
per-seed cache ([`warm_start`]), the CPU session and training presets ([`training`]), deterministic rollouts for
comparing trainers on the same batches ([`rollouts`]) and the training curves read back from a run ([`curves`]).
``rpg-trl demo --task long_addition`` trains on four-digit additions worked out in rows, completions of 109-110 tokens
([`long_addition`]), ``--task ring_walk`` on walks of 64 letters whose every token is uncertain ([`ring_walk`]); the
demo reads what it needs of each task from [`tasks`].

The library (`rpg_trl` outside `rpg_research.toy` and `rpg_research.cli`) never imports this package; the command line
(`rpg_research.cli`) does. The names below are importable from `rpg_research.toy` directly; each is loaded on first use, so
importing the package is instant.
"""

_LAZY = {
    # models
    "build_char_tokenizer": ".models",
    "build_tiny_qwen3": ".models",
    "save_tiny_model": ".models",
    # addition
    "AdditionSplits": ".addition",
    "DEMO_MODEL_KWARGS": ".addition",
    "addition_reward": ".addition",
    "build_model": ".addition",
    "build_rl_dataset": ".addition",
    "build_sft_dataset": ".addition",
    "evaluation_seed": ".addition",
    "make_splits": ".addition",
    "prompt_of": ".addition",
    # evaluation
    "heldout_accuracy": ".evaluation",
    "heldout_scores": ".evaluation",
    "heldout_accuracy_callback": ".evaluation",
    # warm start
    "WarmStartReport": ".warm_start",
    "cached_warm_start": ".warm_start",
    "warm_start": ".warm_start",
    # training
    "cpu_session": ".training",
    "device_training_kwargs": ".training",
    "no_activation_checkpointing": ".training",
    "rl_training_kwargs": ".training",
    "rpg_config": ".training",
    "sft_config": ".training",
    "use_terse_progress": ".training",
    # tasks of the demo
    "DEMO_TASKS": ".tasks",
    "DemoTask": ".tasks",
    # rollouts
    "make_fixed_rollout": ".rollouts",
    # curves
    "load_log_history": ".curves",
    "max_drawdown": ".curves",
    "metric_series": ".curves",
    "moving_average": ".curves",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
