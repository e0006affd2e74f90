"""Reliability of `RPGTrainer`: exact resume after a crash, hostile inputs, property tests.

The crash tests kill a training process with SIGKILL (`tests/helpers/crash_worker.py`) and resume it here; the
multi-process tests are in `tests/test_multiprocess.py`, the units of `rpg_trl/reliability/` (no trainer) in
`tests/test_reliability.py` and the configuration checks in `tests/test_config.py`. What these tests prove is summarised
in `docs/guarantees.md`.
"""

import errno
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from huggingface_hub import HfApi, RepoUrl
from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
from huggingface_hub.utils import filter_repo_objects
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.losses import AGGREGATIONS, DIAGNOSTIC_METRICS, DIVERGENCES, ESTIMATORS, rpg_loss
from rpg_trl.math_task.rewards import accuracy_reward, extract_answer, format_reward, get_soft_overlong_punishment
from rpg_trl.reliability import DiskFullError, RewardFunctionError
from rpg_trl.reliability.checkpoints import checkpoint_problems, is_complete
from rpg_trl.reliability.generation_state import GENERATION_STATE_FILE
from rpg_trl.testing import build_char_tokenizer, make_fixed_rollout

from helpers import crash_worker, save_faults
from helpers.crash_worker import MAX_STEPS
from helpers.tiny_runs import make_trainer as make_tiny_trainer
from helpers.tiny_runs import quiet_cpu_args, rpg_warnings


TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
COMPLETION_LENGTH = 6


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / COMPLETION_LENGTH for c in completions]


def make_args(tmp_path, **overrides):
    defaults = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=COMPLETION_LENGTH,
        max_steps=2,
        steps_per_generation=2,
        learning_rate=1e-2,
    )
    return RPGConfig(**quiet_cpu_args(tmp_path, **{**defaults, **overrides}))


def make_trainer(model_dir, tmp_path, reward=digit_reward, dataset=None, rollout="fixed", **overrides):
    """A tiny trainer; `rollout="fixed"` replaces sampling by `make_fixed_rollout` (same completions every run)."""
    if rollout == "fixed":
        rollout = make_fixed_rollout(COMPLETION_LENGTH, 2, len(TOKENIZER), seed=0)
    return RPGTrainer(
        model_dir,
        reward,
        args=make_args(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else crash_worker.PROMPTS,
        processing_class=TOKENIZER,
        rollout_func=rollout,
    )


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


# ==================================================================================================== crash and resume
#: Keys that describe the process rather than the training (timings, and the summary of the `train()` call).
NOT_TRAINING_STATE = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}


@pytest.fixture(scope="module")
def interrupted_runs(tiny_model_dir, tmp_path_factory):
    """scenario -> (uninterrupted run, folder of a run SIGKILLed at step 5, after the checkpoints of steps 2 and 4)."""
    cache = {}

    def get(scenario):
        if scenario not in cache:
            root = tmp_path_factory.mktemp(f"crash-{scenario}")
            full = crash_worker.run(tiny_model_dir, root / "full", scenario)
            cmd = [sys.executable, str(Path(crash_worker.__file__)), tiny_model_dir, str(root / "crashed"), scenario]
            cmd += ["--crash-at", "5", "--threads", str(torch.get_num_threads())]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
            cache[scenario] = (full, root / "crashed")
        return cache[scenario]

    return get


def _logs_after(history, step):
    return [{k: v for k, v in h.items() if k not in NOT_TRAINING_STATE} for h in history if h["step"] > step]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(crash_worker.SCENARIOS))
def test_sigkill_then_resume_continues_exactly_like_an_uninterrupted_run(
    interrupted_runs, tiny_model_dir, tmp_path, scenario
):
    full, crashed = interrupted_runs(scenario)
    run_dir = tmp_path / "run"
    shutil.copytree(crashed, run_dir)
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    checkpoint = run_dir / "checkpoint-4"
    # Step 4 is inside a generation cycle (generation every 3 steps): the buffered batch is in the checkpoint.
    assert torch.load(checkpoint / GENERATION_STATE_FILE, weights_only=True)["buffered_inputs"] is not None
    if scenario in ("reference-sync", "kl-budget"):  # the reference synced at step 3 is in the checkpoint too
        assert (checkpoint / "rpg_reference.safetensors").is_file()

    resumed = crash_worker.run(tiny_model_dir, run_dir, scenario, resume=True)

    after_full, after_resumed = _logs_after(full["log_history"], 4), _logs_after(resumed["log_history"], 4)
    assert [h["step"] for h in after_resumed] == [5, 6, 7, 7]  # 3 steps logged, then the summary of train()
    assert after_resumed == after_full  # losses, rewards, learning rates, grad norms, KL, clip fractions: all equal
    assert any("reward" in h for h in after_resumed) and all(math.isfinite(h["loss"]) for h in after_resumed[:3])
    assert resumed["policy"] == full["policy"]  # bit-identical final weights
    assert resumed["reference"] == full["reference"]
    assert resumed["syncs"] == full["syncs"]
    if scenario in ("reference-sync", "kl-budget"):
        assert full["syncs"] == [3, 6] and all(h["kl"] > 0 for h in after_resumed[:3])
    if scenario == "kl-budget":  # β moved, and the checkpoint holds the β that step 5 used
        betas = [h["beta"] for h in full["log_history"] if "beta" in h]
        assert len(set(betas)) == len(betas) == MAX_STEPS and betas[0] == 0.05
        state = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
        assert state["AdaptiveKLCallback"]["attributes"]["beta"] == betas[4]


