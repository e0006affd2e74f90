"""Faults injected into a training process for the tests of committed checkpoints (test-side only).

`RPG_TEST_KILL=POINT:STEP[:RANK]` in a worker's environment, then [`install_from_env`]: the process of rank RANK (every
process when omitted) kills itself with SIGKILL at POINT of optimizer step STEP, without cleanup:

- `weights`, `optimizer`, `rng`: inside the save of checkpoint-STEP, right after `transformers` wrote the model, the
  optimizer and scheduler, or this process's RNG state (`rng_state[_{rank}].pth`, before RPG's generation state);
- `generation-state`: right after RPG's `rpg_generation_state[_{rank}].pt`, before `trainer_state.json`;
- `trainer-state`: right after `trainer_state.json` (the last file of `transformers`), before the commit;
- `reference`: right after RPG's synced reference `rpg_reference.safetensors` (the first file of an RPG save);
- `step`: inside the loss of step STEP (in the forward pass, before the gradients are reduced over the processes).

Before killing itself the process writes the time (`time.time()`) into `$RPG_TEST_KILL_STAMP` when that is set.
"""

import functools
import os
import signal
import sys
import time


ENV = "RPG_TEST_KILL"
POINTS = ("weights", "optimizer", "rng", "generation-state", "trainer-state", "reference", "step")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _die() -> None:
    stamp = os.environ.get("RPG_TEST_KILL_STAMP")
    if stamp:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after(owner, name, step_of, step: int) -> None:
    """Replace `owner.name` by a wrapper that calls it, then dies when `step_of(*args)` is `step`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if step_of(*args) == step:
            _die()
        return result

    setattr(owner, name, wrapper)


def install(point: str, step: int, rank: int | None = None) -> None:
    """Arm the kill at `point` of step `step`, in this process if its rank is `rank` (or `rank` is None)."""
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; expected one of {POINTS}")
    if rank is not None and rank != _rank():
        return
    import transformers

    import rpg_trl.reliability as reliability
    from rpg_trl import RPGTrainer
    from rpg_trl.ref_sync.callback import RefModelSyncCallback

    def trainer_step(trainer, *args):
        return trainer.state.global_step

    if point == "weights":
        _kill_after(transformers.Trainer, "save_model", trainer_step, step)
    elif point == "optimizer":
        _kill_after(transformers.Trainer, "_save_optimizer_and_scheduler", trainer_step, step)
    elif point == "rng":
        _kill_after(transformers.Trainer, "_save_rng_state", trainer_step, step)
    elif point == "generation-state":
        _kill_after(reliability, "save_generation_state", trainer_step, step)
    elif point == "trainer-state":
        _kill_after(transformers.TrainerState, "save_to_json", lambda state, *args: state.global_step, step)
    elif point == "reference":
        _kill_after(RefModelSyncCallback, "save_checkpoint", lambda callback, trainer, *a: trainer_step(trainer), step)
    else:  # inside the loss of step `step` (global_step counts the steps done)
        _kill_after(RPGTrainer, "_compute_loss", lambda trainer, *args: trainer_step(trainer) + 1, step)


def install_from_env() -> None:
    """[`install`] from `$RPG_TEST_KILL` (`POINT:STEP[:RANK]`), if set."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, step, *rank = spec.split(":")
    install(point, int(step), int(rank[0]) if rank else None)
