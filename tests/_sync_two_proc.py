"""Two-process (CPU, gloo) run for `tests/test_callbacks.py`: KL-triggered reference syncs must happen at the same
steps on every process.

    python -m torch.distributed.run --nproc_per_node 2 tests/_sync_two_proc.py MODEL_DIR OUT_DIR

(`accelerate launch --cpu --num_processes 2` starts a single process unless MPI is set up; torchrun is the launcher
that `accelerate launch --multi_gpu` wraps, and accelerate then joins a gloo process group on CPU.)

Process 1 sees its KL raised by 1 (above κ at every step), so only the broadcast of the main process's decision keeps
it in step.
Each process writes OUT_DIR/rank{R}.json: its sync steps, callback state and checksums of its reference weights and of
the policy at the last sync.
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.tiny import build_char_tokenizer

from _tiny_runs import PROMPTS, quiet_cpu_args


def digit_fraction(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


def checksum(module) -> float:
    return float(sum(p.detach().double().abs().sum() + p.detach().double().sum() for p in module.parameters()))


class PolicyAtSync(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.value = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.ref_sync_callback.sync_history[-1:] == [state.global_step]:
            self.value = checksum(self.trainer.accelerator.unwrap_model(self.trainer.model))


def main(model_dir: str, out_dir: str) -> None:
    args = RPGConfig(
        **quiet_cpu_args(
            out_dir,
            kl_anchor="reference",
            beta=0.05,
            learning_rate=5e-2,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_steps=6,
            ref_model_sync_kl_threshold=0.02,
            ref_model_sync_kl_ema=0.0,
        )
    )
    trainer = RPGTrainer(
        model_dir, digit_fraction, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )
    if trainer.accelerator.process_index == 1:
        # As if its reduction disagreed (KL + 1 > κ at every step): only the broadcast decision keeps it in step.
        observe_kl = trainer.ref_sync_callback.observe_kl
        trainer.ref_sync_callback.observe_kl = lambda kl_sum, num_tokens: observe_kl(kl_sum + num_tokens, num_tokens)
    probe = PolicyAtSync(trainer)
    trainer.add_callback(probe)
    trainer.train()
    callback = trainer.ref_sync_callback
    report = {
        "num_processes": trainer.accelerator.num_processes,
        "sync_history": callback.sync_history,
        "state": callback.state(),
        "reference_checksum": checksum(trainer.accelerator.unwrap_model(trainer.ref_model)),
        "policy_checksum_at_last_sync": probe.value,
    }
    assert report["num_processes"] == 2, report
    with open(os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
