"""Tests of `rpg_trl.ref_sync.RefModelSyncCallback`: iterative reference updates on a tiny local Qwen3 (CPU)."""

import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from transformers import TrainerCallback
from trl.distributed import DistributedBackend
from trl.trainer.callbacks import SyncRefModelCallback

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.ref_sync import RefModelSyncCallback
from rpg_trl.ref_sync.trigger import SyncTrigger
from rpg_trl.ref_sync.weights import REF_ADAPTER, REFERENCE_FILE, gather_reference, mix_parameters, restore_reference
from rpg_trl.reliability.checkpoints import COMMIT_RECORD
from rpg_trl.testing import build_char_tokenizer

from helpers.ports import free_port
from helpers.sync_two_proc import AllocatedBytes
from helpers.tiny_runs import PROMPTS, quiet_cpu_args


TWO_PROC_SCRIPT = os.path.join(os.path.dirname(__file__), "helpers", "sync_two_proc.py")


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


# ------------------------------------------------------------------------------------------------ trigger (no trainer)
def _step(trigger, step, micro_batches, at_generation_boundary=True):
    for kl_sum, num_tokens in micro_batches:
        trigger.observe(kl_sum, num_tokens)
    return trigger.end_step(step, at_generation_boundary)


def test_trigger_moving_average_and_threshold_by_hand():
    trigger = SyncTrigger(kl_threshold=0.3, kl_ema=0.5)
    # Step 1: token-weighted over micro-batches, (1.0 + 0.2) / (10 + 2) = 0.1; the first KL starts the average.
    assert _step(trigger, 1, [(1.0, 10), (0.2, 2)]) is None
    assert trigger.kl_moving_average == pytest.approx(0.1)
    # Step 2: KL 0.5, m = 0.5·0.1 + 0.5·0.5 = 0.3, not above κ = 0.3.
    assert _step(trigger, 2, [(5.0, 10)]) is None
    assert trigger.kl_moving_average == pytest.approx(0.3)
    # Micro-batches without tokens or with a non-finite KL are ignored; a step without KL keeps the average.
    assert _step(trigger, 3, [(7.0, 0), (float("nan"), 4), (float("inf"), 4)]) is None
    assert trigger.kl_moving_average == pytest.approx(0.3)
    # Step 4: KL 0.7, m = 0.5·0.3 + 0.5·0.7 = 0.5 > κ.
    reason = _step(trigger, 4, [(3.5, 5)])
    assert trigger.kl_moving_average == pytest.approx(0.5) and "κ" in reason
    trigger.record_sync(4)
    assert (trigger.num_syncs, trigger.last_sync_step, trigger.sync_history) == (1, 4, [4])
    assert trigger.kl_moving_average is None
    # After a sync the average restarts at the next step's KL (0.2), with no memory of 0.5.
    assert _step(trigger, 5, [(0.4, 2)]) is None
    assert trigger.kl_moving_average == pytest.approx(0.2)


def test_trigger_periodic_and_generation_boundary():
    trigger = SyncTrigger(sync_steps=2)  # no KL trigger: huge KLs do nothing
    due = []
    for step in range(1, 8):
        # Generation every 3 steps (steps 3, 6 end a generation batch), as with steps_per_generation=3.
        if _step(trigger, step, [(1e9, 1)], at_generation_boundary=step % 3 == 0):
            trigger.record_sync(step)
            due.append(step)
    assert due == [3, 6]  # 2 steps have passed at step 2, but the sync waits for the boundary at step 3
    # Away from a boundary, the average still follows the KL.
    trigger = SyncTrigger(kl_threshold=0.1, kl_ema=0.0)
    assert _step(trigger, 1, [(2.0, 1)], at_generation_boundary=False) is None
    assert trigger.kl_moving_average == 2.0
    assert _step(trigger, 2, [(0.5, 1)]) == "ref/kl = 0.5 > κ = 0.1"


def test_trigger_adopts_the_main_process_decision_and_average():
    sent = []

    def main_says(decision, average):
        def broadcast(values):
            sent.append(values)
            return [decision, average]

        return broadcast

    trigger = SyncTrigger(kl_threshold=0.1, kl_ema=0.0)
    assert _step(trigger, 1, [(5.0, 1)]) is not None  # this process would sync...
    assert trigger.agree(True, main_says(0.0, 0.05)) is False  # ...the main process does not: neither does it
    assert sent == [[1.0, 5.0]] and trigger.kl_moving_average == 0.05
    assert trigger.agree(False, main_says(1.0, math.nan)) is True
    assert trigger.kl_moving_average is None  # the main process had no average yet
    assert trigger.agree(True, None) is True  # one process: its own decision