@pytest.mark.slow
def test_resume_without_the_saved_generation_state_warns_and_is_not_exact(
    interrupted_runs, tiny_model_dir, tmp_path, caplog
):
    """What TRL alone does (the buffered batch is lost), shown by removing RPG's files: the resumed run regenerates
    at once, warns, and no longer matches the uninterrupted run."""
    full, crashed = interrupted_runs("sampling")
    run_dir = tmp_path / "run"
    shutil.copytree(crashed, run_dir)
    (run_dir / "checkpoint-4" / GENERATION_STATE_FILE).unlink()
    (run_dir / "checkpoint-4" / "rpg_checkpoint.json").unlink()  # as TRL writes it: without RPG's commit record
    with caplog.at_level(logging.WARNING):
        resumed = crash_worker.run(tiny_model_dir, run_dir, "sampling", resume=True)
    assert any("inside a generation cycle" in m and GENERATION_STATE_FILE in m for m in rpg_warnings(caplog))
    assert _logs_after(resumed["log_history"], 4) != _logs_after(full["log_history"], 4)
    assert resumed["policy"] != full["policy"]


# =========================================================================================== a crash inside a save
def _crash_in_save(model_dir, run_dir, scenario, kill):
    """Run `tests/helpers/crash_worker.py` until it kills itself where `kill` (`POINT:STEP`) says."""
    cmd = [sys.executable, str(Path(crash_worker.__file__)), model_dir, str(run_dir), scenario]
    cmd += ["--threads", str(torch.get_num_threads())]
    env = dict(os.environ, **{save_faults.ENV: kill})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, scenario",
    [
        ("weights", "sampling"),
        ("optimizer", "sampling"),
        ("rng", "sampling"),
        ("trainer-state", "sampling"),
        ("reference", "reference-sync"),
    ],
)
def test_a_run_killed_inside_a_save_resumes_exactly_from_the_last_complete_checkpoint(
    interrupted_runs, tiny_model_dir, tmp_path, caplog, point, scenario
):
    """SIGKILL inside the save of checkpoint-4, after the weights, the optimizer, the RNG state (before RPG's
    generation state), `trainer_state.json` (before the commit) or RPG's synced reference (its first file): `transformers` alone would resume from the half-written
    checkpoint-4; RPGTrainer skips it, naming it and what it lacks, and continues from checkpoint-2 exactly like the
    uninterrupted run."""
    full, _ = interrupted_runs(scenario)
    run_dir = tmp_path / "run"
    _crash_in_save(tiny_model_dir, run_dir, scenario, f"{point}:4")
    checkpoint = run_dir / "checkpoint-4"
    assert get_last_checkpoint(str(run_dir)) == str(checkpoint)  # what transformers would resume from
    lacks = checkpoint_problems(str(checkpoint))
    assert is_complete(str(run_dir / "checkpoint-2")) and lacks
    if point != "trainer-state":
        assert any("trainer_state.json" in item for item in lacks), lacks
    if point == "reference":  # the first file of an RPG save, after the record that says the folder is being written
        assert sorted(p.name for p in checkpoint.iterdir()) == ["rpg_checkpoint.json", "rpg_reference.safetensors"]
    if point == "weights":  # a checkpoint named explicitly is refused, with what it lacks
        with pytest.raises(ValueError, match=r"checkpoint-4: the checkpoint is incomplete.*trainer_state\.json"):
            crash_worker.run(tiny_model_dir, run_dir, scenario, resume=str(checkpoint))

    (checkpoint / "rng_state_1.pth").write_bytes(b"left by a 2-process save")  # which the new save does not write

    with caplog.at_level(logging.WARNING):
        resumed = crash_worker.run(tiny_model_dir, run_dir, scenario, resume=True)
    (skipped,) = [m for m in rpg_warnings(caplog) if "incomplete checkpoint" in m]
    assert str(checkpoint) in skipped and lacks[0] in skipped
    after_full, after_resumed = _logs_after(full["log_history"], 2), _logs_after(resumed["log_history"], 2)
    assert [h["step"] for h in after_resumed] == [3, 4, 5, 6, 7, 7]
    assert after_resumed == after_full
    assert resumed["policy"] == full["policy"] and resumed["reference"] == full["reference"]
    assert resumed["syncs"] == full["syncs"]
    # Written again over the incomplete folder, emptied first: the commit lists what an uninterrupted save writes.
    assert is_complete(str(checkpoint)) and not (checkpoint / "rng_state_1.pth").exists()
    uninterrupted = interrupted_runs(scenario)[1].parent / "full" / "checkpoint-4"
    record = json.loads((checkpoint / "rpg_checkpoint.json").read_text())
    assert sorted(record["files"]) == sorted(
        p.name for p in uninterrupted.iterdir() if p.name != "rpg_checkpoint.json"
    )
    (cleared,) = [m for m in rpg_warnings(caplog) if "removed what an earlier save left there" in m]
    assert str(checkpoint) in cleared and "rng_state_1.pth" in cleared


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_named_and_the_previous_checkpoint_stays_complete(
    interrupted_runs, tiny_model_dir, tmp_path, monkeypatch
):
    """`torch.save` fails with ENOSPC on checkpoint-4's optimizer file (a stand-in for a full disk), with
    `save_total_limit=1`: the run stops with a `DiskFullError` that says the disk is full, names the file and the
    intact checkpoint-2, which rotation did not delete; the resumed run equals the uninterrupted one."""
    full, _ = interrupted_runs("sampling")
    run_dir = tmp_path / "run"
    optimizer_file = str(run_dir / "checkpoint-4" / "optimizer.pt")
    real_save = torch.save

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        if str(f) == optimizer_file:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    with pytest.raises(DiskFullError) as caught:
        crash_worker.run(tiny_model_dir, run_dir, "sampling", save_total_limit=1)
    monkeypatch.undo()
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == optimizer_file
    assert "The disk is full" in message and optimizer_file in message
    assert f"the newest complete checkpoint, {run_dir / 'checkpoint-2'}, is intact" in message
    assert is_complete(str(run_dir / "checkpoint-2")) and not is_complete(str(run_dir / "checkpoint-4"))

    resumed = crash_worker.run(tiny_model_dir, run_dir, "sampling", resume=True, save_total_limit=1)
    assert _logs_after(resumed["log_history"], 2) == _logs_after(full["log_history"], 2)
    assert resumed["policy"] == full["policy"]
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-7"]  # the final save, rotated after it


