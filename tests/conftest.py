"""Shared fixtures: tiny Qwen3 models and prompt datasets built locally (nothing is downloaded)."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def pytest_configure(config):
    # A SIGTERM to pytest ends the processes the tests started first, the vLLM servers and 2-process launches in
    # sessions of their own among them (helpers/sessions.py).
    from helpers import sessions

    sessions.install()


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
    from rpg_trl.tools.toy import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))
