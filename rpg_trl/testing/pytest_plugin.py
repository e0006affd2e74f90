# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A pytest plugin: the set-up of the library's test sessions, which its tests and the research package's load from
their conftests (`pytest_plugins = ["rpg_trl.testing.pytest_plugin"]`), and a user's tests of an RPG set-up on a CPU can
load too. Offline settings (nothing is downloaded), the processes the tests start ended with pytest
([`rpg_trl.testing.sessions`]), the fast tier kept free of launches (a test that starts a process or a server needs the
`slow` mark: [`rpg_trl.testing.tiers`]), the tests marked `gpu` skipped without a GPU, and a tiny Qwen3 built locally
([`tiny_model_dir`])."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def pytest_configure(config):
    # A SIGTERM to pytest ends the processes the tests started first, the vLLM servers and 2-process launches in
    # sessions of their own among them (rpg_trl.testing.sessions).
    from . import sessions, tiers

    sessions.install()
    # A test that starts a process or a server without the `slow` mark fails (rpg_trl.testing.tiers).
    tiers.install(config)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen3 + character tokenizer, loadable by path like a hub id."""
    from .models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))
