# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""rpg_trl: RPG (Regularized Policy Gradient) as a drop-in extension of TRL's GRPOTrainer."""

__version__ = "0.2.0"

from .losses import (
    DIVERGENCES,
    ESTIMATORS,
    KL_LEVELS,
    PAPER_NAMES,
    RPGLossSpec,
    aggregate_loss,
    rpg_loss,
    rpg_per_token_loss,
)


_LAZY = {
    "RPGConfig": ".config",
    "RPGTrainer": ".trainer",
    "RefModelSyncCallback": ".ref_sync",
    "AdaptiveKLCallback": ".kl_control",
    # `rpg_trl.async_rpg` imports `trl.experimental` (which warns on import): loaded on first use only.
    "AsyncRPGConfig": ".async_rpg",
    "AsyncRPGTrainer": ".async_rpg",
}


def __getattr__(name):
    # The config and trainer import TRL/transformers (seconds); the loss library stays importable instantly.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdaptiveKLCallback",
    "AsyncRPGConfig",
    "AsyncRPGTrainer",
    "DIVERGENCES",
    "ESTIMATORS",
    "KL_LEVELS",
    "PAPER_NAMES",
    "RPGConfig",
    "RPGLossSpec",
    "RPGTrainer",
    "RefModelSyncCallback",
    "aggregate_loss",
    "rpg_loss",
    "rpg_per_token_loss",
]
# On a TRL older than the asynchronous trainer needs (rpg_trl.trl_release.ASYNC_TRL), `from rpg_trl import *` leaves its
# names out rather than raising the ImportError that `rpg_trl.AsyncRPGTrainer` raises there, naming the release it needs.
# The installed release is read from the package metadata: importing TRL takes seconds.


def _without_async_names(names: list[str]) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    from .trl_release import ASYNC_TRL

    try:
        installed = Version(version("trl"))
    except PackageNotFoundError:  # pragma: no cover - TRL is a requirement
        return names
    return names if installed >= Version(ASYNC_TRL) else [n for n in names if not n.startswith("Async")]


__all__ = _without_async_names(__all__)
