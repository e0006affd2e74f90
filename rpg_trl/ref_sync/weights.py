# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""How to move the reference: the weight side of the paper's iterative reference update (Sec. 5), per backend.

A sync sets `π_ref ← α·π_θ + (1 − α)·π_ref` (α = 1 copies the policy; α < 1 is TRL's `ref_model_mixup_alpha`, the
update of its `SyncRefModelCallback`). The reference is either a full model (`trainer.ref_model`) or, with PEFT, a
frozen adapter named "ref" next to the trained one (no second base model).

| backend | sync | save (into a checkpoint) | restore (on resume) |
|---|---|---|---|
| one process, DDP, ZeRO-1/2 | in place, pair by pair | the main process copies each tensor to CPU | every process reads one tensor at a time |
| DeepSpeed ZeRO-3 | each (policy, reference) parameter pair gathered alone, updated on rank 0, re-partitioned | each parameter gathered alone; only the main process keeps a CPU copy | each parameter gathered alone and written by rank 0 |
| FSDP1 / FSDP2 | local shards (both models wrapped alike); adapters under `summon_full_params` (FSDP1) | `get_model_state_dict(full_state_dict, cpu_offload)`: rank 0 alone receives it | `set_model_state_dict` on every process |

So the extra memory of a sync under ZeRO-3 is one gathered parameter pair, not both models, and a checkpoint costs one
CPU copy of the reference on the main process and none on the others. All functions that take a trainer are
collective: call them on every process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch
from transformers.utils import logging
from trl.distributed import DistributedBackend


logger = logging.get_logger(__name__)

#: Name of the PEFT adapter that serves as the reference (the name TRL's GRPOTrainer looks for).
REF_ADAPTER = "ref"
#: File, inside each checkpoint folder, holding the synced reference (full model parameters or "ref" adapter).
REFERENCE_FILE = "rpg_reference.safetensors"


# ------------------------------------------------------------------------------------------------ what the reference is
def peft_model_of(trainer):
    """The trainer's unwrapped PEFT model, or `None` when the policy is not a PEFT model."""
    from accelerate.utils import is_peft_model

    model = trainer.accelerator.unwrap_model(trainer.model)
    return model if is_peft_model(model) else None


def adapter_parameters(peft_model) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trained adapter's parameters and the matching "ref" adapter's, in the same order."""
    trained = peft_model.active_adapter
    named = dict(peft_model.named_parameters())
    pairs = [
        (param, named[name.replace(f".{trained}.", f".{REF_ADAPTER}.")])
        for name, param in named.items()
        if f".{trained}." in name and name.replace(f".{trained}.", f".{REF_ADAPTER}.") in named
    ]
    if not pairs:
        raise ValueError(f"The PEFT model has no '{REF_ADAPTER}' adapter matching its trained adapter '{trained}'.")
    return [p for p, _ in pairs], [r for _, r in pairs]


def add_ref_adapter(trainer, peft_model) -> None:
    """Add the frozen "ref" adapter, a copy of the trained adapter (so, while the trained one is freshly initialised
    with LoRA B = 0, the reference equals the base model)."""
    import peft
    from packaging.version import Version

    trained = peft_model.active_adapter
    config = peft_model.peft_config[trained]
    if getattr(config, "target_parameters", None) and Version(peft.__version__) < Version("0.20.0"):
        raise ValueError(
            f"PEFT {peft.__version__} cannot hold a second adapter next to one that uses `target_parameters` "
            f"(peft#3340), so the '{REF_ADAPTER}' adapter that a reference sync moves cannot be created. Upgrade "
            "to peft>=0.20.0, or unset `sync_ref_model` / `ref_model_sync_kl_threshold`."
        )
    peft_model.add_adapter(REF_ADAPTER, config)
    peft_model.set_adapter(trained)  # keeps the trained adapter trainable and the new one frozen
    trained_params, ref_params = adapter_parameters(peft_model)
    if any(hasattr(p, "ds_id") for p in trained_params + ref_params):
        sync_reference(trainer, alpha=1.0)  # already ZeRO-3-partitioned
    else:
        with torch.no_grad():  # before DeepSpeed/FSDP wrap the model: a plain copy on every process
            for param, ref_param in zip(trained_params, ref_params, strict=True):
                ref_param.copy_(param)
    for param in ref_params:
        param.requires_grad_(False)
    logger.info(f"RefModelSyncCallback: created the frozen '{REF_ADAPTER}' adapter (a copy of '{trained}').")


def reference_parameters(trainer):
    """`(module, keep, kind)`: the module whose parameters named `n` with `keep(n)` are the reference, and `kind`
    ("model" or "adapter", written into the checkpoint file's metadata)."""
    peft_model = peft_model_of(trainer)
    fsdp = DistributedBackend(trainer.accelerator).is_fsdp
    if peft_model is not None:
        return (trainer.model_wrapped if fsdp else peft_model), (lambda n: f".{REF_ADAPTER}." in n), "adapter"
    module = trainer.ref_model if fsdp else trainer.accelerator.unwrap_model(trainer.ref_model)
    return module, (lambda n: True), "model"


def check_same_layout(source, target, source_name: str, target_name: str) -> None:
    """Refuse to sync parameter lists that do not correspond one to one (ZeRO-3 shapes: `ds_shape`)."""
    source, target = list(source), list(target)
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in source]
    target_shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in target]
    if shapes != target_shapes:
        raise ValueError(
            f"Cannot sync {target_name} to {source_name}: their parameters differ ({len(target)} vs {len(source)} "
            "tensors, or different shapes). The reference must have the policy's architecture, wrapped the same way."
        )


