"""GPU checks (marked `gpu`, skipped without CUDA): bf16 training, gradient checkpointing, LoRA, DeepSpeed.

Run on a GPU machine with `python -m pytest -q -m gpu tests/test_gpu.py` (`research/gpu/gpu_run.sh` runs it, with the
wheels a machine without network needs). The model is a randomly initialised Qwen3 of about 0.5B parameters built
locally (no download), with a character tokenizer; every divergence x estimator trains in bf16 with gradient
checkpointing; LoRA trains with the "ref" adapter as the synced reference; DeepSpeed ZeRO-2 and ZeRO-3 run through
`accelerate launch` with the configs of `accelerate_configs/` (one launch each: ZeRO-2 with the sampling anchor, ZeRO-3
with a reference model; `accelerate launch` without DeepSpeed is research/gpu/gpu_run.sh's e2e stage). The launches
come first in the file (pytest runs it in order): the longest tests, the ones a stage cut at its deadline lost once,
each ended at the stage's deadline (RPG_STAGE_DEADLINE) with a message rather than killed with pytest.

Dry run on CPU: `RPG_GPU_DRY_RUN=1 python -m pytest -q tests/test_gpu.py` runs the same test functions, unmarked, on
the CPU with the tiny Qwen3 of `rpg_trl.testing` (still bf16 autocast and gradient checkpointing, fewer steps), so that
the GPU suite is known to import and run before a GPU is at hand (`research/tests/test_gpu_dry_run.py` does this in CI). The
DeepSpeed ZeRO stages are left out of the dry run (ZeRO is exercised here on CUDA; on CPU, with 2 processes, by
`tests/test_launch_configs.py`); there the same training script runs under `accelerate launch` without DeepSpeed
(`stage` 0) instead.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.losses import DIVERGENCES, ESTIMATORS
from rpg_trl.testing import build_char_tokenizer, save_tiny_model, sessions
from rpg_trl.testing.training import activation_checkpointing

from helpers.tiny_runs import PROMPTS


#: `RPG_GPU_DRY_RUN=1`: run on CPU with the tiny model instead of skipping (a check that the GPU suite runs at all).
DRY_RUN = os.environ.get("RPG_GPU_DRY_RUN", "0") not in ("", "0")
DEVICE = "cpu" if DRY_RUN else "cuda"

# Marked `gpu` (and so skipped without CUDA by rpg_trl/testing/pytest_plugin.py) except in the dry run, which is meant to
# run on CPU.
pytestmark = [] if DRY_RUN else [pytest.mark.gpu]

# ~0.5B parameters: 28 layers of hidden 1024, MLP 5120, 16 query / 4 key-value heads of 64.
HALF_B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=5120,
    max_position_embeddings=512,
)
#: The dry run's model: `rpg_trl.testing`'s defaults (about 0.1M parameters).
TINY = dict(max_position_embeddings=512)
MODEL_SIZES, PARAM_RANGE = (TINY, (1e4, 1e6)) if DRY_RUN else (HALF_B, (0.4e9, 0.7e9))


def count_sevens(completions, **kwargs):
    return [c.count("7") / 16 for c in completions]


@pytest.fixture(scope="module")
def half_b_model_dir(tmp_path_factory):
    """The ~0.5B Qwen3 (the tiny one in the dry run), saved with its character tokenizer."""
    path = save_tiny_model(tmp_path_factory.mktemp("qwen3-0.5b"), build_char_tokenizer(), **MODEL_SIZES)
    from safetensors.torch import load_file

    n_params = sum(v.numel() for v in load_file(os.path.join(path, "model.safetensors")).values())
    assert PARAM_RANGE[0] < n_params < PARAM_RANGE[1], n_params
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
        **activation_checkpointing(True),
        use_cpu=DRY_RUN,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args.update(overrides)
    return RPGConfig(**args)


def checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on; the attribute was renamed in transformers 5.x."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    return bool(getattr(model, name or "is_gradient_checkpointing"))


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


TRAIN_SCRIPT = textwrap.dedent("""
    import json, math, sys
    from datasets import Dataset
    from rpg_trl import RPGConfig, RPGTrainer
    from rpg_trl.testing import build_char_tokenizer
    from rpg_trl.testing.training import activation_checkpointing

    model_dir, out_dir, anchor, use_cpu = sys.argv[1:5]
    ds = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})
    args = RPGConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                     steps_per_generation=2, max_steps=4, learning_rate=1e-5, bf16=True, **activation_checkpointing(True),
                     use_cpu=use_cpu == "1", kl_anchor=anchor, beta=1e-3, report_to="none", save_strategy="no",
                     logging_steps=1)
    trainer = RPGTrainer(model_dir, lambda completions, **kw: [c.count("7") / 16 for c in completions], args=args,
                         train_dataset=ds, processing_class=build_char_tokenizer())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    print(json.dumps({"losses": losses, "finite": all(math.isfinite(x) for x in losses + kls),
                      "distributed_type": str(trainer.accelerator.distributed_type),
                      "has_ref_model": trainer.ref_model is not None}))
