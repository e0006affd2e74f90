"""Training runs for the crash-and-resume tests of `tests/test_guarantees.py`.

    python tests/helpers/crash_worker.py MODEL_DIR OUTPUT_DIR SCENARIO [--crash-at STEP] [--threads N]

trains like [`run`] and kills its own process with SIGKILL at the end of optimizer step STEP (after the checkpoints of
the earlier steps were written, before the checkpoint of that step), or where `RPG_TEST_KILL` says
(`tests/helpers/save_faults.py`: inside a save, inside a step). The test runs the uninterrupted reference and the
resumed run in its own process with [`run`], and the crashing run here, with the same number of torch threads.

Every run samples completions for real (temperature 1), generates every `steps_per_generation = 3` steps and saves
every 2 steps, so that the checkpoint of step 4 falls inside a generation cycle: the resumed run must continue with
the buffered batch, the optimizer (AdamW), the scheduler (linear with warm-up), the RNG and, for the
"reference-sync" and "kl-budget" scenarios, the reference model synced at step 3 and the state of the sync callback
(and, for "kl-budget", of the adaptive KL coefficient).
"""

import argparse
import hashlib
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.testing import build_char_tokenizer


if __name__ == "__main__":  # run as a script: `tests/` on the path, for `helpers.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.save_faults import install_from_env  # noqa: E402
from helpers.tiny_runs import PROMPTS, quiet_cpu_args  # noqa: E402


MAX_STEPS = 7
SAVE_STEPS = 2

SCENARIOS = {
    "sampling": dict(kl_anchor="sampling"),
    # A separate reference, synced to the policy every 3 steps (at step 3 and 6; at generation boundaries only).
    "reference-sync": dict(kl_anchor="reference", sync_ref_model=True, ref_model_sync_steps=3),
    # The same, with a KL budget: β moves after every step (±10% at most: 4 samples per step, horizon 8) and the
    # controller's state is in each checkpoint's trainer_state.json.
    "kl-budget": dict(
        kl_anchor="reference", sync_ref_model=True, ref_model_sync_steps=3, kl_target=0.01, kl_horizon=8.0
    ),
}


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


def make_config(output_dir, scenario: str, **overrides) -> RPGConfig:
    """The run's configuration; `overrides` add to or replace its fields."""
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        steps_per_generation=3,
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        learning_rate=5e-2,
        warmup_steps=2,
        lr_scheduler_type="linear",
        beta=0.05,
    )
    return RPGConfig(**quiet_cpu_args(output_dir, **{**settings, **SCENARIOS[scenario], **overrides}))


class KillAt(TrainerCallback):
    """SIGKILL this process at the end of optimizer step `step`: no cleanup, no exception handler, no checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def digest(module) -> str:
    h = hashlib.sha256()
    for name, param in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
    return h.hexdigest()


def run(
    model_dir, output_dir, scenario: str, *, resume: bool | str = False, crash_at: int | None = None, **overrides
) -> dict:
    """Train (or resume from the newest complete checkpoint in `output_dir`, or from the checkpoint `resume` names);
    return the log history, the weight digests and the process layout (what process 0 saw, with several)."""
    trainer = RPGTrainer(
        model_dir,
        digit_reward,
        args=make_config(output_dir, scenario, **overrides),
        train_dataset=PROMPTS,
        processing_class=build_char_tokenizer(),
        callbacks=[KillAt(crash_at)] if crash_at is not None else None,
    )
    trainer.train(resume_from_checkpoint=resume or None)
    ref = trainer.ref_model
    return {
        "log_history": trainer.state.log_history,
        "policy": digest(trainer.accelerator.unwrap_model(trainer.model)),
        "reference": None if ref is None else digest(trainer.accelerator.unwrap_model(ref)),
        "syncs": None if trainer.ref_sync_callback is None else list(trainer.ref_sync_callback.sync_history),
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": trainer.accelerator.distributed_type.value,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("scenario", choices=list(SCENARIOS))
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    install_from_env()
    run(opts.model_dir, opts.output_dir, opts.scenario, crash_at=opts.crash_at)
    sys.exit("the run was expected to kill itself")
