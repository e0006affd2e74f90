# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The tooling around the library: nothing in `rpg_trl` outside this package imports it (`tests/test_layout.py`).

* `cli`: the `rpg-trl` command and its subcommands (the offline demo, the benchmarks, the figures).
* `toy`: the offline addition task of the demo, the benchmarks and the tests (tiny Qwen3, character tokenizer).
* `cpu_rollouts`: a CPU rollout worker that runs the asynchronous trainers without a vLLM server or a GPU.
"""