class LocalHub:
    """Stands in for the Hub at `huggingface_hub.HfApi` (no network): `create_repo` returns the repository's URL;
    `upload_folder` copies, at the moment of the call, the files it would send (its patterns applied as
    `huggingface_hub` applies them) into `root/{path_in_repo}`, over what is there (a Hub commit adds and replaces
    files), and keeps a copy of that folder as it stands after each upload (`snapshots`)."""

    def __init__(self, root: Path):
        self.root, self.snapshots = root, []

    def install(self, monkeypatch):
        hub = self

        def create_repo(api, repo_id, **kwargs):
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, *, folder_path, path_in_repo=None, ignore_patterns=None, run_as_future=False, **kw):
            hub.upload(Path(folder_path), path_in_repo or "", list(ignore_patterns or []))
            if not run_as_future:
                return None
            done = Future()
            done.set_result(None)
            return done

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)

    def upload(self, folder: Path, path_in_repo: str, ignore_patterns: list[str]):
        files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
        target = self.root / path_in_repo
        for name in filter_repo_objects(files, ignore_patterns=ignore_patterns + DEFAULT_IGNORE_PATTERNS):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target / name)
        if path_in_repo:
            snapshot = self.root.parent / f"snapshot-{len(self.snapshots)}-{path_in_repo}"
            shutil.copytree(target, snapshot)
            self.snapshots.append(snapshot)


