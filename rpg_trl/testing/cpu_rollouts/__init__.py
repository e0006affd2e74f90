# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""CPU rollouts for TRL's asynchronous trainers: run [`AsyncRPGTrainer`] without a vLLM server or a GPU, for the tests
of the library and of a user's asynchronous RPG set-up (the research package's benchmark `rpg-trl bench-async` runs on
them too). Guide: `docs/async.md`.

* `worker`: [`LocalRolloutWorker`], an in-process rollout worker at a fixed policy lag, its [`LocalWeightTransfer`]
  and the store of published weights it reads, [`PolicyVersions`].
* `attention`: [`cpu_backend`], which swaps TRL's FA3 tree attention for [`cpu_tree_attention`] (SDPA with the same
  mask) and skips the GPU peak-FLOPs lookup.
"""

from .attention import cpu_backend, cpu_tree_attention, register_cpu_tree_attention
from .worker import LocalRolloutWorker, LocalWeightTransfer, PolicyVersions


__all__ = [
    "LocalRolloutWorker",
    "LocalWeightTransfer",
    "PolicyVersions",
    "cpu_backend",
    "cpu_tree_attention",
    "register_cpu_tree_attention",
]
