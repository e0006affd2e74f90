# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The TRL releases the library supports, and the refusal of one that a part of it cannot use.

The library supports a window of TRL releases (``trl>=1.14.2,<1.17`` in ``setup.cfg``, [`TRL_WINDOW`]): `RPGTrainer`
subclasses TRL's `GRPOTrainer` and reaches its loss, batch and checkpoint steps through private names, which the
project's tests check, release by release, against a table of them (docs: *Design of the RPG loss in rpg_trl*,
"Bumping TRL"). `rpg_trl.async_rpg` builds on `trl.experimental.async_grpo`, new in TRL 1.16 ([`ASYNC_TRL`]), and
refuses an older TRL when imported ([`require_async_trl`]).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version


#: The TRL releases the library supports and the table is written for (``setup.cfg``'s ``trl>=1.14.2,<1.17``).
TRL_WINDOW = ">=1.14.2,<1.17"
#: The first TRL release with what `rpg_trl.async_rpg` builds on (`trl.experimental.async_grpo`'s packed stream and
#: tree attention, new in TRL 1.16): AsyncRPGTrainer and AsyncRPGConfig refuse an older one ([`require_async_trl`]).
ASYNC_TRL = "1.16.0"


def installed_trl_release() -> str:
    """The release of the installed TRL ("1.16.0"), as `trl.__version__` gives it."""
    import trl

    return trl.__version__


def in_trl_window(release: str) -> bool:
    """Whether TRL `release` ("1.15.0") is one of [`TRL_WINDOW`]."""
    return SpecifierSet(TRL_WINDOW).contains(Version(release), prereleases=True)


def require_trl(minimum: str, what: str, instead: str = "") -> None:
    """
    Raise an `ImportError` when the installed TRL is older than `minimum`: the message names what needs it (`what`),
    the release it needs and the installed one, the install command of a release that serves (the newest releases of
    [`TRL_WINDOW`]), and `instead` (what works with the installed release).
    """
    installed = installed_trl_release()
    if Version(installed) >= Version(minimum):
        return
    ceiling = ",".join(str(spec) for spec in SpecifierSet(TRL_WINDOW) if spec.operator in ("<", "<="))
    raise ImportError(
        f"{what} needs TRL {minimum} or later, and the installed TRL is {installed}: "
        f'`pip install "trl>={minimum},{ceiling}"`.' + (f" {instead}" if instead else "")
    )


def require_async_trl() -> None:
    """Refuse, with an `ImportError` naming both releases, a TRL older than [`ASYNC_TRL`] for `rpg_trl.async_rpg`."""
    require_trl(
        ASYNC_TRL,
        "rpg_trl.async_rpg (AsyncRPGTrainer and AsyncRPGConfig, on trl.experimental.async_grpo)",
        "RPGTrainer and RPGConfig run on the installed TRL.",
    )