@pytest.mark.slow
def test_a_checkpoint_pushed_to_the_hub_is_the_committed_one_and_resumes_exactly(
    interrupted_runs, tiny_model_dir, tmp_path, monkeypatch
):
    """`push_to_hub=True`, `hub_strategy="checkpoint"`: `transformers` uploads each checkpoint from inside its save,
    before RPG's commit record says it is complete (a resume from that copy is refused). RPGTrainer pushes after the
    commit: every `last-checkpoint` the Hub receives (copied at the `huggingface_hub` call) is complete, and a run
    resumed from the one pushed at step 4 (inside a generation cycle) equals the uninterrupted run."""
    full, _ = interrupted_runs("sampling")
    hub = LocalHub(tmp_path / "hub" / "repo")
    hub.install(monkeypatch)
    pushed = crash_worker.run(
        tiny_model_dir, tmp_path / "run", "sampling", push_to_hub=True, hub_strategy="checkpoint", hub_model_id="rpg/t"
    )
    monkeypatch.undo()
    assert _logs_after(pushed["log_history"], 0) == _logs_after(full["log_history"], 0)
    assert [s.name for s in hub.snapshots] == [f"snapshot-{i}-last-checkpoint" for i in range(4)]  # steps 2, 4, 6, 7
    for snapshot, step in zip(hub.snapshots, (2, 4, 6, 7)):
        record = json.loads((snapshot / "rpg_checkpoint.json").read_text())
        assert record["complete"] and record["step"] == step and checkpoint_problems(str(snapshot)) == []
        committed = tmp_path / "run" / f"checkpoint-{step}"
        assert sorted(record["files"]) == sorted(
            str(p.relative_to(committed)) for p in committed.rglob("*") if p.name != "rpg_checkpoint.json"
        )
    assert (hub.root / "model.safetensors").is_file()  # the model itself, pushed beside it

    resumed = crash_worker.run(tiny_model_dir, tmp_path / "resumed", "sampling", resume=str(hub.snapshots[1]))
    assert _logs_after(resumed["log_history"], 4) == _logs_after(full["log_history"], 4)
    assert resumed["policy"] == full["policy"]


def test_a_checkpoint_of_trls_grpo_trainer_still_resumes(tiny_model_dir, tmp_path, caplog):
    """A checkpoint without a commit record (TRL's GRPOTrainer) counts when `transformers` finished it: RPGTrainer
    resumes from it, without a warning."""
    grpo = make_tiny_trainer(
        tiny_model_dir, tmp_path, GRPOTrainer, GRPOConfig, save_strategy="steps", save_steps=2, max_steps=2
    )
    grpo.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert not (checkpoint / "rpg_checkpoint.json").exists() and is_complete(str(checkpoint))
    rpg = make_tiny_trainer(tiny_model_dir, tmp_path, save_strategy="no", max_steps=3)
    with caplog.at_level(logging.WARNING):
        rpg.train(resume_from_checkpoint=True)
    assert [h["step"] for h in rpg.state.log_history if "loss" in h] == [1, 2, 3]  # 1-2 from GRPOTrainer's state
    assert not [m for m in rpg_warnings(caplog) if "checkpoint" in m]


def test_a_grpo_trainer_checkpoint_without_its_optimizer_or_an_rng_file_is_refused(tiny_model_dir, tmp_path, caplog):
    """Without a commit record, what `transformers` writes is checked as far as the folder tells: a `GRPOTrainer`
    checkpoint whose optimizer state is missing, or whose RNG files stop at `rng_state_0.pth` (one process writes
    `rng_state.pth`: a 2-process save whose rank 1 did not finish), is refused when named (transformers would resume
    with a fresh optimizer or RNG, silently) and skipped with a warning by `resume_from_checkpoint=True`."""
    grpo = make_tiny_trainer(
        tiny_model_dir, tmp_path / "grpo", GRPOTrainer, GRPOConfig, save_strategy="steps", save_steps=1, max_steps=2
    )
    grpo.train()
    rpg = make_tiny_trainer(tiny_model_dir, tmp_path / "grpo", save_strategy="no", max_steps=3)
    no_optimizer = tmp_path / "grpo" / "checkpoint-2"
    (no_optimizer / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-2: .*or it holds the model only .* lacks the optimizer state"):
        rpg.train(resume_from_checkpoint=str(no_optimizer))
    one_rank = tmp_path / "grpo" / "checkpoint-1"
    (one_rank / "rng_state.pth").rename(one_rank / "rng_state_0.pth")
    with pytest.raises(ValueError, match=r"checkpoint-1: the checkpoint is incomplete .* lacks rng_state_1\.pth\."):
        rpg.train(resume_from_checkpoint=str(one_rank))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="No complete checkpoint found"):
        rpg.train(resume_from_checkpoint=True)
    skipped = [m for m in rpg_warnings(caplog) if "Skipping the incomplete checkpoint" in m]
    assert [m.split(":")[0].split()[-1] for m in skipped] == [str(no_optimizer), str(one_rank)]
    assert rpg.state.global_step == 0  # nothing was trained