def test_trigger_state_round_trip_and_checkpoint_format():
    trigger = SyncTrigger(kl_threshold=0.2, kl_ema=0.9, sync_steps=50)
    # The `attributes` of a `RefModelSyncCallback` entry of a `trainer_state.json` written before the split.
    stored = {"kl_moving_average": 0.0123, "last_sync_step": 40, "num_syncs": 3, "sync_history": [12, 30, 40]}
    trigger.load_attributes(json.loads(json.dumps(stored)))
    assert trigger.attributes() == stored
    assert trigger.arguments() == {"kl_threshold": 0.2, "kl_ema": 0.9, "sync_steps": 50}
    trigger.start(global_step=40)
    assert trigger.last_sync_step == 40
    trigger.start(global_step=0)  # a new `train()` from scratch
    assert trigger.last_sync_step == 0
    with pytest.raises(ValueError, match="kl_avg"):
        trigger.load_attributes({"kl_avg": 1.0})


def test_callback_state_is_the_checkpoint_format_and_rebuilds_without_a_trainer():
    stored = {
        "args": {"kl_threshold": 0.05, "kl_ema": 0.5, "sync_steps": None, "mixup_alpha": 1.0},
        "attributes": {"kl_moving_average": None, "last_sync_step": 6, "num_syncs": 2, "sync_history": [3, 6]},
    }
    # What transformers does with `restore_callback_states_from_checkpoint=True`: the arguments, then `setattr`.
    callback = RefModelSyncCallback.from_state(json.loads(json.dumps(stored)))
    assert callback.state() == stored
    assert (callback.trigger.num_syncs, callback.trigger.sync_history) == (2, [3, 6])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kl_threshold": 0.0}, "kl_threshold"),
        ({"kl_threshold": float("nan")}, "kl_threshold"),
        ({"kl_threshold": "0.1"}, "kl_threshold"),
        ({"kl_ema": 1.0}, "kl_ema"),
        ({"kl_ema": -0.1}, "kl_ema"),
        ({"sync_steps": 0}, "sync_steps"),
        ({"sync_steps": 2.5}, "sync_steps"),
    ],
)
def test_trigger_rejects_bad_settings_naming_them(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SyncTrigger(**kwargs)


# ------------------------------------------------------------------------------------------------ weights (no trainer)
class FakeZeRO3:
    """Stands in for `deepspeed` (installed as `sys.modules["deepspeed"]`): ZeRO-3 keeps each parameter partitioned
    (an empty `data`; here the values are kept aside) and `deepspeed.zero.GatheredParameters` gives the listed ones
    their full values for the duration of the block. As in DeepSpeed, changes made inside the block survive only with
    `modifier_rank` (the gathered values are a fresh buffer). Records the gathered bytes live at once."""

    def __init__(self, rank=0):
        self.rank, self._full = rank, {}
        self.live = self.peak = self.gathers = 0
        self.zero = types.SimpleNamespace(GatheredParameters=self.gathered_parameters)
        self.comm = types.SimpleNamespace(get_rank=lambda: self.rank)

    def partition(self, *modules):
        for module in modules:
            for param in module.parameters():
                param.ds_id, param.ds_shape = len(self._full), tuple(param.shape)
                self._full[param.ds_id] = param.data
                param.data = torch.empty(0, dtype=param.dtype)

    def full(self, module) -> dict:
        return {n: self._full[p.ds_id].clone() for n, p in module.named_parameters()}

    @contextlib.contextmanager
    def gathered_parameters(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        params = [params] if isinstance(params, torch.nn.Parameter) else [p for p in params if hasattr(p, "ds_id")]
        for param in params:
            param.data = self._full[param.ds_id].clone()
        nbytes = sum(p.numel() * p.element_size() for p in params)
        self.live += nbytes
        self.peak, self.gathers = max(self.peak, self.live), self.gathers + 1
        try:
            yield
        finally:
            for param in params:
                if modifier_rank is not None:
                    self._full[param.ds_id] = param.data
                param.data = torch.empty(0, dtype=param.dtype)
            self.live -= nbytes


def _backend(zero_stage):
    """`DistributedBackend` of an accelerator with DeepSpeed at `zero_stage` (0: none), no FSDP."""
    plugin = types.SimpleNamespace(zero_stage=zero_stage) if zero_stage else None
    return DistributedBackend(types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin)))


