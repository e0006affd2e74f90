# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Testing utilities: what the library's tests, and a user's tests of an RPG set-up, need to train on a CPU without
downloading anything (like `accelerate.test_utils`). The trainers never import this package; it never imports the
research package beside the library (`research/rpg_research`, which uses it: `tests/test_layout.py`).

* `models`: tiny Qwen3 models and character tokenizers built locally ([`build_char_tokenizer`], [`build_tiny_qwen3`],
  [`save_tiny_model`]: a model directory that loads by path like a Hub id).
* `training`: the activation-checkpointing argument in the installed transformers' spelling
  ([`no_activation_checkpointing`]) and deterministic rollouts that replace generation ([`make_fixed_rollout`]).
* `runs`: a short, quiet RPG run on a tiny model ([`make_trainer`], [`tiny_run_args`], [`PROMPTS`], [`count_sevens`]),
  an off-policy batch that feeds the loss directly ([`fixed_inputs`]), the model and data of a math-task run
  ([`save_math_assets`]).
* `cpu_rollouts`: a rollout worker and CPU attention that run [`AsyncRPGTrainer`] without a vLLM server or a GPU
  ([`LocalRolloutWorker`], [`cpu_backend`]).
* `pytest_plugin`: the set-up of a test session (offline, the processes the tests start ended with pytest, the fast
  tier kept free of launches, GPU tests skipped without a GPU, the `tiny_model_dir` fixture); load it from a conftest
  with `pytest_plugins = ["rpg_trl.testing.pytest_plugin"]`. It uses `sessions` (processes started in sessions of their
  own, ended with pytest) and `tiers` (the `slow` mark's check). It and `tiers` import pytest, which is a dependency
  of the tests (the `test` extra), not of the library.

The names below are importable from `rpg_trl.testing` directly; each is loaded on first use.
"""

_LAZY = {
    # models
    "build_char_tokenizer": ".models",
    "build_tiny_qwen3": ".models",
    "save_tiny_model": ".models",
    # training
    "activation_checkpointing": ".training",
    "make_fixed_rollout": ".training",
    "no_activation_checkpointing": ".training",
    # runs
    "PROMPTS": ".runs",
    "count_sevens": ".runs",
    "fixed_inputs": ".runs",
    "make_trainer": ".runs",
    "quiet_cpu_args": ".runs",
    "save_math_assets": ".runs",
    "tiny_run_args": ".runs",
    # the asynchronous trainer on a CPU
    "LocalRolloutWorker": ".cpu_rollouts",
    "LocalWeightTransfer": ".cpu_rollouts",
    "cpu_backend": ".cpu_rollouts",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