def _flip_bytes(path, count=64):
    """Invert `count` bytes in the middle of the file at `path` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 - count // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


class _StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def test_a_grpo_trainer_checkpoint_with_its_trainer_state_cut_short_falls_back_to_the_one_before(
    tiny_model_dir, tmp_path, caplog
):
    """A `GRPOTrainer` checkpoint (no commit record) whose `trainer_state.json` was cut short by a kill in the middle
    of its write: `transformers` would take it and crash (`JSONDecodeError`); `resume_from_checkpoint=True` skips it
    with a warning naming the file and trains from the checkpoint before it; named explicitly, it is refused naming
    the file."""
    grpo = make_tiny_trainer(
        tiny_model_dir, tmp_path, GRPOTrainer, GRPOConfig, save_strategy="steps", save_steps=1, max_steps=2
    )
    grpo.train()
    state = tmp_path / "checkpoint-2" / "trainer_state.json"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")  # what transformers would take
    with pytest.raises(json.JSONDecodeError):
        json.loads(state.read_text())
    rpg = make_tiny_trainer(tiny_model_dir, tmp_path, save_strategy="no", max_steps=3)
    with pytest.raises(ValueError, match=r"checkpoint-2: the checkpoint is incomplete .* lacks a readable trainer_st"):
        rpg.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    counter = _StepCounter()
    rpg.add_callback(counter)
    with caplog.at_level(logging.WARNING):
        rpg.train(resume_from_checkpoint=True)
    assert counter.steps == [2, 3]  # from checkpoint-1
    (skipped,) = [m for m in rpg_warnings(caplog) if "Skipping" in m]
    assert skipped.startswith(f"Skipping the incomplete checkpoint {tmp_path / 'checkpoint-2'}: it lacks a readable ")
    assert "trainer_state.json (it does not parse, JSONDecodeError" in skipped


def test_a_committed_checkpoint_with_flipped_bytes_in_its_weights_or_optimizer_does_not_count(
    tiny_model_dir, tmp_path, caplog
):
    """RPGTrainer commits each checkpoint with the sha256 of every file (equal to `hashlib`'s over the files as
    saved). 64 bytes flipped in checkpoint-3's `optimizer.pt` and in checkpoint-2's `model.safetensors`, sizes
    unchanged (a size check passes both, and `transformers` loads them silently): `resume_from_checkpoint=True` skips
    both, with a warning naming each file, and trains from checkpoint-1; checkpoint-3 named explicitly is refused as
    damaged, naming `optimizer.pt`."""
    rpg = make_tiny_trainer(tiny_model_dir, tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    rpg.train()
    for step in (1, 2, 3):
        folder = tmp_path / f"checkpoint-{step}"
        record = json.loads((folder / "rpg_checkpoint.json").read_text())
        on_disk = {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*")
            if p.is_file() and p.name != "rpg_checkpoint.json"
        }
        assert record["digest"] == "sha256" and record["digests"] == on_disk
    optimizer, weights = tmp_path / "checkpoint-3" / "optimizer.pt", tmp_path / "checkpoint-2" / "model.safetensors"
    sizes = optimizer.stat().st_size, weights.stat().st_size
    _flip_bytes(optimizer)
    _flip_bytes(weights)
    assert (optimizer.stat().st_size, weights.stat().st_size) == sizes
    assert is_complete(str(tmp_path / "checkpoint-3"), verify_digests=False)  # what a size check alone sees
    changed = "as committed (the same size, another content: its sha256 digest differs from the commit's)"
    assert checkpoint_problems(str(tmp_path / "checkpoint-3")) == [f"optimizer.pt {changed}"]
    assert checkpoint_problems(str(tmp_path / "checkpoint-2")) == [f"model.safetensors {changed}"]

    resumed = make_tiny_trainer(tiny_model_dir, tmp_path, save_strategy="no", max_steps=4)
    with pytest.raises(
        ValueError, match=r"checkpoint-3: the checkpoint is incomplete, damaged after .* lacks optimizer\.pt as comm"
    ):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    counter = _StepCounter()
    resumed.add_callback(counter)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert counter.steps == [2, 3, 4]  # from checkpoint-1
    assert [m for m in rpg_warnings(caplog) if "Skipping" in m] == [
        f"Skipping the incomplete checkpoint {tmp_path / 'checkpoint-3'}: it lacks optimizer.pt {changed}.",
        f"Skipping the incomplete checkpoint {tmp_path / 'checkpoint-2'}: it lacks model.safetensors {changed}.",
    ]


# ==================================================================================================== hostile rewards
def hostile_reward(completions, **kwargs):
    """Every kind of bad value: None, NaN, ±inf and a float32 overflow; the second group has no finite value at all."""
    bad = [None, math.nan, math.inf, -math.inf, 1e39, np.float64("nan"), torch.tensor(math.inf), None]
    return [bad[i % 8] if i % 4 in (1, 3) or 4 <= i < 8 else float(len(c)) / 10 for i, c in enumerate(completions)]


def none_reward(completions, **kwargs):
    """`hostile_reward` with every bad value replaced by None (TRL's "no reward for this sample")."""
    return [None if i % 4 in (1, 3) or 4 <= i < 8 else float(len(c)) / 10 for i, c in enumerate(completions)]


def _shared_metrics(logs):
    """The logged training metrics, without those named after the first reward function (named differently)."""
    skip = ("hostile_reward", "none_reward")
    keep = lambda k: k not in NOT_TRAINING_STATE and not any(name in k for name in skip)  # noqa: E731
    return [{k: v for k, v in h.items() if keep(k)} for h in logs]


def test_nan_inf_and_overflowing_rewards_count_as_none_and_the_loss_stays_finite(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        hostile = make_trainer(tiny_model_dir, tmp_path / "h", reward=[hostile_reward, digit_reward], beta=0.05)
        hostile.train()
    reference = make_trainer(tiny_model_dir, tmp_path / "n", reward=[none_reward, digit_reward], beta=0.05)
    reference.train()

    logs = train_logs(hostile)
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    assert all(torch.isfinite(p).all() for p in hostile.model.parameters())
    assert math.isfinite(logs[0]["rewards/hostile_reward/mean"]) and math.isfinite(logs[0]["reward"])
    # NaN, inf and overflow are exactly None: the run is the run with None in their place.
    assert _shared_metrics(logs) == _shared_metrics(train_logs(reference))
    assert logs[0]["rewards/hostile_reward/mean"] == train_logs(reference)[0]["rewards/none_reward/mean"]
    messages = [m for m in rpg_warnings(caplog) if "non-finite" in m]
    assert len(messages) == 1 and "'hostile_reward'" in messages[0]  # named, and once (rate-limited)


def test_a_group_without_any_finite_reward_gets_zero_advantage(tiny_model_dir, tmp_path):
    def all_inf(completions, **kwargs):
        return [math.inf] * len(completions)

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=all_inf, max_steps=1, steps_per_generation=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (log,) = train_logs(trainer)
    assert log["loss"] == 0.0 and log["reward"] is None  # no reward at all: nothing to learn, nothing logged
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_a_raising_reward_function_is_named_with_the_failing_sample(tiny_model_dir, tmp_path):
    def fragile_reward(prompts, completions, **kwargs):
        return [1.0 / (prompt != "2+2=") for prompt in prompts]  # ZeroDivisionError on the prompt "2+2="

    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    trainer = make_trainer(
        tiny_model_dir, tmp_path, reward=fragile_reward, dataset=dataset, shuffle_dataset=False, steps_per_generation=1
    )
    match = r"'fragile_reward' raised ZeroDivisionError.* on sample 4 of 8"
    with pytest.raises(RewardFunctionError, match=match) as e:
        trainer.train()
    assert "Prompt: '2+2='" in str(e.value) and isinstance(e.value.__cause__, ZeroDivisionError)


# ==================================================================================================== hostile data
def test_empty_and_length_capped_completions_train_with_finite_loss(tiny_model_dir, tmp_path):
    """Completions that are only EOS (empty text) and completions cut at max_completion_length (no EOS)."""
    fixed = make_fixed_rollout(COMPLETION_LENGTH, 2, len(TOKENIZER), seed=0)
    seen = []

    def rollout(prompts, trainer):
        output = fixed(prompts, trainer)
        output["completion_ids"] = [[EOS] if i % 2 == 0 else ids for i, ids in enumerate(output["completion_ids"])]
        return output

    def length_reward(completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=length_reward, rollout=rollout, beta=0.05)
    trainer.train()
    logs = train_logs(trainer)
    assert "" in seen and any(len(c) == COMPLETION_LENGTH for c in seen)
    assert logs[0]["completions/clipped_ratio"] == 0.5 and logs[0]["completions/min_length"] == 1
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["entropy"]) for h in logs)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_masking_every_truncated_completion_gives_a_zero_loss_not_nan(tiny_model_dir, tmp_path):
    """`mask_truncated_completions=True` and every completion at max_completion_length: no token to learn from."""
    trainer = make_trainer(tiny_model_dir, tmp_path, mask_truncated_completions=True, beta=0.05)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = train_logs(trainer)
    assert [h["loss"] for h in logs] == [0.0, 0.0] and logs[0]["completions/clipped_ratio"] == 1.0
    assert all(h["kl"] == 0.0 and h["importance_weight/max"] is None for h in logs)  # no token: no weight to report
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_prompts_longer_than_the_model_context_are_kept_whole_with_a_warning(tiny_model_dir, tmp_path, caplog):
    """TRL 1.16 has no `max_prompt_length`: prompts are never truncated. RPG warns once when a prompt plus
    `max_completion_length` exceeds the model's `max_position_embeddings`."""
    assert not hasattr(RPGConfig, "max_prompt_length")
    context = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    long_prompt = "1+2=" * (context // 4 + 11)  # one token per character: 44 tokens more than the context
    dataset = Dataset.from_dict({"prompt": [long_prompt, "3+4="]})
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tiny_model_dir, tmp_path, dataset=dataset, rollout=None, steps_per_generation=1)
        trainer.train()
    messages = [m for m in rpg_warnings(caplog) if "max_position_embeddings" in m]
    assert len(messages) == 1 and f"A prompt of {len(long_prompt)} tokens" in messages[0]  # reached the model whole
    assert all(math.isfinite(h["loss"]) for h in train_logs(trainer))