def _policy_and_reference(model_dir):
    from transformers import AutoModelForCausalLM

    policy, reference = (AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator))
    return policy, reference


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_zero3_sync_gathers_one_parameter_pair_at_a_time(tiny_model_dir, monkeypatch):
    policy, reference = _policy_and_reference(tiny_model_dir)
    alpha = 0.25
    expected = {
        n: alpha * p.detach() + (1 - alpha) * r.detach()
        for (n, p), r in zip(policy.named_parameters(), reference.parameters(), strict=True)
    }
    pair_bytes = [2 * _nbytes([p]) for p in policy.parameters()]
    model_bytes = _nbytes(policy.parameters())
    zero3 = FakeZeRO3()
    zero3.partition(policy, reference)
    monkeypatch.setitem(sys.modules, "deepspeed", zero3)

    mix_parameters(policy.parameters(), reference.parameters(), alpha, _backend(3))
    full = zero3.full(reference)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value)
    # The extra memory is the largest (policy, reference) pair, not the two models.
    assert zero3.gathers == len(pair_bytes) and zero3.peak == max(pair_bytes)
    assert zero3.peak < 0.25 * model_bytes, (zero3.peak, model_bytes)

    # TRL's helper on the same models gathers both whole models at once: what the pair-by-pair sync avoids.
    from trl.trainer import callbacks as trl_callbacks

    zero3_state = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    monkeypatch.setattr(trl_callbacks, "AcceleratorState", lambda: zero3_state)
    zero3.peak = 0
    SyncRefModelCallback.sync_target_model(policy, reference, alpha)
    assert zero3.peak == 2 * model_bytes


@pytest.mark.parametrize("is_main", [True, False], ids=["main", "other"])
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["ddp", "zero3"])
def test_saving_copies_the_reference_on_the_main_process_only(tiny_model_dir, monkeypatch, zero_stage, is_main):
    _, reference = _policy_and_reference(tiny_model_dir)
    values = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model_bytes, largest = _nbytes(values.values()), max(_nbytes([v]) for v in values.values())
    zero3 = FakeZeRO3()
    if zero_stage == 3:
        zero3.partition(reference)
        monkeypatch.setitem(sys.modules, "deepspeed", zero3)
    with AllocatedBytes() as created:
        tensors = gather_reference(reference, lambda n: True, _backend(zero_stage), is_main=is_main)
    gathered = model_bytes if zero_stage == 3 else 0  # ZeRO-3: each parameter gathered once, in a fresh buffer
    if zero_stage == 3:
        assert zero3.peak == largest  # every process takes part in the gathers, one parameter at a time
    if is_main:
        assert set(tensors) == set(values) and created.bytes == gathered + model_bytes
        for name, value in values.items():
            assert tensors[name].device.type == "cpu" and torch.equal(tensors[name], value)
    else:
        assert tensors == {} and created.bytes == gathered  # the gathers' own buffers, no copy kept


def test_sync_and_restore_without_zero3_create_no_copy(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    policy, reference = _policy_and_reference(tiny_model_dir)
    expected = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with AllocatedBytes() as created:
        mix_parameters(policy.parameters(), reference.parameters(), 1.0, _backend(0))
    assert created.bytes == 0  # in place
    for name, param in reference.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)

    path = str(tmp_path / REFERENCE_FILE)
    save_file({n: v.contiguous() for n, v in expected.items()}, path)
    _, fresh = _policy_and_reference(tiny_model_dir)
    restore_reference(fresh, lambda n: True, _backend(0), path)
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
    # A file that is not this reference is refused, naming what differs.
    save_file({"model.norm.weight": expected["model.norm.weight"].contiguous()}, path)
    with pytest.raises(ValueError, match="missing .*model.embed_tokens"):
        restore_reference(fresh, lambda n: True, _backend(0), path)


