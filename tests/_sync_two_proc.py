"""Two-process (CPU, gloo) run for `tests/test_callbacks.py`: reference syncs under DDP.

    python -m torch.distributed.run --nproc_per_node 2 tests/_sync_two_proc.py MODEL_DIR OUT_DIR

(`accelerate launch --cpu --num_processes 2` starts a single process unless MPI is set up; torchrun is the launcher
that `accelerate launch --multi_gpu` wraps, and accelerate then joins a gloo process group on CPU.)

1. A 6-step run with KL-triggered syncs and a checkpoint at step 3. Process 1 sees its KL raised by 1 (above κ at every
   step), so only the broadcast of the main process's decision keeps it in step. Each process counts the bytes of the
   tensors it creates while the checkpoint's reference is saved ([`AllocatedBytes`]).
2. A second trainer resumes from that checkpoint in the same processes and trains to step 6: each process records the
   reference it restored (before training) and the final one.

Each process writes OUT_DIR/rank{R}.json: its sync steps, callback state, checksums of its reference weights (at the
checkpoint, restored, at the end of both runs), of the policy at the last sync, and the bytes it created while saving.
"""

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocatedBytes(TorchDispatchMode):
    """Counts, while active, the bytes of every new tensor storage that a PyTorch operator returns (a copy to CPU, a
    clone, a new tensor); in-place operators and views return no new storage and count nothing. Tensors made outside
    PyTorch's operators (`torch.frombuffer`, numpy) are not seen."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                pointer = tensor.untyped_storage().data_ptr()
                if pointer not in known:
                    known.add(pointer)
                    self.bytes += tensor.untyped_storage().nbytes()
        return out


def checksum(module) -> float:
    return float(sum(p.detach().double().abs().sum() + p.detach().double().sum() for p in module.parameters()))


def main(model_dir: str, out_dir: str) -> None:
    from transformers import TrainerCallback

    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.tiny import build_char_tokenizer

    from _tiny_runs import PROMPTS, quiet_cpu_args

    def digit_fraction(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / 8 for c in completions]

    def make_trainer(output_dir):
        args = RPGConfig(
            **quiet_cpu_args(
                output_dir,
                kl_anchor="reference",
                beta=0.05,
                learning_rate=5e-2,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=8,
                max_steps=6,
                ref_model_sync_kl_threshold=0.02,
                ref_model_sync_kl_ema=0.0,
                save_strategy="steps",
                save_steps=3,
                save_only_model=False,
            )
        )
        return RPGTrainer(
            model_dir, digit_fraction, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
        )

    def reference_checksum(trainer):
        return checksum(trainer.accelerator.unwrap_model(trainer.ref_model))

    class Probe(TrainerCallback):
        """Records the policy at the last sync and the reference at the step of the checkpoint."""

        def __init__(self, trainer):
            self.trainer, self.policy_at_last_sync, self.reference_at = trainer, None, {}

        def on_step_end(self, args, state, control, **kwargs):
            if self.trainer.ref_sync_callback.sync_history[-1:] == [state.global_step]:
                self.policy_at_last_sync = checksum(self.trainer.accelerator.unwrap_model(self.trainer.model))
            self.reference_at[state.global_step] = reference_checksum(self.trainer)

    # ---- 1. the uninterrupted run, counting the bytes created while the reference is saved
    trainer = make_trainer(os.path.join(out_dir, "a"))
    rank = trainer.accelerator.process_index
    callback = trainer.ref_sync_callback
    initial_reference = reference_checksum(trainer)
    if rank == 1:
        # As if its reduction disagreed (KL + 1 > κ at every step): only the broadcast decision keeps it in step.
        observe_kl = callback.observe_kl
        callback.observe_kl = lambda kl_sum, num_tokens: observe_kl(kl_sum + num_tokens, num_tokens)
    saved_bytes = []
    save_checkpoint = callback.save_checkpoint

    def counted_save_checkpoint(trainer, trial=None):
        with AllocatedBytes() as counter:
            save_checkpoint(trainer, trial)
        saved_bytes.append(counter.bytes)

    callback.save_checkpoint = counted_save_checkpoint
    probe = Probe(trainer)
    trainer.add_callback(probe)
    trainer.train()

    # ---- 2. resume from the checkpoint at step 3 and finish the run
    checkpoint = os.path.join(out_dir, "a", "checkpoint-3")
    resumed = make_trainer(os.path.join(out_dir, "b"))
    restored = {}

    class Restored(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            restored["reference"] = reference_checksum(resumed)
            restored["state"] = resumed.ref_sync_callback.state()

    resumed.add_callback(Restored())
    resumed.train(resume_from_checkpoint=checkpoint)

    report = {
        "num_processes": trainer.accelerator.num_processes,
        "sync_history": callback.sync_history,
        "state": callback.state(),
        "reference_checksum": reference_checksum(trainer),
        "policy_checksum_at_last_sync": probe.policy_at_last_sync,
        "initial_reference_checksum": initial_reference,
        "reference_checksum_at_checkpoint": probe.reference_at[3],
        "reference_bytes": sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters()),
        "bytes_created_while_saving": saved_bytes,
        "restored_reference_checksum": restored["reference"],
        "restored_state": restored["state"],
        "resumed_final_reference_checksum": reference_checksum(resumed),
        "resumed_final_state": resumed.ref_sync_callback.state(),
    }
    assert report["num_processes"] == 2, report
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