# ------------------------------------------------------------------------------------------------ the sync
@contextmanager
def _writable(params, dist: DistributedBackend):
    """Yield whether this process writes `params`. Under ZeRO-3: gathered in full for the block, rank 0 writes and
    its values are re-partitioned on exit (`modifier_rank=0`); elsewhere every process writes its own copy."""
    if dist.is_zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            yield deepspeed.comm.get_rank() == 0
    else:
        yield True


def mix_parameters(source, target, alpha: float, dist: DistributedBackend) -> None:
    """`target ← α·source + (1 − α)·target`, one parameter pair at a time (the update of TRL's
    `SyncRefModelCallback`). Under ZeRO-3 each pair is gathered alone, so the memory a sync adds is one pair of full
    parameters, not the two models that gathering both lists at once would hold."""
    source, target = list(source), list(target)
    for src, tgt in zip(source, target, strict=True):
        with _writable([src, tgt], dist) as writes:
            if writes:
                tgt.data.mul_(1.0 - alpha).add_(src.data, alpha=alpha)


def sync_reference(trainer, alpha: float) -> None:
    """Set π_ref ← α·π_θ + (1 − α)·π_ref: the full reference model, or with PEFT the "ref" adapter."""
    dist = DistributedBackend(trainer.accelerator)
    peft_model = peft_model_of(trainer)
    if peft_model is not None:
        # Under FSDP1 two adapters of one flat parameter are sharded at different offsets: materialise them.
        context = dist.summon_full_params(trainer.model_wrapped, writeback=True) if dist.fsdp_version == 1 else None
        with context or nullcontext():
            trained, ref = adapter_parameters(peft_model)
            check_same_layout(trained, ref, f"adapter '{peft_model.active_adapter}'", f"adapter '{REF_ADAPTER}'")
            mix_parameters(trained, ref, alpha, dist)
        return
    if dist.fsdp_version == 1:
        # Both roots are wrapped with the same policy, so their (flat) local shards correspond element-wise.
        policy, reference = trainer.model_wrapped, trainer.ref_model
    else:
        # DeepSpeed engines, DDP wrappers: the modules inside. FSDP2 parameters are DTensors sharded alike.
        policy = trainer.accelerator.unwrap_model(trainer.model)
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    check_same_layout(policy.parameters(), reference.parameters(), "the policy", "the reference model")
    mix_parameters(policy.parameters(), reference.parameters(), alpha, dist)


# ------------------------------------------------------------------------------------------------ checkpoints
def gather_reference(module, keep, dist: DistributedBackend, is_main: bool) -> dict[str, torch.Tensor]:
    """CPU copies of the parameters of `module` named `n` with `keep(n)`, on the main process only (`{}` elsewhere).
    Collective under ZeRO-3 and FSDP (every process takes part in the gathers)."""
    if dist.is_fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # full_state_dict + cpu_offload: gathered unit by unit, and only rank 0 receives the (CPU) tensors.
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        tensors, storages = {}, set()
        for name, tensor in full.items():
            if keep(name):
                tensor = tensor.detach().contiguous()
                pointer = tensor.untyped_storage().data_ptr()
                if pointer in storages and tensor.numel():  # tied weights: safetensors refuses shared storage
                    tensor = tensor.clone()
                storages.add(pointer)
                tensors[name] = tensor
        return tensors
    if not dist.is_zero3 and not is_main:
        return {}
    tensors = {}
    for name, param in module.named_parameters():
        if keep(name):
            with dist.gather_params([param]):  # one parameter at a time under ZeRO-3
                if is_main:
                    tensors[name] = param.detach().to("cpu", copy=True).contiguous()
    return tensors


def save_reference(trainer, output_dir: str) -> None:
    """Write the reference into the checkpoint folder `output_dir` as [`REFERENCE_FILE`] (parameter names as the
    unwrapped model, or the PEFT model for the "ref" adapter, names them). Only the main process holds a copy."""
    module, keep, kind = reference_parameters(trainer)
    accelerator = trainer.accelerator
    tensors = gather_reference(module, keep, DistributedBackend(accelerator), accelerator.is_main_process)
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        os.makedirs(output_dir, exist_ok=True)
        save_file(tensors, os.path.join(output_dir, REFERENCE_FILE), metadata={"format": "pt", "kind": kind})
    del tensors
    accelerator.wait_for_everyone()


def restore_reference(module, keep, dist: DistributedBackend, path: str) -> None:
    """Copy the tensors of the file `path` into the parameters of `module` named `n` with `keep(n)`, one tensor at a
    time (the file is memory-mapped: no process holds a second copy of the reference). Every process reads the file
    (as `transformers` does for a checkpoint's weights), except under ZeRO-3 where rank 0 writes each gathered
    parameter and DeepSpeed re-partitions it."""
    from safetensors import safe_open

    if dist.is_fsdp:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, load_file(path), options=StateDictOptions(full_state_dict=True, strict=False))
        return
    params = {name: param for name, param in module.named_parameters() if keep(name)}
    with safe_open(path, framework="pt", device="cpu") as f:
        names = set(f.keys())
        if names != set(params):
            raise ValueError(
                f"{path} does not match the reference: missing {sorted(set(params) - names)[:5]}, unexpected "
                f"{sorted(names - set(params))[:5]}. Resume with the model and PEFT config that wrote the checkpoint."
            )
        for name, param in params.items():
            with _writable([param], dist) as writes:
                if writes:
                    param.data.copy_(f.get_tensor(name))


def load_reference(trainer, path: str) -> None:
    """Restore the reference that [`save_reference`] wrote to `path`, on every process."""
    module, keep, _ = reference_parameters(trainer)
    restore_reference(module, keep, DistributedBackend(trainer.accelerator), path)
