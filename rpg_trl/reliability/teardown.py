# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A clean end for multi-process runs on the gloo backend (CPU `accelerate launch`, e.g. the tests and the CPU recipe).

The problem (PyTorch, not RPG): a gloo process group runs its collectives on worker threads, and a worker frees a
finished collective's tensors itself. When those tensors were Python tensors that Python has already dropped (e.g.
`Trainer.store_flos`'s all_gather at the end of `train()`), freeing them needs the GIL. If the group is destroyed
before the worker got it, the process stops at exit:

- the last owner of the group is usually DDP's C++ `Reducer`, whose destructor keeps the GIL while the group joins its
  worker threads, and the worker waits for the GIL: a deadlock (seen here as a 2-process run that trained, saved,
  and never exited, about 1 run in 4);
- or the group dies during interpreter finalization and the worker, taking the GIL then, aborts the process
  ("terminate called without an active exception").

[`hold_process_group_until_exit`] keeps a reference to the group so that no DDP wrapper is its last owner, and at
exit, before finalization, destroys it in an order in which the workers can finish (see [`release_process_groups`]).
[`~rpg_trl.RPGTrainer`] calls it when it runs in a gloo process group; scripts with other trainers may call it too.

A colocated vLLM engine (`vllm_mode="colocate"`) ends its own process groups when it is shut down, by default at
interpreter exit, after the script's `destroy_process_group()` (`Accelerator.end_training()`) or the atexit hook above
destroyed them: vLLM then prints `ValueError: Invalid process group specified` at exit. [`shutdown_colocated_vllm`]
shuts the engine down first, while its groups still exist.
"""

from __future__ import annotations

import atexit
import gc
import time


_HELD: list = []
_REGISTERED = False
#: Time given to the gloo worker threads to take the GIL and free their last collectives' tensors.
WORKER_GRACE_SECONDS = 0.05


def hold_process_group_until_exit() -> bool:
    """
    Holds the default process group, if it is a gloo group, until the interpreter exits (idempotent).

    Returns:
        `bool`: Whether a gloo process group is held (False without `torch.distributed`, an initialized group, or
        when the backend is not gloo, e.g. NCCL, whose teardown is left to PyTorch).
    """
    global _REGISTERED
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or "gloo" not in str(dist.get_backend()):
        return False
    group = dist.group.WORLD
    if not any(held is group for held in _HELD):
        _HELD.append(group)
    if not _REGISTERED:
        atexit.register(release_process_groups)
        _REGISTERED = True
    return True


def release_process_groups() -> None:
    """
    Ends the held process groups (registered with `atexit`; safe to call earlier, once the run is over):

    1. destroys the default process group if the script did not (`Trainer.end()` / `destroy_process_group()`), so that
       it does not outlive the interpreter;
    2. collects garbage, so that DDP wrappers kept alive by reference cycles drop their `Reducer`, which then is not
       the group's last owner;
    3. sleeps briefly (the GIL released) so that the worker threads free the tensors of their last collectives;
    4. drops the held references: the group is destroyed from its Python handle, whose destructor releases the GIL
       while it joins the worker threads.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and any(held is dist.group.WORLD for held in _HELD):
        dist.destroy_process_group()
    gc.collect()
    if _HELD:
        time.sleep(WORKER_GRACE_SECONDS)
    _HELD.clear()


def shutdown_colocated_vllm(trainer) -> bool:
    """
    Shuts down the trainer's colocated vLLM engine (`vllm_mode="colocate"`), if it has one, while the process groups
    it uses still exist. Call it once training and evaluation are over, before `Accelerator.end_training()`; vLLM's
    shutdown ends the distributed environment (the default process group included, which `end_training()` then finds
    destroyed). The trainer cannot generate with vLLM afterwards.

    Returns:
        `bool`: Whether an engine was shut down (False in server mode, without vLLM, or when already shut down).
    """
    generation = getattr(trainer, "vllm_generation", None)
    if getattr(generation, "mode", None) != "colocate" or getattr(generation, "llm", None) is None:
        return False
    generation.llm.llm_engine.engine_core.shutdown()  # detaches vLLM's exit finalizer: it runs once, now
    generation.llm = None
    return True
