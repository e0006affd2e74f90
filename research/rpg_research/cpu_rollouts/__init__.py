# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""CPU rollouts for TRL's asynchronous trainers, which `rpg-trl bench-async` runs on: the library's testing package
has them ([`rpg_trl.testing.cpu_rollouts`], where the library's tests use them too); their names are importable from
here as well. Guide: `docs/async.md`.
"""

from rpg_trl.testing.cpu_rollouts import *  # noqa: F403
from rpg_trl.testing.cpu_rollouts import __all__  # noqa: F401
