"""Tests of `rpg_trl.callbacks.RefModelSyncCallback`: iterative reference updates on a tiny local Qwen3 (CPU)."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback
from trl.trainer.callbacks import SyncRefModelCallback

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.callbacks import REF_ADAPTER, REFERENCE_FILE, RefModelSyncCallback
from rpg_trl.tiny import build_char_tokenizer

from _tiny_runs import PROMPTS, quiet_cpu_args


TWO_PROC_SCRIPT = os.path.join(os.path.dirname(__file__), "_sync_two_proc.py")


def digit_fraction(completions, **kwargs):
    """A dense reward (most groups have distinct rewards), so that a large learning rate moves the policy fast."""
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


def make_trainer(model_dir, out, peft_config=None, **overrides):
    defaults = {
        "kl_anchor": "reference",
        "beta": 0.05,
        "learning_rate": 5e-2,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 6,
        "ref_model_sync_kl_ema": 0.0,
    }
    args = quiet_cpu_args(out, **{**defaults, **overrides})
    return RPGTrainer(
        model_dir,
        digit_fraction,
        args=RPGConfig(**args),
        train_dataset=PROMPTS,
        processing_class=build_char_tokenizer(),
        peft_config=peft_config,
    )


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def logged(trainer, key):
    """{step: value} of a logged metric."""
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def reference_and_policy(trainer):
    """Detached copies of (reference tensors, matching policy tensors): the full models, or the two LoRA adapters."""
    if trainer.ref_model is not None:
        ref = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
        policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return ref, policy
    named = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    ref = {n.replace(f".{REF_ADAPTER}.", ".default."): p for n, p in named.items() if f".{REF_ADAPTER}." in n}
    return ref, {n: named[n] for n in ref}


class SyncProbe(TrainerCallback):
    """Added after the sync callback: records (reference before, policy, reference after) around every sync."""

    def __init__(self, trainer):
        self.trainer, self.syncs, self.seen = trainer, [], 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.ref_before, _ = reference_and_policy(self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        callback = self.trainer.ref_sync_callback
        if callback.num_syncs > self.seen:
            self.seen = callback.num_syncs
            ref_after, policy = reference_and_policy(self.trainer)
            self.syncs.append((state.global_step, self.ref_before, policy, ref_after))


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"kl_anchor": "reference", "ref_model_sync_kl_threshold": 0.0}, "ref_model_sync_kl_threshold"),
        ({"kl_anchor": "reference", "ref_model_sync_kl_threshold": -1.0}, "ref_model_sync_kl_threshold"),
        ({"kl_anchor": "sampling", "ref_model_sync_kl_threshold": 0.1}, "ref_model_sync_kl_threshold"),
        ({"kl_anchor": "reference", "sync_ref_model": True, "ref_model_sync_steps": 0}, "ref_model_sync_steps"),
        (
            {"kl_anchor": "reference", "ref_model_sync_kl_threshold": 0.1, "ref_model_sync_kl_ema": 1.0},
            "ref_model_sync_kl_ema",
        ),
        ({"kl_anchor": "reference", "sync_ref_model": True, "ref_model_mixup_alpha": 0.0}, "ref_model_mixup_alpha"),
    ],
    ids=["kappa-zero", "kappa-negative", "kappa-with-sampling-anchor", "interval-zero", "ema-one", "alpha-zero"],
)
def test_invalid_sync_config_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        RPGConfig(output_dir=str(tmp_path), beta=0.05, report_to="none", use_cpu=True, **overrides)


def test_valid_sync_config(tmp_path):
    args = RPGConfig(
        output_dir=str(tmp_path), kl_anchor="reference", beta=0.05, ref_model_sync_kl_threshold=0.1, use_cpu=True
    )
    assert (args.ref_model_sync_kl_threshold, args.ref_model_sync_kl_ema) == (0.1, 0.9)


# ------------------------------------------------------------------------------------------------ full reference model
def test_small_threshold_syncs_and_ref_kl_drops_after_each(tiny_model_dir, tmp_path):
    kappa = 0.02
    trainer = make_trainer(tiny_model_dir, tmp_path, ref_model_sync_kl_threshold=kappa, max_steps=8)
    assert not any(isinstance(cb, SyncRefModelCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    callback = trainer.ref_sync_callback
    ref_kl, syncs, kl = logged(trainer, "ref/kl"), logged(trainer, "ref/syncs"), logged(trainer, "kl")
    assert callback.num_syncs >= 2, ref_kl
    assert callback.sync_history == [s for s in syncs if syncs[s] > syncs.get(s - 1, 0)]
    assert syncs[max(syncs)] == callback.num_syncs
    # γ = 0: the moving average is the step's KL, the trainer's own `kl` metric.
    assert ref_kl == pytest.approx(kl)
    for step in callback.sync_history:
        assert ref_kl[step] > kappa
        if step + 1 in ref_kl:
            # On-policy, right after π_ref ← π_θ the next batch measures π_θ against itself.
            assert ref_kl[step + 1] < ref_kl[step]
            assert ref_kl[step + 1] == pytest.approx(0.0, abs=1e-6)
    # Between syncs the average stayed at or below κ.
    assert all(v <= kappa for s, v in ref_kl.items() if s not in callback.sync_history)


def test_huge_threshold_never_syncs(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, ref_model_sync_kl_threshold=1e9, max_steps=4)
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert trainer.ref_sync_callback.num_syncs == 0
    assert set(logged(trainer, "ref/syncs").values()) == {0.0}
    assert max(logged(trainer, "ref/kl").values()) > 0.0  # the policy moved away from the fixed reference
    for name, param in trainer.ref_model.named_parameters():
        torch.testing.assert_close(param, initial[name], rtol=0, atol=0)


def test_kl_sync_copies_policy_into_reference(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, ref_model_sync_kl_threshold=0.02)
    probe = SyncProbe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    assert probe.syncs
    for _, ref_before, policy, ref_after in probe.syncs:
        assert any(not torch.equal(ref_before[n], policy[n]) for n in policy)
        for name in policy:
            torch.testing.assert_close(ref_after[name], policy[name], rtol=0, atol=0)


def test_periodic_sync_mixes_with_alpha(tiny_model_dir, tmp_path):
    # TRL's `sync_ref_model` (TR-DPO): every `ref_model_sync_steps`, π_ref ← α·π_θ + (1 − α)·π_ref.
    alpha = 0.25
    trainer = make_trainer(
        tiny_model_dir, tmp_path, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=alpha, max_steps=5
    )
    callbacks = trainer.callback_handler.callbacks
    assert sum(isinstance(cb, (SyncRefModelCallback, RefModelSyncCallback)) for cb in callbacks) == 1
    probe = SyncProbe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    assert trainer.ref_sync_callback.sync_history == [2, 4]
    for _, ref_before, policy, ref_after in probe.syncs:
        for name in policy:
            torch.testing.assert_close(ref_after[name], alpha * policy[name] + (1 - alpha) * ref_before[name])


def test_syncs_wait_for_a_fresh_generation_batch(tiny_model_dir, tmp_path):
    # A generation batch is scored with π_ref once and trained on for 3 steps: a sync between them would mix two
    # references in one batch, so syncs happen only where the next step generates (after steps 3 and 6).
    trainer = make_trainer(tiny_model_dir, tmp_path, ref_model_sync_kl_threshold=1e-6, steps_per_generation=3)
    trainer.train()
    history = trainer.ref_sync_callback.sync_history
    ref_kl = logged(trainer, "ref/kl")
    assert history and all(step % 3 == 0 for step in history)
    assert any(ref_kl[s] > 1e-6 for s in ref_kl if s % 3 == 2)  # above κ mid-batch, yet no sync there


# ------------------------------------------------------------------------------------------------ PEFT
def test_lora_reference_is_a_ref_adapter_synced_to_the_trained_one(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, peft_config=lora_config(), ref_model_sync_kl_threshold=0.005)
    assert trainer.ref_model is None  # no second base model
    model = trainer.model
    assert REF_ADAPTER in model.peft_config and model.active_adapter == "default"
    ref, trained = reference_and_policy(trainer)
    assert ref and all(torch.equal(ref[n], trained[n]) for n in ref)  # a copy: B = 0, so it equals the base model
    assert not any(p.requires_grad for n, p in model.named_parameters() if f".{REF_ADAPTER}." in n)
    probe = SyncProbe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    trainable = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in trainable for n, p in model.named_parameters() if f".{REF_ADAPTER}." in n)
    assert probe.syncs, logged(trainer, "ref/kl")
    for _, ref_before, trained, ref_after in probe.syncs:
        assert any(not torch.equal(ref_before[n], trained[n]) for n in trained)
        for name in trained:
            torch.testing.assert_close(ref_after[name], trained[name], rtol=0, atol=0)
    # After a sync the reference log-probs come from the "ref" adapter: π_θ against itself, KL 0.
    ref_kl = logged(trainer, "ref/kl")
    after_sync = [ref_kl[s + 1] for s in trainer.ref_sync_callback.sync_history if s + 1 in ref_kl]
    assert after_sync and after_sync == pytest.approx([0.0] * len(after_sync), abs=1e-6)


# ------------------------------------------------------------------------------------------------ sampling anchor
def test_sampling_anchor_has_nothing_to_sync_and_says_so_once(tiny_model_dir, tmp_path, caplog):
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_anchor="sampling", max_steps=2)
    assert trainer.ref_sync_callback is None and trainer.ref_model is None
    with caplog.at_level(logging.WARNING, logger="rpg_trl.callbacks"):
        callback = RefModelSyncCallback(trainer, kl_threshold=1e-9)
        trainer.add_callback(callback)
        trainer.train()
    assert callback.num_syncs == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "rpg_trl.callbacks"]
    assert len(messages) == 1 and "nothing to sync" in messages[0] and "sampling" in messages[0]


# ------------------------------------------------------------------------------------------------ checkpoint / resume
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_after_sync_continues_like_an_uninterrupted_run(tiny_model_dir, tmp_path, lora):
    kwargs = {
        "estimator": "differentiable",  # its loss is not 0 on-policy (the REINFORCE surrogate's is): losses can differ
        "peft_config": lora_config() if lora else None,
        "ref_model_sync_kl_threshold": 0.005 if lora else 0.02,
        "ref_model_sync_kl_ema": 0.5,
        "max_steps": 6,
        "save_strategy": "steps",
        "save_steps": 3,
        # transformers then rebuilds the callback from its saved arguments; RPGTrainer must put its own back.
        "restore_callback_states_from_checkpoint": lora,
    }
    full_run = make_trainer(tiny_model_dir, tmp_path / "a", **kwargs)
    full_run.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    with open(checkpoint / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]["RefModelSyncCallback"]["attributes"]
    assert saved["num_syncs"] >= 1, "the test needs a sync before the checkpoint"
    assert (checkpoint / REFERENCE_FILE).is_file()

    resumed = make_trainer(tiny_model_dir, tmp_path / "b", **kwargs)
    restored = {}

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            cb = resumed.ref_sync_callback
            restored.update(cb.state()["attributes"], ref=reference_and_policy(resumed)[0])

    resumed.add_callback(Snapshot())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert {k: restored[k] for k in saved} == saved
    # The restored reference is the synced one, not the initial model.
    fresh = make_trainer(tiny_model_dir, tmp_path / "c", **kwargs)
    initial_ref = reference_and_policy(fresh)[0]
    assert any(not torch.equal(restored["ref"][n], initial_ref[n]) for n in initial_ref)

    # Same callback state and the same losses / KLs after the resume as without the interruption.
    assert resumed.ref_sync_callback.state() == full_run.ref_sync_callback.state()
    for key in ("loss", "grad_norm", "reward", "kl", "ref/kl", "ref/syncs"):
        expected, got = ({s: v for s, v in logged(t, key).items() if s > 3} for t in (full_run, resumed))
        assert len(expected) == 3 and got == pytest.approx(expected, rel=1e-5, abs=1e-7), key
    assert any(logged(full_run, "loss").values())
    ref_a, ref_b = reference_and_policy(full_run)[0], reference_and_policy(resumed)[0]
    for name in ref_a:
        torch.testing.assert_close(ref_b[name], ref_a[name])

    # A checkpoint that lost its reference file cannot silently resume against the initial model.
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    os.remove(broken / REFERENCE_FILE)
    with pytest.raises(FileNotFoundError, match=REFERENCE_FILE):
        make_trainer(tiny_model_dir, tmp_path / "d", **kwargs).train(resume_from_checkpoint=str(broken))


# ------------------------------------------------------------------------------------------------ two processes
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_sync_at_the_same_steps(tiny_model_dir, tmp_path):
    # torchrun, the launcher `accelerate launch --multi_gpu` wraps; accelerate then joins a gloo group on CPU.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        TWO_PROC_SCRIPT, tiny_model_dir, str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reports = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            reports.append(json.load(f))
    assert reports[0]["sync_history"], reports
    assert reports[0]["sync_history"] == reports[1]["sync_history"]
    assert reports[0]["state"] == reports[1]["state"]
    assert reports[0]["reference_checksum"] == reports[1]["reference_checksum"]
    # Both processes hold the policy in the reference after the last sync (same weights on both).
    assert reports[0]["policy_checksum_at_last_sync"] == reports[0]["reference_checksum"]