@pytest.mark.parametrize("which", ["train_dataset", "eval_dataset"])
def test_a_dataset_without_a_prompt_column_is_refused_at_construction(tiny_model_dir, tmp_path, which):
    bad = Dataset.from_dict({"question": ["1+1="] * 8, "answer": ["2"] * 8})
    datasets = {"train_dataset": crash_worker.PROMPTS, which: bad}
    with pytest.raises(ValueError, match=r"has no 'prompt' column \(its columns: \['question', 'answer'\]\)"):
        RPGTrainer(tiny_model_dir, digit_reward, args=make_args(tmp_path), processing_class=TOKENIZER, **datasets)


# ==================================================================================================== diverged policy
def _diverged_inputs(trainer, batch=8, length=6, log_ratio=60.0):
    """A scored batch whose old log-probs are ±`log_ratio` away from the current policy's."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, len(TOKENIZER), (batch, 4), generator=g)
    completion_ids = torch.randint(2, len(TOKENIZER), (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.ones(batch, 4 + length), length
        )[0]
    sign = torch.where(torch.rand(batch, length, generator=g) > 0.5, 1.0, -1.0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -1.0] * (batch // 2)),
        "old_per_token_logps": logps - sign * log_ratio,
        "ref_per_token_logps": logps + sign * log_ratio,
        "num_items_in_batch": mask.sum(),
    }


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_diverged_policy_gives_a_finite_loss_logged_clip_fractions_and_a_rate_limited_warning(
    tiny_model_dir, tmp_path, caplog, estimator
):
    trainer = make_trainer(tiny_model_dir, tmp_path, estimator=estimator, kl_anchor="reference", beta=0.1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _diverged_inputs(trainer)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/high_mean"][-1] > 0 and metrics["clip_ratio/low_mean"][-1] > 0
    assert metrics["clip_ratio/dual_mean"][-1] > 0 and metrics["importance_weight/max"][-1] > 1e8

    with caplog.at_level(logging.WARNING):
        trainer.log({})  # the first logging interval with exploded weights warns...
        trainer._compute_loss(trainer.model, inputs)
        trainer.state.global_step += 99
        trainer.log({})  # ... the next ones within 100 steps do not ...
        trainer._compute_loss(trainer.model, inputs)
        trainer.state.global_step += 1
        trainer.log({})  # ... and 100 steps later it warns again.
    messages = [m for m in rpg_warnings(caplog) if "importance weight" in m]
    assert len(messages) == 2 and "importance_weight_warning_threshold = 100" in messages[0]
    logged = trainer.state.log_history[0]
    assert logged["clip_ratio/high_mean"] > 0 and math.isfinite(logged["kl"])


def test_the_importance_weight_warning_can_be_switched_off(tiny_model_dir, tmp_path, caplog):
    trainer = make_trainer(tiny_model_dir, tmp_path, importance_weight_warning_threshold=None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, _diverged_inputs(trainer))
    with caplog.at_level(logging.WARNING):
        trainer.log({})
    assert not [m for m in rpg_warnings(caplog) if "importance weight" in m]


# ==================================================================================================== property tests
@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.0, 0.5, 60.0, 1e4]),
    divergence=st.sampled_from(DIVERGENCES),
    estimator=st.sampled_from(ESTIMATORS),
    level=st.sampled_from(["token", "sequence"]),
    kl_importance_weight=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    aggregation=st.sampled_from(AGGREGATIONS),
    token_advantages=st.booleans(),
)
def test_property_loss_is_finite_with_sequence_weights_token_advantages_and_garbage_padding(
    b, t, seed, scale, divergence, estimator, level, kl_importance_weight, dtype, aggregation, token_advantages
):
    """Coverage beyond tests/test_losses.py: sequence-level weights, (B, T) advantages, float64, the uncorrected KL,
    and NaN/inf in masked positions of every input."""
    if not kl_importance_weight:
        divergence = "urkl"
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    old = -torch.rand(b, t, generator=g) * 5
    logps = old + (torch.rand(b, t, generator=g) * 2 - 1) * scale
    ref = old + (torch.rand(b, t, generator=g) * 2 - 1) * scale
    adv = torch.randn(b, t, generator=g) if token_advantages else torch.randn(b, generator=g)
    garbage = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (b, t), generator=g)]
    logps, old, ref = (torch.where(mask > 0, x, garbage) for x in (logps, old, ref))
    if token_advantages:
        adv = torch.where(mask > 0, adv, garbage)
    logps = logps.to(dtype).requires_grad_(True)
    loss, metrics = rpg_loss(
        logps,
        old.to(dtype),
        adv,
        mask,
        ref_logps=ref.to(dtype),
        divergence=divergence,
        estimator=estimator,
        beta=0.1,
        aggregation=aggregation,
        importance_sampling_level=level,
        kl_importance_weight=kl_importance_weight,
    )
    loss.backward()
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    assert (logps.grad[mask == 0] == 0).all()
    # With no active token the extremes and the diagnostics of the whole-completion weights have nothing to describe:
    # NaN by design (rpg_trl.losses.DIAGNOSTIC_METRICS); every other metric is finite.
    undefined = {k for k in metrics if "/m" in k or k in DIAGNOSTIC_METRICS} if mask.sum() == 0 else set()
    assert all(torch.isfinite(v) for k, v in metrics.items() if k not in undefined)
    assert all(torch.isnan(metrics[k]) for k in DIAGNOSTIC_METRICS if k in undefined)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    num_items=st.floats(0.5, 1e4),
    divergence=st.sampled_from(DIVERGENCES),
    estimator=st.sampled_from(ESTIMATORS),
    aggregation=st.sampled_from(AGGREGATIONS),
)
def test_property_num_items_only_rescales_token_mean_and_rows_can_be_permuted(
    b, t, seed, num_items, divergence, estimator, aggregation
):
    """`num_items` (the trainer's global token count) replaces mask.sum() in token-mean; every aggregation is invariant
    to the order of the sequences in the batch."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logps = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    kw = dict(divergence=divergence, estimator=estimator, beta=0.1, aggregation=aggregation)
    loss, _ = rpg_loss(logps, old, adv, mask, **kw)
    perm = torch.randperm(b, generator=g)
    permuted, _ = rpg_loss(logps[perm], old[perm], adv[perm], mask[perm], **kw)
    assert permuted.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    if aggregation == "token-mean":
        rescaled, _ = rpg_loss(logps, old, adv, mask, num_items=num_items, **kw)
        expected = loss.item() * max(mask.sum().item(), 1.0) / max(num_items, 1.0)
        assert rescaled.item() == pytest.approx(expected, rel=1e-10, abs=1e-15)
        as_tensor, _ = rpg_loss(logps, old, adv, mask, num_items=torch.tensor(num_items), **kw)
        assert as_tensor.item() == pytest.approx(rescaled.item(), rel=1e-6)


_UNICODE = st.text(alphabet=st.characters(exclude_categories=()), max_size=200)  # surrogates and controls included
_CONTENT = st.one_of(
    _UNICODE,
    st.none(),
    st.integers(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _UNICODE}), max_size=3),
    st.lists(st.dictionaries(st.text(max_size=5), _UNICODE, max_size=2), max_size=2),
)
_ROLES = st.sampled_from(["assistant", "user", "system", "tool", ""])
_MESSAGE = st.fixed_dictionaries({"role": _ROLES, "content": _CONTENT})
_COMPLETION = st.one_of(
    _UNICODE,
    st.lists(_MESSAGE, max_size=4),
    _MESSAGE,
    st.none(),
    st.integers(),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=_COMPLETION, gold=st.one_of(st.sampled_from(["42", r"\frac{1}{2}", "}{"]), _UNICODE, st.none()))
def test_property_reward_parsers_never_raise_on_any_completion(completion, gold):
    """Random unicode (surrogates and control characters included), conversational messages with odd roles and
    contents, and values that are not completions at all."""
    (accuracy,) = accuracy_reward([completion], [gold])
    assert accuracy in (0.0, 1.0, None)
    assert format_reward([completion]) in ([0.0], [1.0])
    if isinstance(completion, str):
        answer = extract_answer(completion)
        assert answer is None or (isinstance(answer, str) and answer)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    max_len=st.integers(1, 4096),
    cache_fraction=st.floats(0.0, 1.0),
)
def test_property_soft_overlong_punishment_is_in_minus_one_zero(lengths, max_len, cache_fraction):
    reward = get_soft_overlong_punishment(max_len, int(cache_fraction * max_len))
    values = reward(completion_ids=[[0] * n for n in lengths])
    assert all(-1.0 <= v <= 0.0 for v in values)
    assert all(v == 0.0 for n, v in zip(lengths, values) if n <= max_len - int(cache_fraction * max_len))
