# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""rpg_research: the research around the library `rpg_trl`, in a project of its own (`research/pyproject.toml`).

It uses `rpg_trl` as a user does; nothing in `rpg_trl` imports it (`tests/test_layout.py`).

* `cli`: the `rpg-trl` command and its subcommands (the offline demo, the benchmarks, the figures).
* `toy`: the offline addition tasks of the demo, the benchmarks and their tests (tiny Qwen3, character tokenizer).
* `cpu_rollouts`: a CPU rollout worker that runs the asynchronous trainers without a vLLM server or a GPU (the
  library's testing package's, `rpg_trl.testing.cpu_rollouts`, under the name `rpg-trl bench-async` imports).

The reports of its benchmarks are in `research/docs/`, the GPU runs' scripts in `research/gpu/`.
"""

__version__ = "0.2.0"
