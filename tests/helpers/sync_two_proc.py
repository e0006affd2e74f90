"""Two-process (CPU, gloo) runs for `tests/test_ref_sync.py`: reference syncs under DDP, and the weight functions
under real DeepSpeed ZeRO-3.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/sync_two_proc.py MODEL_DIR OUT_DIR
    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/helpers/sync_two_proc.py zero3 OUT_DIR

(`accelerate launch --cpu --num_processes 2` starts a single process unless MPI is set up; torchrun is the launcher
that `accelerate launch --multi_gpu` wraps, and accelerate then joins a gloo process group on CPU.)

1. A 6-step run with KL-triggered syncs and a checkpoint at step 3. Process 1 sees its KL raised by 1 (above κ at every
   step), so only the broadcast of the main process's decision keeps it in step. Each process counts the bytes of the
   tensors it creates while the checkpoint's reference is saved ([`AllocatedBytes`]).
2. A second trainer resumes from that checkpoint in the same processes and trains to step 6: each process records the
   reference it restored (before training) and the final one.

Each process writes OUT_DIR/rank{R}.json: its sync steps, callback state, checksums of its reference weights (at the
checkpoint, restored, at the end of both runs), of the policy at the last sync, and the bytes it created while saving.

With `zero3` (needs `deepspeed`): two small models partitioned by `deepspeed.zero.Init`; each process records how
many parameters of the two models are gathered at once during a sync by `rpg_trl.ref_sync.weights.mix_parameters`
and by TRL's `SyncRefModelCallback.sync_target_model`, and checks the synced, saved and restored values against the
values gathered before (OUT_DIR/zero3_rank{R}.json).
"""

import json
import os
import sys
from pathlib import Path

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
    from rpg_trl.testing import build_char_tokenizer

    from helpers.tiny_runs import PROMPTS, quiet_cpu_args

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


def main_zero3(out_dir: str) -> None:
    import importlib
    import types

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from safetensors.torch import save_file
    from trl.distributed import DistributedBackend
    from trl.trainer import callbacks as trl_callbacks

    from rpg_trl.ref_sync.weights import gather_reference, mix_parameters, restore_reference
    from rpg_trl.reliability.teardown import hold_process_group_until_exit

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at start-up (minutes on 2 cores); gloo suffices.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    # No trainer here to hold the gloo group (RPGTrainer does): without it, the group can die during interpreter
    # finalization and a process abort at exit ("terminate called without an active exception"), the failure
    # rpg_trl/reliability/teardown.py prevents.
    assert hold_process_group_until_exit()
    rank = torch.distributed.get_rank()
    zero3 = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    dist = DistributedBackend(types.SimpleNamespace(state=zero3))

    def build(seed):
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 2}):
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32), torch.nn.Linear(32, 8))
        generator = torch.Generator().manual_seed(seed)
        for param in model.parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.data.copy_(torch.randn(param.shape, generator=generator))
        return model

    def gathered(model):
        values = {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                values[name] = param.data.clone()
        return values

    policy, reference = build(1), build(2)
    partitioned = all(p.ds_tensor.numel() < p.ds_numel for p in [*policy.parameters(), *reference.parameters()])
    policy_values, reference_values = gathered(policy), gathered(reference)
    most_gathered = [0]
    original = deepspeed.zero.GatheredParameters

    class Counting(original):
        def __enter__(self):
            super().__enter__()
            params = [*policy.parameters(), *reference.parameters()]
            live = sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
            most_gathered[0] = max(most_gathered[0], live)

    deepspeed.zero.GatheredParameters = Counting
    alpha = 0.25
    mix_parameters(policy.parameters(), reference.parameters(), alpha, dist)
    ours = most_gathered[0]
    mixed = gathered(reference)
    most_gathered[0] = 0
    trl_callbacks.AcceleratorState = lambda: zero3
    trl_callbacks.SyncRefModelCallback.sync_target_model(policy, reference, 1.0)
    trl = most_gathered[0]
    deepspeed.zero.GatheredParameters = original

    tensors = gather_reference(reference, lambda n: True, dist, is_main=rank == 0)
    path = os.path.join(out_dir, "reference.safetensors")
    if rank == 0:
        save_file({n: v.contiguous() for n, v in reference_values.items()}, path)
    torch.distributed.barrier()
    restore_reference(reference, lambda n: True, dist, path)
    restored = gathered(reference)
    report = {
        "partitioned": partitioned,
        "num_parameters": len(policy_values),
        "gathered_at_once_ours": ours,
        "gathered_at_once_trl": trl,
        "mixed_as_expected": all(
            torch.allclose(mixed[n], alpha * policy_values[n] + (1 - alpha) * reference_values[n])
            for n in policy_values
        ),
        "saved": sorted(tensors),
        "saved_equal_policy": all(torch.equal(tensors[n], policy_values[n]) for n in tensors),
        "restored_as_saved": all(torch.equal(restored[n], reference_values[n]) for n in restored),
    }
    with open(os.path.join(out_dir, f"zero3_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests/` on the path, for `helpers.*`
    if sys.argv[1] == "zero3":
        main_zero3(sys.argv[2])
    else:
        main(*sys.argv[1:3])
