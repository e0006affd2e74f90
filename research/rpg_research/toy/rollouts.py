# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Fixed rollouts: a deterministic TRL `rollout_func`, so that trainers can be compared (or timed) on the same batches.
The library's testing package has it ([`rpg_trl.testing.training.make_fixed_rollout`]); importable from here too."""

from rpg_trl.testing.training import make_fixed_rollout


__all__ = ["make_fixed_rollout"]
