"""The set-up both test folders share (tests/conftest.py and research/tests/conftest.py import it): offline settings,
the processes the tests start ended with pytest, the fast tier kept free of launches, the GPU tests skipped without a
GPU, and a tiny Qwen3 built locally (nothing is downloaded)."""

import os

import pytest


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def pytest_configure(config):
    # A SIGTERM to pytest ends the processes the tests started first, the vLLM servers and 2-process launches in
    # sessions of their own among them (helpers/sessions.py).
    from . import sessions, tiers

    sessions.install()
    # A test that starts a process or a server without the `slow` mark fails (helpers/tiers.py).
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
    from rpg_research.toy import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))
