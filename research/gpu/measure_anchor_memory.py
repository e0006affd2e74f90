# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""How much memory the KL anchor costs: parameter + buffer bytes that an RPGTrainer holds for its models.

Builds a small local Qwen3 (no download) and an RPGTrainer per anchor, then counts the distinct tensors of the policy
and of the reference (a tensor shared by both, or tied weights, counts once):

- `kl_anchor="sampling"`: π_ref = π_old (the paper's runs): the policy alone.
- `kl_anchor="reference"`, full fine-tuning: a second, frozen copy of the model.
- `kl_anchor="reference"` with LoRA and `ref_model_sync_kl_threshold`: the base model once, the trained adapter and
  its frozen "ref" copy (what [`RefModelSyncCallback`] syncs).

    python research/gpu/measure_anchor_memory.py --hidden_size 256 --num_hidden_layers 4 --lora_r 16

Optimizer states and activations come on top and are the same for the first two rows (LoRA's are smaller).
"""

import tempfile
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import TrlParser

from rpg_research.toy import build_char_tokenizer, save_tiny_model
from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.ref_sync.weights import REF_ADAPTER


@dataclass
class MeasureArguments:
    hidden_size: int = field(default=256, metadata={"help": "Hidden size of the Qwen3 built for the measurement."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Number of decoder layers."})
    intermediate_size: int = field(default=768, metadata={"help": "MLP width."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (attention and MLP projections)."})


def held_bytes(*modules) -> int:
    """Bytes of the distinct parameters and buffers of `modules` (storage shared between them counted once)."""
    seen, total = set(), 0
    for module in modules:
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            key = (tensor.untyped_storage().data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total


def held_bytes_without_ref(peft_model) -> int:
    """Bytes of the PEFT model without its "ref" adapter (the policy's own share)."""
    return sum(
        t.numel() * t.element_size()
        for name, t in [*peft_model.named_parameters(), *peft_model.named_buffers()]
        if f".{REF_ADAPTER}." not in name
    )


def main(measure: MeasureArguments) -> None:
    tokenizer = build_char_tokenizer()
    prompts = Dataset.from_dict({"prompt": ["1+1="]})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(
            f"{tmp}/model",
            tokenizer,
            hidden_size=measure.hidden_size,
            num_hidden_layers=measure.num_hidden_layers,
            intermediate_size=measure.intermediate_size,
        )
        lora = LoraConfig(
            r=measure.lora_r,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        setups = {
            "sampling (π_ref = π_old)": ({"kl_anchor": "sampling"}, None),
            "reference, full model": ({"kl_anchor": "reference", "ref_model_sync_kl_threshold": 0.1}, None),
            "reference, LoRA 'ref' adapter": ({"kl_anchor": "reference", "ref_model_sync_kl_threshold": 0.1}, lora),
        }
        rows = []
        for name, (overrides, peft_config) in setups.items():
            args = RPGConfig(f"{tmp}/out", use_cpu=True, report_to="none", beta=1e-4, **overrides)
            trainer = RPGTrainer(
                model_dir, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=prompts,
                processing_class=tokenizer, peft_config=peft_config,
            )  # fmt: skip
            policy_only = held_bytes(trainer.model) if peft_config is None else held_bytes_without_ref(trainer.model)
            rows.append((name, held_bytes(trainer.model, trainer.ref_model), policy_only))
            del trainer

    base = rows[0][1]
    print(f"Qwen3 hidden={measure.hidden_size} layers={measure.num_hidden_layers}, fp32, LoRA r={measure.lora_r}")
    print(f"{'KL anchor':32s} {'held (MiB)':>11s} {'anchor extra (MiB)':>19s} {'vs sampling':>12s}")
    for name, total, policy_only in rows:
        print(f"{name:32s} {total / 2**20:11.3f} {(total - policy_only) / 2**20:19.3f} {total / base:11.3f}x")


if __name__ == "__main__":
    torch.set_num_threads(1)
    (measure_args,) = TrlParser(MeasureArguments).parse_args_and_config()
    main(measure_args)
