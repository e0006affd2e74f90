"""GPU checks (marked `gpu`, skipped without CUDA): bf16 training, gradient checkpointing, LoRA, DeepSpeed.

Run on a GPU machine with `python -m pytest -q -m gpu tests/test_gpu.py`. The model is a randomly initialised Qwen3 of
about 0.5B parameters built locally (no download), with a character tokenizer.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.losses import DIVERGENCES, ESTIMATORS
from rpg_trl.tiny import build_char_tokenizer, save_tiny_model

from _tiny_runs import PROMPTS


pytestmark = pytest.mark.gpu

# ~0.5B parameters: 28 layers of hidden 1024, MLP 5120, 16 query / 4 key-value heads of 64.
HALF_B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=5120,
    max_position_embeddings=512,
)


def count_sevens(completions, **kwargs):
    return [c.count("7") / 16 for c in completions]


@pytest.fixture(scope="module")
def half_b_model_dir(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("qwen3-0.5b"), build_char_tokenizer(), **HALF_B)
    from safetensors.torch import load_file

    n_params = sum(v.numel() for v in load_file(os.path.join(path, "model.safetensors")).values())
    assert 0.4e9 < n_params < 0.7e9, n_params
    return path


def gpu_args(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        steps_per_generation=4,
        max_steps=8,
        learning_rate=1e-5,
        logging_steps=1,
        bf16=True,
        gradient_checkpointing=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args.update(overrides)
    return RPGConfig(**args)


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_bf16_every_variant_finite_with_gradient_checkpointing(half_b_model_dir, tmp_path, divergence, estimator):
    args = gpu_args(tmp_path, divergence=divergence, estimator=estimator, beta=1e-3, max_steps=4)
    trainer = RPGTrainer(
        half_b_model_dir, count_sevens, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )
    assert next(trainer.model.parameters()).is_cuda
    trainer.train()
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))
    assert all(math.isfinite(x) for x in logged(trainer, "grad_norm"))


def test_bf16_reward_rises(half_b_model_dir, tmp_path):
    args = gpu_args(tmp_path, max_steps=40, learning_rate=3e-5, logging_steps=4)
    trainer = RPGTrainer(
        half_b_model_dir, count_sevens, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )
    trainer.train()
    rewards = logged(trainer, "reward")
    assert max(rewards[-3:]) > rewards[0] + 0.1, rewards


def test_lora_one_gpu_with_ref_adapter_sync(half_b_model_dir, tmp_path):
    from peft import LoraConfig

    args = gpu_args(
        tmp_path,
        kl_anchor="reference",
        beta=1e-2,
        ref_model_sync_kl_threshold=1e-6,
        learning_rate=1e-3,
        max_steps=8,
    )
    trainer = RPGTrainer(
        half_b_model_dir,
        count_sevens,
        args=args,
        train_dataset=PROMPTS,
        processing_class=build_char_tokenizer(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    assert trainer.ref_model is None  # the reference is the "ref" adapter, not a second base model
    syncs = logged(trainer, "ref/syncs")
    assert syncs and syncs[-1] >= 1
    params = dict(trainer.model.named_parameters())
    for name, param in params.items():
        if ".default." in name:
            ref = params[name.replace(".default.", ".ref.")]
            assert ref.device.type == "cuda"


DEEPSPEED_SCRIPT = textwrap.dedent("""
    import json, math, sys
    from datasets import Dataset
    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.tiny import build_char_tokenizer

    model_dir, out_dir, anchor = sys.argv[1:4]
    ds = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})
    args = RPGConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                     steps_per_generation=2, max_steps=4, learning_rate=1e-5, bf16=True, gradient_checkpointing=True,
                     kl_anchor=anchor, beta=1e-3, report_to="none", save_strategy="no", logging_steps=1)
    trainer = RPGTrainer(model_dir, lambda completions, **kw: [c.count("7") / 16 for c in completions], args=args,
                         train_dataset=ds, processing_class=build_char_tokenizer())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"losses": losses, "finite": all(math.isfinite(x) for x in losses)}))
""")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("anchor", ["sampling", "reference"])
def test_deepspeed_zero_single_process(half_b_model_dir, tmp_path, stage, anchor):
    script = tmp_path / "ds_train.py"
    script.write_text(DEEPSPEED_SCRIPT)
    config = os.path.join(os.path.dirname(__file__), "..", "accelerate_configs", f"deepspeed_zero{stage}.yaml")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config,
        "--num_processes",
        "1",
        str(script),
        half_b_model_dir,
        str(tmp_path / "out"),
        anchor,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"] and len(result["losses"]) == 4


def test_cuda_is_really_used():
    assert torch.cuda.is_available()
    assert torch.cuda.is_bf16_supported()
