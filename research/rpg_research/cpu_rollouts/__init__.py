# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""CPU rollouts for TRL's asynchronous trainers (research package, not library): run [`AsyncRPGTrainer`] without a vLLM server
or a GPU, for the benchmark `rpg-trl bench-async` and the tests. Guide: `docs/async.md`.

* `worker`: [`LocalRolloutWorker`], an in-process rollout worker at a fixed policy lag, its [`LocalWeightTransfer`]
  and the store of published weights it reads, [`PolicyVersions`].
* `attention`: [`cpu_backend`], which swaps TRL's FA3 tree attention for [`cpu_tree_attention`] (SDPA with the same
  mask) and skips the GPU peak-FLOPs lookup.

Like `rpg_research.toy` and `rpg_research.cli`, this is part of the research package: the library never imports it (`tests/test_layout.py`).
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