def test_zero3_restore_writes_each_gathered_parameter_on_rank_0(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    policy, reference = _policy_and_reference(tiny_model_dir)
    expected = {n: p.detach().clone().contiguous() for n, p in policy.named_parameters()}
    path = str(tmp_path / REFERENCE_FILE)
    save_file(expected, path)
    zero3 = FakeZeRO3()
    zero3.partition(reference)
    monkeypatch.setitem(sys.modules, "deepspeed", zero3)
    restore_reference(reference, lambda n: True, _backend(3), path)
    full = zero3.full(reference)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0)
    assert zero3.peak == max(_nbytes([v]) for v in expected.values())


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
    with caplog.at_level(logging.WARNING, logger="rpg_trl.ref_sync.callback"):
        callback = RefModelSyncCallback(trainer, kl_threshold=1e-9)
        trainer.add_callback(callback)
        trainer.train()
    assert callback.num_syncs == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "rpg_trl.ref_sync.callback"]
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
    # Restoring put the trainer's own callback back once (a second copy would run every event twice).
    assert sum(isinstance(cb, RefModelSyncCallback) for cb in resumed.callback_handler.callbacks) == 1
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
    with pytest.raises(ValueError, match=rf"incomplete.*{REFERENCE_FILE}"):  # its commit record lists the file
        make_trainer(tiny_model_dir, tmp_path / "d", **kwargs).train(resume_from_checkpoint=str(broken))
    os.remove(broken / COMMIT_RECORD)  # without a commit record (as a trainer that does not commit writes it)
    with pytest.raises(FileNotFoundError, match=REFERENCE_FILE):
        make_trainer(tiny_model_dir, tmp_path / "e", **kwargs).train(resume_from_checkpoint=str(broken))


# ------------------------------------------------------------------------------------------------ two processes


@pytest.mark.slow
def test_two_processes_sync_alike_save_on_the_main_process_only_and_resume_on_both(tiny_model_dir, tmp_path):
    # torchrun, the launcher `accelerate launch --multi_gpu` wraps; accelerate then joins a gloo group on CPU.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        TWO_PROC_SCRIPT, tiny_model_dir, str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reports = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            reports.append(json.load(f))
    main, other = reports
    assert main["sync_history"] and main["sync_history"][0] <= 3, "the test needs a sync before the checkpoint"
    assert main["sync_history"] == other["sync_history"]
    assert main["state"] == other["state"]
    assert main["reference_checksum"] == other["reference_checksum"]
    # Both processes hold the policy in the reference after the last sync (same weights on both).
    assert main["policy_checksum_at_last_sync"] == main["reference_checksum"]

    # Saving: the main process creates one CPU copy of the reference (what it writes), the other process none.
    reference_bytes = main["reference_bytes"]
    assert len(main["bytes_created_while_saving"]) == 2  # checkpoints 3 and 6
    for created in main["bytes_created_while_saving"]:
        assert reference_bytes <= created < 1.1 * reference_bytes
    assert all(created < 1e-3 * reference_bytes for created in other["bytes_created_while_saving"]), other
    assert (tmp_path / "a" / "checkpoint-3" / REFERENCE_FILE).is_file()

    # Resuming: every process restores the synced reference of the checkpoint (not the initial model), and the
    # resumed run ends where the uninterrupted one did.
    for report in reports:
        assert report["reference_checksum_at_checkpoint"] != report["initial_reference_checksum"]
        assert report["restored_reference_checksum"] == main["reference_checksum_at_checkpoint"]
        assert report["restored_state"]["attributes"]["sync_history"] == [s for s in main["sync_history"] if s <= 3]
        assert report["resumed_final_state"] == main["state"]
        assert report["resumed_final_reference_checksum"] == pytest.approx(main["reference_checksum"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (`pip install deepspeed`)")
def test_real_zero3_sync_gathers_one_pair_and_saves_on_rank_0(tmp_path):
    # DeepSpeed's CPU accelerator over gloo: the weight functions under real ZeRO-3 partitioning.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        TWO_PROC_SCRIPT, "zero3", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for rank in (0, 1):
        with open(tmp_path / f"zero3_rank{rank}.json") as f:
            report = json.load(f)
        n = report["num_parameters"]
        assert report["partitioned"] and report["mixed_as_expected"] and report["restored_as_saved"], report
        assert report["gathered_at_once_ours"] == 2  # one (policy, reference) pair
        assert report["gathered_at_once_trl"] == 2 * n  # TRL's helper: both models
        assert report["saved_equal_policy"] and len(report["saved"]) == (n if rank == 0 else 0), report