""")
#: Kept under its first name for anything that imports it.
DEEPSPEED_SCRIPT = TRAIN_SCRIPT


def _zero_stage_skip(stage):
    if stage and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (research/gpu/gpu_run.sh carries its wheel)"
    return None


#: (ZeRO stage, KL anchor) of each launch: on the GPU, ZeRO-2 with the one model of the sampling anchor and ZeRO-3 with
#: a reference model (partitioned beside the policy); `accelerate launch` without DeepSpeed is gpu_run.sh's e2e stage.
#: The dry run (CPU: no ZeRO here) launches the same script once without DeepSpeed.
ZERO_CASES = [(0, "reference")] if DRY_RUN else [(2, "sampling"), (3, "reference")]
#: Seconds allowed to one `accelerate launch` (a 4-step run; about 30-60 s on one H100 by estimate, 20 s on CPU in the
#: dry run), so that a hung launch fails its test instead of the whole GPU call.
LAUNCH_TIMEOUT = int(os.environ.get("RPG_GPU_LAUNCH_TIMEOUT", "300" if DRY_RUN else "120"))
#: Seconds kept before the stage's deadline (RPG_STAGE_DEADLINE, set by research/gpu/gpu_run.sh): a launch past its
#: time is ended (SIGTERM, then SIGKILL after rpg_trl.testing.sessions' 5 s) and its test fails with its output,
#: within pytest-timeout's limit (research/gpu/pytest_times.py keeps 10 s) and before the stage's deadline ends pytest
#: unheard.
LAUNCH_MARGIN = 20


def launch_timeout() -> tuple[float, str]:
    """The seconds one launch may take: LAUNCH_TIMEOUT, or less where the stage's deadline is nearer; and why."""
    deadline = os.environ.get("RPG_STAGE_DEADLINE")
    if not deadline:
        return LAUNCH_TIMEOUT, "LAUNCH_TIMEOUT"
    left = float(deadline) - time.time() - LAUNCH_MARGIN
    if left < LAUNCH_TIMEOUT:
        return left, f"the stage's deadline (RPG_STAGE_DEADLINE) less {LAUNCH_MARGIN} s"
    return LAUNCH_TIMEOUT, "LAUNCH_TIMEOUT"


def run_launch(cmd) -> subprocess.CompletedProcess:
    """`cmd` in a session of its own (the launcher and its worker end together), ended past `launch_timeout()`: the
    test fails saying so, with the output so far, instead of being killed unheard with the stage."""
    timeout, why = launch_timeout()
    if timeout < 10 and why != "LAUNCH_TIMEOUT":  # too little left for a launch to start (about 10 s on CPU)
        pytest.fail(
            f"not launched: {timeout + LAUNCH_MARGIN:.0f} s left before the stage's deadline (RPG_STAGE_DEADLINE)"
        )
    process = sessions.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sessions.stop_all()
        stdout, stderr = process.communicate()
        pytest.fail(
            f"accelerate launch did not finish in {timeout:.0f} s ({why}); ended.\nstdout: {stdout[-2000:]}\n"
            f"stderr: {stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


@pytest.mark.slow  # it starts a process: unmarked, rpg_trl/testing/tiers.py fails it at its teardown
@pytest.mark.parametrize("stage, anchor", ZERO_CASES)
def test_deepspeed_zero_single_process(half_b_model_dir, tmp_path, stage, anchor):
    """`accelerate launch --num_processes 1` of a 4-step bf16 run with DeepSpeed ZeRO-2 or ZeRO-3 (the configs of
    `accelerate_configs/`), or, in the dry run, stage 0: the same script without DeepSpeed."""
    reason = _zero_stage_skip(stage)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    if stage:
        config = os.path.join(os.path.dirname(__file__), "..", "accelerate_configs", f"deepspeed_zero{stage}.yaml")
        launcher = ["--config_file", config]
    else:
        launcher = ["--num_machines", "1", "--dynamo_backend", "no"]
        launcher += ["--cpu", "--mixed_precision", "bf16"] if DRY_RUN else ["--mixed_precision", "bf16"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "1", str(script)]
    cmd += [half_b_model_dir, str(tmp_path / "out"), anchor, "1" if DRY_RUN else "0"]
    proc = run_launch(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"] and len(result["losses"]) == 4
    assert ("DEEPSPEED" in result["distributed_type"]) == (stage > 0), result["distributed_type"]
    assert result["has_ref_model"] == (anchor == "reference")


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_bf16_every_variant_finite_with_gradient_checkpointing(half_b_model_dir, tmp_path, divergence, estimator):
    args = gpu_args(tmp_path, divergence=divergence, estimator=estimator, beta=1e-3, max_steps=4)
    trainer = RPGTrainer(
        half_b_model_dir, count_sevens, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )
    assert next(trainer.model.parameters()).device.type == DEVICE
    trainer.train()
    assert trainer.args.bf16 and checkpointing(trainer.model)
    assert trainer.state.global_step == 4
    for key in ("loss", "grad_norm", "kl", "clip_ratio/dual_mean", "importance_weight/max"):
        values = logged(trainer, key)
        assert len(values) == 4 and all(math.isfinite(x) for x in values), (key, values)


def test_bf16_reward_rises(half_b_model_dir, tmp_path):
    # The tiny model of the dry run learns at a larger rate, in fewer steps (as tests/test_trainer.py's run).
    settings = dict(max_steps=20, learning_rate=1e-2, logging_steps=4) if DRY_RUN else {}
    settings = {**dict(max_steps=40, learning_rate=3e-5, logging_steps=4), **settings}
    trainer = RPGTrainer(
        half_b_model_dir,
        count_sevens,
        args=gpu_args(tmp_path, **settings),
        train_dataset=PROMPTS,
        processing_class=build_char_tokenizer(),
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
    pairs = [(name, name.replace(".default.", ".ref.")) for name in params if ".default." in name]
    assert pairs
    for name, ref_name in pairs:
        assert params[ref_name].device.type == DEVICE
        assert not params[ref_name].requires_grad and params[name].requires_grad
    # A sync copies the trained adapter into "ref": some pair differs from LoRA's initialisation (B = 0).
    assert any(params[ref_name].abs().sum() > 0 for name, ref_name in pairs if "lora_B" in name)


def test_cuda_is_really_used():
    if DRY_RUN:
        pytest.skip("the dry run runs on CPU")
    assert torch.cuda.is_available()
    assert torch.cuda.is_bf16_supported()
