"""Units of `rpg_trl/reliability/`, without a trainer: the commit record of checkpoints and what a resume or a
rotation makes of incomplete folders (`checkpoints.py`), the generation state saved beside a checkpoint
(`generation_state.py`), the reward guard (`reward_guard.py`), the hold on the gloo process group at exit
(`teardown.py`) and the failure coordination of a vLLM server run (`process_failure.py`, `vllm_server.py`; the bound on
every request, `vllm_request_timeout`, with a tiny trainer and a stand-in server that hangs, `helpers/hung_server.py`). The end-to-end guarantees they serve are in `tests/test_guarantees.py` and
`tests/test_multiprocess.py` (docs/guarantees.md)."""

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.trainer_utils import rotate_checkpoints

from rpg_trl.reliability import RewardFunctionError, RewardGuard, process_failure, teardown
from rpg_trl.reliability.checkpoints import (
    COMMIT_RECORD,
    begin_checkpoint,
    checkpoint_problems,
    commit_checkpoint,
    last_complete_checkpoint,
    mark_being_written,
    resolve_resume_checkpoint,
    rotate_complete_checkpoints,
    saved_checkpoints_sentence,
)
from rpg_trl.reliability.generation_state import load_generation_state, save_generation_state

from helpers import failure_two_proc
from helpers.ports import free_port
from helpers.tiny_runs import rpg_warnings


ROOT = Path(__file__).resolve().parent.parent


# ==================================================================================================== checkpoints
def _folder(root, step, files=(), record=None):
    """A `checkpoint-{step}` folder with the (one-byte, or named with contents) `files` and a commit record; without
    a record, a `trainer_state.json` holds `{}` unless its contents are named (it must parse then)."""
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in files:
        default = "{}" if name == "trainer_state.json" and record is None else "x"
        name, content = name if isinstance(name, tuple) else (name, default)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    if record is not None:
        (folder / COMMIT_RECORD).write_text(json.dumps(record))
    return str(folder)


def test_a_checkpoint_counts_when_committed_or_when_transformers_finished_it(tmp_path, caplog):
    transformers_done = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]
    files = dict.fromkeys(transformers_done, 1)
    legacy = _folder(tmp_path, 1, transformers_done)  # GRPOTrainer's: no record, trainer_state.json written last
    legacy_half = _folder(tmp_path, 2, ["model.safetensors", "optimizer.pt"])
    legacy_ranks = _folder(
        tmp_path, 3, [*transformers_done[:3], "rng_state_0.pth", "rng_state_2.pth", "trainer_state.json"]
    )
    committed = _folder(tmp_path, 4, transformers_done, {"complete": True, "files": files})
    pending = _folder(tmp_path, 5, ["model.safetensors"], {"complete": False, "world_size": 2})
    lost_file = _folder(tmp_path, 6, transformers_done[:-1], {"complete": True, "files": files})
    truncated = _folder(
        tmp_path, 7, [*transformers_done[:-1], ("trainer_state.json", "")], {"complete": True, "files": files}
    )
    zero3 = _folder(
        tmp_path,
        8,
        ["global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_0.pth", "rng_state_1.pth"]
        + ["trainer_state.json"],
    )

    assert checkpoint_problems(legacy) == checkpoint_problems(committed) == checkpoint_problems(zero3) == []
    assert checkpoint_problems(legacy_half) == [
        "trainer_state.json",
        "the RNG state (rng_state.pth, or rng_state_{rank}.pth of each process)",
    ]
    assert checkpoint_problems(legacy_ranks) == ["rng_state_1.pth"]
    assert checkpoint_problems(pending) == [
        f"its commit ({COMMIT_RECORD} says the save did not finish)",
        "trainer_state.json",
        "the optimizer state (optimizer.pt or the DeepSpeed/FSDP optimizer files)",
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    assert checkpoint_problems(lost_file) == ["trainer_state.json"]
    assert checkpoint_problems(truncated) == ["trainer_state.json as committed (1 bytes; 0 now)"]

    # True: the newest complete one, each newer incomplete folder named in a warning with what it lacks.
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(tmp_path)) == zero3
        shutil.rmtree(zero3)
        assert resolve_resume_checkpoint(True, str(tmp_path)) == committed
    warnings = [m for m in rpg_warnings(caplog) if "incomplete checkpoint" in m]
    assert [w.split(":")[0] for w in warnings] == [
        f"Skipping the incomplete checkpoint {f}" for f in (truncated, lost_file, pending)
    ]
    assert "rng_state_1.pth" in warnings[2] and "trainer_state.json as committed" in warnings[0]
    # A path: refused when incomplete, listing what it lacks; left to transformers when it is no folder.
    with pytest.raises(
        ValueError, match=r"checkpoint-5: the checkpoint is incomplete .* lacks its commit .*rng_state_1"
    ):
        resolve_resume_checkpoint(pending, str(tmp_path))
    assert resolve_resume_checkpoint(legacy, str(tmp_path)) == legacy
    assert resolve_resume_checkpoint(str(tmp_path / "missing"), str(tmp_path)) == str(tmp_path / "missing")
    assert resolve_resume_checkpoint(None, str(tmp_path)) is None and resolve_resume_checkpoint(False, "x") is None
    with pytest.raises(ValueError, match=r"No complete checkpoint found .*checkpoint-2"):
        resolve_resume_checkpoint(True, str(_only(tmp_path / "other", legacy_half)))


def test_without_a_record_what_transformers_writes_is_checked_and_the_resuming_ranks_rng_files_are_named(
    tmp_path, caplog
):
    """A checkpoint of a trainer that does not commit lacks the optimizer state, the RNG state, or a rank's RNG file
    (one process writes rng_state.pth, so rng_state_0.pth alone lacks rank 1's); and a resume whose processes find no
    RNG file of their own is named in a warning (transformers would continue them with fresh random state)."""
    state = ["model.safetensors", "scheduler.pt", "trainer_state.json"]
    no_optimizer = _folder(tmp_path, 1, [*state, "rng_state.pth"])
    no_rng = _folder(tmp_path, 2, [*state, "optimizer.pt"])
    rank_0_only = _folder(tmp_path, 3, [*state, "optimizer.pt", "rng_state_0.pth"])
    two_ranks = _folder(tmp_path / "two", 4, [*state, "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"])
    assert checkpoint_problems(no_optimizer) == [
        "the optimizer state (optimizer.pt or the DeepSpeed/FSDP optimizer files)"
    ]
    assert checkpoint_problems(no_rng) == ["the RNG state (rng_state.pth, or rng_state_{rank}.pth of each process)"]
    assert checkpoint_problems(rank_0_only) == ["rng_state_1.pth"]
    assert checkpoint_problems(two_ranks) == []

    with caplog.at_level(logging.WARNING):
        for world_size in (2, 3, 1):
            assert resolve_resume_checkpoint(True, str(tmp_path / "two"), world_size) == two_ranks
    (three, one) = [m for m in rpg_warnings(caplog) if m.startswith("Resuming from")]
    assert f"{two_ranks} with 3 process(es), but it has no rng_state_2.pth" in three and "fresh random state" in three
    assert "with 1 process(es), but it has no rng_state.pth" in one
    record = {"complete": True, "world_size": 1, "files": {"rng_state.pth": 1}}
    committed = _folder(tmp_path / "c", 5, ["rng_state.pth"], record)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve_resume_checkpoint(committed, "x", world_size=2)
    (warning,) = rpg_warnings(caplog)  # with a record: the process count it names
    assert f"Resuming from {committed} with 2 process(es), but it was written by 1: " in warning


def test_without_a_record_rng_files_of_one_process_and_of_several_are_named(tmp_path, caplog):
    """A GRPOTrainer checkpoint (no commit record) that holds rng_state.pth beside stale rng_state_0.pth and
    rng_state_1.pth (a save by one process into a folder that a 2-process save had left): a resume with 2 processes
    (which loads the per-rank files) or 1 (rng_state.pth) warns, naming the files."""
    state = ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"]
    both = _folder(tmp_path, 4, [*state, "rng_state.pth", "rng_state_0.pth", "rng_state_1.pth"])
    assert checkpoint_problems(both) == []
    for world_size, loaded in ((2, "rng_state_0.pth, rng_state_1.pth"), (1, "rng_state.pth")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert resolve_resume_checkpoint(True, str(tmp_path), world_size) == both
        (warning,) = rpg_warnings(caplog)
        assert f"Resuming from {both} with {world_size} process(es): it holds rng_state.pth " in warning
        assert "and rng_state_0.pth, rng_state_1.pth (of a save by several)" in warning
        assert f"This resume loads {loaded}, which may be the stale one" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # one layout only: nothing to say
        resolve_resume_checkpoint(_folder(tmp_path / "one", 4, [*state, "rng_state.pth"]), "x", world_size=1)
    assert rpg_warnings(caplog) == []


def _saver(tmp_path, **args):
    """The parts of a trainer that the commit uses, for 1 process."""
    defaults = dict(should_save=True, world_size=1, process_index=0, save_only_model=False)
    return SimpleNamespace(
        args=SimpleNamespace(**{**defaults, **args}),
        state=SimpleNamespace(global_step=4),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None),
    )


def test_a_save_over_a_folder_left_at_its_step_starts_clean(tmp_path, caplog):
    """checkpoint-4 left incomplete by a 2-process save, saved again by 1 process: what the earlier save left is
    removed once the record says the folder is being written, so the commit lists the new save's files alone; RPG's
    reference, written before `begin_checkpoint`, stays."""
    old_files = [
        "model.safetensors",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "global_step4/zero_pp_rank_1_optim_states.pt",
    ]
    checkpoint = _folder(tmp_path, 4, old_files, {"complete": False, "world_size": 2})
    trainer = _saver(tmp_path)
    with caplog.at_level(logging.WARNING):
        mark_being_written(trainer, checkpoint)  # RPG's synced reference comes first
        assert sorted(os.listdir(checkpoint)) == [COMMIT_RECORD]
        (tmp_path / "checkpoint-4" / "rpg_reference.safetensors").write_text("ref")
        begin_checkpoint(trainer, checkpoint)
        for name in ("model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"):
            (tmp_path / "checkpoint-4" / name).write_text("new!")
        commit_checkpoint(trainer, checkpoint)
    record = json.loads((tmp_path / "checkpoint-4" / COMMIT_RECORD).read_text())
    assert record["complete"] and record["files"] == {
        "rpg_reference.safetensors": 3,
        **dict.fromkeys(["model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"], 4),
    }
    (warning,) = rpg_warnings(caplog)
    assert warning == (
        f"Saving {checkpoint} again: removed what an earlier save left there first (global_step4, "
        "model.safetensors, rng_state_0.pth, rng_state_1.pth)."
    )
    # The next save at another step starts clean as well; a folder that does not exist yet is no leftover.
    trainer.state.global_step = 6
    caplog.clear()
    begin_checkpoint(trainer, str(tmp_path / "checkpoint-6"))
    assert os.listdir(tmp_path / "checkpoint-6") == [COMMIT_RECORD] and not rpg_warnings(caplog)


def _save(root, step, world_size, names):
    """A committed checkpoint-{step} saved by `world_size` processes with the files `names`."""
    trainer = _saver(root, world_size=world_size)
    trainer.state.global_step = step
    checkpoint = str(root / f"checkpoint-{step}")
    begin_checkpoint(trainer, checkpoint)
    for name in names:
        (root / f"checkpoint-{step}" / name).write_text(f"step {step}")
    commit_checkpoint(trainer, checkpoint)
    return checkpoint


def _upload(folder, repo_folder):
    """The Hub's `upload_folder` into `repo_folder` (`last-checkpoint`), as it treats files: adds and replaces, never
    deletes."""
    shutil.copytree(folder, repo_folder, dirs_exist_ok=True)


def test_a_resume_refuses_stale_files_outside_the_commit_and_names_another_process_count(tmp_path, caplog):
    """`last-checkpoint` on the Hub after a 2-process save (step 2) and then a 1-process one (step 4), each pushed with
    its record: the upload left step 2's `rng_state_0.pth` and `rng_state_1.pth` beside step 4's files. The record
    lists every file of the save (RNG files included) and the number of processes. A resume from it is refused, naming
    the stale files (a 2-process resume would load them as its RNG state); once they are deleted it resumes, and a
    README added to the folder is named in a warning only. A resume of the 2-process checkpoint with 1 process warns
    that it is not an exact continuation, naming both process counts."""
    common = ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"]
    runs, hub = tmp_path / "runs", tmp_path / "hub" / "last-checkpoint"
    runs.mkdir()
    two = _save(runs, 2, 2, [*common, "rng_state_0.pth", "rng_state_1.pth"])
    _upload(two, hub)
    one = _save(runs, 4, 1, [*common, "rng_state.pth"])
    _upload(one, hub)
    record = json.loads((hub / COMMIT_RECORD).read_text())
    assert (record["world_size"], record["step"]) == (1, 4)
    assert sorted(record["files"]) == sorted([*common, "rng_state.pth"])
    assert record["files"]["rng_state.pth"] == len("step 4")
    assert sorted(os.listdir(hub)) == sorted([*common, COMMIT_RECORD, "rng_state.pth", "rng_state_0.pth",
                                              "rng_state_1.pth"])  # fmt: skip
    assert checkpoint_problems(str(hub)) == []  # complete: every file it lists is there, as committed
    for world_size in (1, 2):
        with pytest.raises(ValueError, match=r"it holds rng_state_0\.pth, rng_state_1\.pth, which its commit"):
            resolve_resume_checkpoint(str(hub), str(tmp_path), world_size=world_size)
    (hub / "rng_state_0.pth").unlink()
    (hub / "rng_state_1.pth").unlink()
    (hub / "README.md").write_text("notes")
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(str(hub), str(tmp_path), world_size=1) == str(hub)
    assert rpg_warnings(caplog) == [
        f"{hub} holds files that its commit does not list (README.md): not part of the checkpoint; no resume reads them."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(two, str(runs), world_size=1) == two
    (warning,) = rpg_warnings(caplog)
    assert warning.startswith(f"Resuming from {two} with 1 process(es), but it was written by 2: ")
    assert warning.endswith("Resume with 2 process(es) for an exact one.")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(two, str(runs), world_size=2) == two
    assert rpg_warnings(caplog) == []


def _flip(path, count=64):
    """Invert `count` bytes in the middle of the file at `path`: its size stays, its content changes."""
    data = bytearray(Path(path).read_bytes())
    middle = len(data) // 2 - count // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    Path(path).write_bytes(bytes(data))


def test_a_commit_records_each_files_digest_and_a_changed_file_of_the_same_size_does_not_count(tmp_path, caplog):
    """The commit record holds the sha256 of each file's content (compared here with `hashlib` over the bytes the
    test wrote). 64 flipped bytes in checkpoint-4's `optimizer.pt` (its size unchanged): `resume_from_checkpoint=True`
    skips checkpoint-4 with a warning naming the file and takes checkpoint-2; named explicitly, checkpoint-4 is refused
    with an error that names the file and says the checkpoint is damaged. A record of an earlier version, without
    digests, is checked by size: accepted when the sizes hold, named when one does not."""
    names = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]
    two = _save(tmp_path, 2, 1, names)
    four = _save(tmp_path, 4, 1, names)
    record = json.loads((tmp_path / "checkpoint-4" / COMMIT_RECORD).read_text())
    assert record["digest"] == "sha256"
    assert record["digests"] == {name: hashlib.sha256(b"step 4").hexdigest() for name in names}
    assert checkpoint_problems(four) == []

    optimizer = tmp_path / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(os.urandom(4096))  # a real-sized file, committed again, then 64 of its bytes flipped
    commit_checkpoint(_saver(tmp_path), four)
    _flip(optimizer)
    assert optimizer.stat().st_size == 4096
    changed = "optimizer.pt as committed (the same size, another content: its sha256 digest differs from the commit's)"
    assert checkpoint_problems(four) == [changed]
    assert checkpoint_problems(four, verify_digests=False) == []  # what a size check alone sees
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(tmp_path), world_size=1) == two
    assert rpg_warnings(caplog) == [f"Skipping the incomplete checkpoint {four}: it lacks {changed}."]
    with pytest.raises(ValueError) as refused:
        resolve_resume_checkpoint(four, str(tmp_path), world_size=1)
    assert str(refused.value).startswith(
        f"Cannot resume from {four}: the checkpoint is incomplete, damaged after its save (a file"
    )
    assert f"it lacks {changed}. Resume from a complete checkpoint" in str(refused.value)

    # An earlier version's record: files and sizes, no digests.
    legacy = json.loads((tmp_path / "checkpoint-2" / COMMIT_RECORD).read_text())
    del legacy["digests"], legacy["digest"]
    (tmp_path / "checkpoint-2" / COMMIT_RECORD).write_text(json.dumps(legacy))
    _flip(tmp_path / "checkpoint-2" / "model.safetensors", count=2)  # invisible to a size check
    assert checkpoint_problems(two) == []
    (tmp_path / "checkpoint-2" / "scheduler.pt").write_text("step")
    assert checkpoint_problems(two) == ["scheduler.pt as committed (6 bytes; 4 now)"]


def test_without_a_record_a_trainer_state_cut_short_does_not_count(tmp_path, caplog):
    """A checkpoint of a trainer that does not commit, killed while it wrote `trainer_state.json` (the file cut short:
    `transformers` would fail to load it with a `JSONDecodeError`): `resume_from_checkpoint=True` skips it with a
    warning naming the file and takes the checkpoint before it; named explicitly, it is refused naming the file."""
    from transformers import TrainerState

    state = json.dumps({"global_step": 4, "log_history": [{"loss": 0.5, "step": 4}]})
    files = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"]
    before = _folder(tmp_path, 2, [*files, "trainer_state.json"])
    cut = _folder(tmp_path, 4, [*files, ("trainer_state.json", state[: len(state) // 2])])
    with pytest.raises(json.JSONDecodeError):  # what transformers' resume does with it
        TrainerState.load_from_json(os.path.join(cut, "trainer_state.json"))
    (problem,) = checkpoint_problems(cut)
    assert problem.startswith("a readable trainer_state.json (it does not parse, JSONDecodeError: ")
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(tmp_path), world_size=1) == before
    assert rpg_warnings(caplog) == [f"Skipping the incomplete checkpoint {cut}: it lacks {problem}."]
    with pytest.raises(ValueError, match=r"checkpoint-4: the checkpoint is incomplete .* lacks a readable trainer_st"):
        resolve_resume_checkpoint(cut, str(tmp_path), world_size=1)
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("[]")  # JSON, but not the object transformers reads
    assert checkpoint_problems(cut) == ["a readable trainer_state.json (it holds a JSON list, not an object)"]


@pytest.mark.parametrize("with_record", [False, True], ids=["no-record", "record"])
def test_rng_files_of_another_number_of_processes_are_named(tmp_path, caplog, with_record):
    """A checkpoint saved by 4 processes (`rng_state_0.pth` to `rng_state_3.pth`; a GRPOTrainer's has no record)
    resumed by 2 processes (which load ranks 0 and 1: ranks 2 and 3's state is dropped) or by 1 (which looks for
    `rng_state.pth`, finds none and continues with fresh random state): a warning names the files, what this resume
    loads and what it does not, and the number of processes for an exact resume. 4 processes: no warning."""
    rng = [f"rng_state_{rank}.pth" for rank in range(4)]
    names = ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", *rng]
    if with_record:
        checkpoint = _save(tmp_path, 4, 4, names)
        written = "but it was written by 4: the random state (and RPG's buffered generation batch) of each process "
        written += "is not restored as saved (it holds "
    else:
        checkpoint = _folder(tmp_path, 4, names)
    held = "it holds rng_state_0.pth, rng_state_1.pth, rng_state_2.pth, rng_state_3.pth: "
    for world_size, expected in (
        (
            2,
            "but its RNG files are those of a save by 4 process(es); " + held + "this resume loads rng_state_0.pth, "
            "rng_state_1.pth; the random state saved in rng_state_2.pth, rng_state_3.pth is not restored, so the "
            "resumed run is not an exact continuation. Resume with 4 process(es) for an exact one.",
        ),
        (
            1,
            "but it has no rng_state.pth (it was written by another number of processes, or by a save that its "
            "highest rank did not finish); " + held + "this resume loads none of them; `transformers` continues the "
            "process(es) without rng_state.pth with fresh random state; the random state saved in rng_state_0.pth, "
            "rng_state_1.pth, rng_state_2.pth, rng_state_3.pth is not restored, so the resumed run is not an exact "
            "continuation. Resume with 4 process(es) for an exact one.",
        ),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert resolve_resume_checkpoint(True, str(tmp_path), world_size) == checkpoint
        (warning,) = rpg_warnings(caplog)
        if with_record:
            assert warning.startswith(f"Resuming from {checkpoint} with {world_size} process(es), {written}")
            assert "rng_state_2.pth, rng_state_3.pth is not restored" in warning
            assert ("rng_state.pth with fresh random state" in warning) == (world_size == 1)
            assert warning.endswith("Resume with 4 process(es) for an exact one.")
        else:
            assert warning == f"Resuming from {checkpoint} with {world_size} process(es), {expected}"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(tmp_path), 4) == checkpoint
    assert rpg_warnings(caplog) == []


def test_a_stopped_runs_message_says_whether_a_checkpoint_was_saved(tmp_path):
    """The message of a run stopped by a dead vLLM server says which checkpoint a restart continues from, or that none
    was saved, never that saved checkpoints are complete when none was saved."""
    from rpg_trl.reliability.vllm_server import _unreachable_message

    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), state=SimpleNamespace(global_step=3))
    error = ConnectionError("refused")
    message = _unreachable_message(trainer, "http://host:8000", error)
    assert "are complete" not in message
    assert message.endswith(
        f"at training step 3. No complete checkpoint was saved in {tmp_path} yet: restart the server and start the "
        "run again (`resume_from_checkpoint` has nothing to continue from)."
    )
    _folder(tmp_path, 4, ["model.safetensors"], {"complete": False})  # a save that did not finish: not one
    assert saved_checkpoints_sentence(str(tmp_path)).startswith("No complete checkpoint was saved")
    two = _save(tmp_path, 2, 1, ["model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"])
    assert _unreachable_message(trainer, "http://host:8000", error).endswith(
        f"at training step 3. The checkpoints saved in {tmp_path} are complete or do not count (the newest complete "
        f"one: {two}); restart the server and continue with `resume_from_checkpoint`."
    )


def test_a_weight_sync_deadline_names_the_checkpoints_saved_when_it_passes(tmp_path, monkeypatch, capsys):
    """The weight-sync deadline's message is written when the deadline passes, with the checkpoints saved by then (no
    checkpoint when the sync began, checkpoint-2 when it expired). The process's exit is replaced by a record."""
    from rpg_trl.reliability.vllm_server import weight_sync_deadline

    told, exits = [], []
    monkeypatch.setattr(process_failure, "tell_other_processes", lambda trainer, message: told.append(message))
    monkeypatch.setattr(process_failure, "_mark_exits", lambda: None)
    monkeypatch.setattr(process_failure, "os", SimpleNamespace(_exit=exits.append))
    trainer = SimpleNamespace(
        args=SimpleNamespace(output_dir=str(tmp_path)),
        state=SimpleNamespace(global_step=2),
        accelerator=SimpleNamespace(is_main_process=True),
    )
    with weight_sync_deadline(trainer, "http://host:8000", 0.3):
        two = _save(tmp_path, 2, 1, ["model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"])
        for _ in range(100):
            if exits:
                break
            time.sleep(0.05)
    assert exits == [1]
    (message,) = told
    assert message.startswith("The weight sync to the vLLM server at http://host:8000 did not finish within 0.3 s")
    assert f"(the newest complete one: {two})" in message
    assert f"VLLMServerError: {message}" in capsys.readouterr().err


def _only(root, folder):
    """`root` holding a copy of the checkpoint `folder` alone."""
    shutil.copytree(folder, root / os.path.basename(folder))
    return root


def test_rotation_counts_complete_checkpoints_and_never_deletes_the_newest_one(tmp_path):
    """`save_total_limit=1`, checkpoint-4 just committed, a newer checkpoint-6 left incomplete by a crash: RPG's
    rotation deletes checkpoint-2 only; `transformers`' would delete the newest complete checkpoint."""
    done = {"complete": True, "files": {"trainer_state.json": 1}}
    for root in (tmp_path / "rpg", tmp_path / "transformers"):
        _folder(root, 2, ["trainer_state.json"], done)
        _folder(root, 4, ["trainer_state.json"], done)
        _folder(root, 6, ["model.safetensors"], {"complete": False})
    deleted = rotate_complete_checkpoints(str(tmp_path / "rpg"), 1, str(tmp_path / "rpg" / "checkpoint-4"))
    assert deleted == [str(tmp_path / "rpg" / "checkpoint-2")]
    assert sorted(os.listdir(tmp_path / "rpg")) == ["checkpoint-4", "checkpoint-6"]
    assert last_complete_checkpoint(str(tmp_path / "rpg")) == str(tmp_path / "rpg" / "checkpoint-4")
    rotate_checkpoints(str(tmp_path / "transformers"), save_total_limit=1)  # what transformers does (by step here)
    assert sorted(os.listdir(tmp_path / "transformers")) == ["checkpoint-6"]
    assert rotate_complete_checkpoints(str(tmp_path / "rpg"), None, "x") == []


# ==================================================================================================== generation_state
def _fake_trainer(step, world_size=2, process_index=1, steps_per_generation=3):
    args = SimpleNamespace(
        steps_per_generation=steps_per_generation,
        world_size=world_size,
        process_index=process_index,
        gradient_accumulation_steps=1,
    )
    ids = torch.arange(6).view(2, 3)
    buffer = [{"completion_ids": ids + i, "num_items_in_batch": torch.tensor(6)} for i in range(3)]
    return SimpleNamespace(
        args=args,
        num_iterations=1,
        _step=step,
        _buffered_inputs=buffer,
        accelerator=SimpleNamespace(device="cpu"),
        state=SimpleNamespace(global_step=step),
    )


def test_each_process_saves_its_own_generation_state_and_a_mismatched_layout_falls_back(tmp_path, caplog):
    save_generation_state(_fake_trainer(step=4), str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["rpg_generation_state_1.pt"]  # like rng_state_{rank}.pth
    restored = _fake_trainer(step=0)
    restored._buffered_inputs = None
    restored.accelerator.device = torch.device("cpu", 1)  # a 2-process CPU run's device, which torch.load refuses
    assert load_generation_state(restored, str(tmp_path))
    assert restored._step == 4
    assert torch.equal(restored._buffered_inputs[2]["completion_ids"], torch.arange(6).view(2, 3) + 2)

    other_layout = _fake_trainer(step=0, steps_per_generation=2)
    other_layout._buffered_inputs = None
    other_layout.state.global_step = 3
    with caplog.at_level(logging.WARNING):
        assert not load_generation_state(other_layout, str(tmp_path))
    assert other_layout._buffered_inputs is None and other_layout._step == 0
    assert any("(2, 3, 1), not (2, 2, 1)" in m for m in rpg_warnings(caplog))

    save_generation_state(_fake_trainer(step=6, process_index=0), str(tmp_path))  # at a generation boundary
    assert torch.load(tmp_path / "rpg_generation_state_0.pt", weights_only=True)["buffered_inputs"] is None


# ==================================================================================================== reward_guard
@pytest.mark.parametrize(
    "output, match",
    [
        (["1.0"] * 4, r"'bad' returned '1\.0' \(str\) for sample 0 of 4"),
        ([0.0, 1.0, [2.0], 0.0], r"'bad' returned \[2\.0\] \(list\) for sample 2"),
        ([0.0, 1j, 0.0, 0.0], r"'bad' returned 1j \(complex\) for sample 1"),
        ([1.0] * 3, r"'bad' returned 3 rewards for 4 completions"),
        (1.0, r"'bad' returned float 1\.0; expected a list"),
    ],
    ids=["string", "list", "complex", "too-few", "scalar"],
)
def test_malformed_reward_outputs_are_refused_naming_function_and_sample(output, match):
    guard = RewardGuard()
    bad = guard.wrap(lambda **kwargs: output, "bad")
    with pytest.raises(RewardFunctionError, match=match):
        bad(prompts=["p"] * 4, completions=["c"] * 4, completion_ids=[[1]] * 4)


def test_non_finite_reward_warnings_name_the_function_and_are_rate_limited(caplog):
    guard = RewardGuard()
    with caplog.at_level(logging.WARNING):
        for _ in range(12):
            guard.sanitize("flaky", [1.0, math.nan], {"prompts": ["p", "q"]})
        guard.sanitize("other", [math.inf, 0.0], {"prompts": ["p", "q"]})
    messages = [m for m in rpg_warnings(caplog) if "non-finite" in m]
    assert len(messages) == 3  # 'flaky' at its 1st and 10th batch, 'other' at its 1st
    assert "'flaky'" in messages[0] and "sample 1" in messages[0] and "batch #10" in messages[1]
    assert "'other'" in messages[2] and "inf" in messages[2]


def test_async_reward_functions_are_guarded_too():
    async def slow_reward(prompts, completions, **kwargs):
        if "boom" in completions:
            raise KeyError("boom")
        return [math.inf if c == "inf" else 1.0 for c in completions]

    guarded = RewardGuard().wrap(slow_reward, "slow_reward")
    assert asyncio.run(guarded(prompts=["p"] * 3, completions=["a", "inf", "b"])) == [1.0, None, 1.0]
    with pytest.raises(RewardFunctionError, match=r"'slow_reward' raised KeyError.* on sample 2 of 3"):
        asyncio.run(guarded(prompts=["p"] * 3, completions=["a", "b", "boom"]))


def test_batch_level_reward_failures_say_so():
    def needs_two(prompts, **kwargs):
        if len(prompts) < 2:
            return [0.0] * len(prompts)
        raise RuntimeError("whole batch")

    with pytest.raises(RewardFunctionError, match="did not fail, so the failure depends on the batch as a whole"):
        RewardGuard().wrap(needs_two, "needs_two")(prompts=["a", "b"], completions=["x", "y"])


_REWARD_VALUES = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**40), 10**40),
    st.booleans(),
    st.floats(width=32).map(np.float32),
    st.floats().map(lambda x: torch.tensor(x, dtype=torch.float64)),
)


@settings(max_examples=80, deadline=None)
@given(values=st.lists(_REWARD_VALUES, min_size=1, max_size=12))
def test_property_guarded_rewards_are_finite_float32_or_none(values):
    rewards = RewardGuard().sanitize("f", values, {"prompts": ["p"] * len(values)})
    assert len(rewards) == len(values)
    for value, reward in zip(values, rewards):
        assert reward is None or (isinstance(reward, float) and math.isfinite(reward) and abs(reward) <= 3.5e38)
        if value is not None and reward is not None:
            assert reward == float(value)
    finite = [r for r in rewards if r is not None]
    assert torch.tensor(finite, dtype=torch.float32).isfinite().all()  # none overflows float32


# ==================================================================================================== teardown
@pytest.mark.slow
def test_hold_is_idempotent_and_the_group_is_destroyed_before_the_interpreter_exits():
    ports = [free_port(), free_port()]
    script = f"""
import atexit
import importlib.util
import torch.distributed as dist

# The module alone, by path: the package's `__init__` (transformers' Trainer, peft) would add 8 s of start-up.
spec = importlib.util.spec_from_file_location("teardown", {teardown.__file__!r})
teardown = importlib.util.module_from_spec(spec)
spec.loader.exec_module(teardown)

# Registered before teardown's own handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("initialized after release:", dist.is_initialized()))
assert not teardown.hold_process_group_until_exit()  # no process group: nothing to hold
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{ports[0]}", rank=0, world_size=1)
assert teardown.hold_process_group_until_exit() and teardown.hold_process_group_until_exit()
group = dist.group.WORLD
assert len(teardown._HELD) == 1 and teardown._HELD[0] is group
dist.destroy_process_group()  # Trainer.end(): the group object survives, held
assert teardown._HELD[0] is group
teardown.release_process_groups()
assert teardown._HELD == [] and not dist.is_initialized()
# A script that never destroys its group: the exit handler does.
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{ports[1]}", rank=0, world_size=1)
assert teardown.hold_process_group_until_exit() and dist.is_initialized()
print("done")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["done", "initialized after release: False"], proc.stdout


# ==================================================================================================== process_failure
@pytest.mark.slow
def test_the_main_process_reports_a_vllm_server_failure_and_cleans_up_and_the_other_stops_after_it():
    """2 processes under `torch.distributed.run`: the stand-in server fails in the middle of a request of the main
    process while process 1 waits for its answer in a broadcast. The main process raises its own `VLLMServerError`
    (its traceback), runs its `finally` and its `atexit` handlers, and torchrun names it as the root cause (exit 1);
    process 1 logs the same error once as its own and stops after the main process, without an error of its own
    (its broadcast fails when the main process destroys the group: held, not printed)."""
    returncode, output, seconds = failure_two_proc.launch("report")
    assert returncode != 0
    assert failure_two_proc.root_cause(output) == (0, 1), output[-3000:]
    cause = "stopped answering (ConnectionError: test: the server died mid-request) at training step 2"
    assert re.search(rf"\[rank0\]: rpg_trl\.reliability\.vllm_server\.VLLMServerError: The vLLM server at \S+ {re.escape(cause)}",
                     output), output[-4000:]  # fmt: skip
    assert output.count("VLLMServerError on process 1: The vLLM server at ") == 1, output[-4000:]
    finally_at, atexit_at = output.index("process 0: finally ran"), output.index("process 0: atexit ran")
    assert output.index("VLLMServerError on process 1") < finally_at < atexit_at
    assert "[rank1]" not in output and "Connection closed" not in output, output[-4000:]  # process 1: nothing else
    assert seconds < 40, seconds


@pytest.mark.slow
def test_a_weight_sync_past_its_deadline_stops_every_process_naming_it():
    """The main process's weight sync hangs (its server died in the middle of the transfer): 1 s past the deadline the
    main process names it and exits (status 1, the root cause), and process 1, waiting in the sync's barrier, names it
    too and stops."""
    returncode, output, seconds = failure_two_proc.launch("deadline")
    assert returncode != 0 and failure_two_proc.root_cause(output) == (0, 1), output[-3000:]
    message = "did not finish within 1 s (test)."
    assert re.search(
        rf"^VLLMServerError: The weight sync to the vLLM server at \S+ {re.escape(message)}", output, re.M
    )
    assert re.search(rf"^VLLMServerError on process 1: The weight sync .* {re.escape(message)}", output, re.M)
    assert "left the weight sync" not in output
    assert seconds < 40, seconds


#: Launches of the finished 2-process run. With the watcher polling without pause and no join at exit (rpg_trl 0.2),
#: 3 of 6 launches aborted (SIGABRT, "terminate called without an active exception"); 8 clean launches leave that
#: rate below 1 in 250.
EXIT_LAUNCHES = 8


@pytest.mark.slow
def test_a_finished_two_process_run_with_a_watcher_exits_0_every_time():
    """A short 2-process run with a (stand-in) vLLM server and process 1's failure watcher polling the store without
    pause, launched EXIT_LAUNCHES times: every launch exits 0 (no "terminate called without an active exception"):
    the watcher is stopped and joined when training ends (`watching`) or, for a script that never ends it, by the
    `atexit` handler, before the process group and the interpreter go away."""
    for launch in range(EXIT_LAUNCHES):
        mode = "exit" if launch % 2 == 0 else "exit-atexit"
        returncode, output, _ = failure_two_proc.launch(mode)
        assert returncode == 0 and "terminate called" not in output, (launch, mode, output[-3000:])
        assert "process 1 watching: True" in output and "process 1 done" in output


class _Store:
    """A process group's store as the watchers use it (`add`, `set`, `get`, `check`), in memory; `fail_after` checks
    it raises, as a store whose server went away."""

    def __init__(self, fail_after=None, values=None):
        self.values = {} if values is None else values  # shared by the clients of one store
        self.checks, self.fail_after = 0, fail_after

    def clone(self):
        return self

    def add(self, key, amount):
        self.values[key] = int(self.values.get(key, 0)) + amount
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        self.checks += 1
        if self.fail_after is not None and self.checks > self.fail_after:
            raise RuntimeError("Connection reset by peer (test)")
        return all(key in self.values for key in keys)


def _stub_trainer(rank):
    accelerator = SimpleNamespace(num_processes=2, is_main_process=rank == 0, process_index=rank)
    return SimpleNamespace(accelerator=accelerator)


def _watcher_and_main(main_process_exit_timeout=None):
    """Process 1's started watcher of "the vLLM server", and a main process's stub that posts to the watcher's key."""
    other = _stub_trainer(1)
    if main_process_exit_timeout is not None:
        other.args = SimpleNamespace(main_process_exit_timeout=main_process_exit_timeout)
    watcher = process_failure.FailureWatcher(other, "the vLLM server", "VLLMServerError")
    assert watcher.start()
    main = _stub_trainer(0)
    main._rpg_failure_key = watcher.key
    return watcher, main


def test_a_watcher_whose_store_fails_says_so_and_the_main_process_does_not_wait_for_it(monkeypatch, caplog):
    """The store fails under process 1's watcher: a warning names it and the watcher deregisters, so the main process,
    posting a failure afterwards, does not wait its NOTICE_TIMEOUT for a note that cannot come. A watcher that never
    notes (its process stuck) costs the main process NOTICE_TIMEOUT and a warning that says so."""
    store = _Store(fail_after=2)  # the watcher's client
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)
    monkeypatch.setattr(process_failure, "NOTICE_TIMEOUT", 5.0)
    main, other = _stub_trainer(0), _stub_trainer(1)
    key = process_failure.failure_key(other)
    main._rpg_failure_key = key  # the same trainer on the other process
    watcher = process_failure.FailureWatcher(other, "the vLLM server at http://127.0.0.1:1", "VLLMServerError")
    with caplog.at_level(logging.WARNING, logger="rpg_trl.reliability.process_failure"):
        assert watcher.start() and store.values[f"{key}/watchers"] == 1
        watcher._thread.join(timeout=10)
        assert not watcher.running
        assert store.values[f"{key}/watchers"] == 0
        assert "Process 1 stopped watching for a failure of the vLLM server at http://127.0.0.1:1" in caplog.text
        assert "Connection reset by peer (test)" in caplog.text
        monkeypatch.setattr(process_failure, "_default_store", lambda: _Store(values=store.values))  # the main's
        started = time.monotonic()
        process_failure.tell_other_processes(main, "The vLLM server at http://127.0.0.1:1 failed (test)")
        assert time.monotonic() - started < 1.0
        assert store.get(key) == b"The vLLM server at http://127.0.0.1:1 failed (test)"

        stuck = process_failure.failure_key(_stub_trainer(1))
        store.add(f"{stuck}/watchers", 1)  # registered, never notes
        monkeypatch.setattr(process_failure, "NOTICE_TIMEOUT", 0.3)
        main._rpg_failure_key = stuck
        process_failure.tell_other_processes(main, "failed again (test)")
        assert "1 of 1 watching process(es) did not take note of the failure within 0 s" in caplog.text
    watcher.stop()  # idempotent after the thread ended
    process_failure._POSTED.clear()


def test_the_failure_watcher_runs_while_the_trainer_may_use_the_server(monkeypatch):
    """The watcher of process 1 runs during `train()` and, after it, during `evaluate()` and `predict()` (which generate
    with the server too); an evaluation inside `train()` leaves it running; each outermost call stops it and withdraws
    it from the main process's count when it ends."""
    from rpg_trl.reliability import ReliabilityMixin

    store = _Store()
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)

    class Loop:  # the trainer's own loops, as far as the watcher is concerned
        def train(self, **kwargs):
            during_evaluation = self.evaluate()  # eval_strategy: an evaluation inside training
            return during_evaluation and self._rpg_failure_watcher.running

        def evaluate(self):
            return self._rpg_failure_watcher.running and store.values[f"{self._rpg_failure_key}/watchers"] == 1

        predict = evaluate

    trainer_class = type("Trainer", (ReliabilityMixin, Loop), {})
    trainer = trainer_class.__new__(trainer_class)  # no __init__: only the loops and the watcher
    trainer.accelerator = _stub_trainer(1).accelerator
    trainer.args = SimpleNamespace(output_dir="unused", world_size=2)  # no resume: no checkpoint is looked for
    watcher = trainer._rpg_failure_watcher = process_failure.FailureWatcher(trainer, "the vLLM server", "X")
    for call in (trainer.train, trainer.evaluate, trainer.predict, trainer.evaluate):
        assert call() is True, call
        assert not watcher.running and store.values[f"{watcher.key}/watchers"] == 0
    process_failure._WATCHERS.clear()


def test_the_other_process_waits_main_process_exit_timeout_and_names_it(monkeypatch, capsys):
    """After the main process's failure, process 1 waits `args.main_process_exit_timeout` seconds (here 0.2) for the
    main process to end; then it ends itself, saying the option that would have let the main process finish."""
    store = _Store()
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)
    monkeypatch.setattr(process_failure, "EXIT_GRACE", 0.0)
    exits = []
    monkeypatch.setattr(process_failure.os, "_exit", lambda status: exits.append(status))
    monkeypatch.setattr(process_failure, "_hold_uncaught_exceptions", lambda: None)
    watcher, main = _watcher_and_main(main_process_exit_timeout=0.2)
    assert watcher.main_exit_timeout == 0.2
    started = time.monotonic()
    process_failure.tell_other_processes(main, "the server failed (test)")
    watcher._thread.join(timeout=10)
    assert 0.2 <= time.monotonic() - started < 5 and exits[0] == 1
    err = capsys.readouterr().err
    assert "Process 1: the main process did not end within 0.2 s of the failure (main_process_exit_timeout=0.2)" in err
    assert "Raise main_process_exit_timeout in the config" in err
    process_failure._POSTED.clear()
    process_failure._WATCHERS.clear()


@pytest.mark.slow
def test_on_its_machine_a_watcher_waits_for_the_main_process_itself_to_end(monkeypatch, capsys):
    """The main process marks its exit from an `atexit` handler, before its interpreter shuts down, which can take
    seconds on a loaded machine (process 1, ending a fixed 5 s after the mark, was named by the launcher as the root
    cause). On the main process's machine the watcher waits for that process to have ended: a killed process that its
    launcher has not reaped yet (a zombie) has; one still running at `main_process_exit_timeout` is named as not ended.
    A mark from another machine, or without a process id, stands for the end."""
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)
    monkeypatch.setattr(process_failure, "EXIT_GRACE", 0.0)
    monkeypatch.setattr(process_failure, "_hold_uncaught_exceptions", lambda: None)
    exits = []
    monkeypatch.setattr(process_failure.os, "_exit", lambda status: exits.append((status, time.monotonic())))
    store = _Store()
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    host = socket.gethostname()
    assert process_failure._still_running(f"{host}/{os.getpid()}".encode())
    assert not process_failure._still_running(f"another-{host}/{os.getpid()}".encode())
    assert not process_failure._still_running(b"1")

    main_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        monkeypatch.setattr(process_failure, "_this_process", lambda: f"{host}/{main_process.pid}")
        watcher, main = _watcher_and_main()
        process_failure.tell_other_processes(main, "the server failed (test)")
        process_failure._mark_exits()
        assert store.get(f"{watcher.key}/main_exited") == f"{host}/{main_process.pid}".encode()
        time.sleep(1.0)
        assert exits == [] and watcher.running  # marked, still running: the watcher waits
        main_process.kill()
        killed = time.monotonic()
        watcher._thread.join(timeout=10)
        assert main_process.returncode is None  # not reaped while the watcher looked: a zombie
        assert [status for status, _ in exits] == [1] and exits[0][1] >= killed
    finally:
        main_process.kill()
        main_process.wait()
    process_failure._POSTED.clear()

    watcher, main = _watcher_and_main(main_process_exit_timeout=0.3)
    monkeypatch.setattr(process_failure, "_this_process", lambda: f"{host}/{os.getpid()}")  # runs on
    capsys.readouterr()
    started = time.monotonic()
    process_failure.tell_other_processes(main, "the server failed (test)")
    process_failure._mark_exits()
    watcher._thread.join(timeout=10)
    assert exits[1][0] == 1 and exits[1][1] - started >= 0.3  # (os._exit, patched, returns: a second call follows)
    assert "the main process did not end within 0.3 s of the failure" in capsys.readouterr().err
    process_failure._POSTED.clear()
    process_failure._WATCHERS.clear()


class _FailingStore(_Store):
    """A store whose calls on keys ending in one of `failing` raise, as a store server that went away."""

    def __init__(self, failing, values=None):
        super().__init__(values=values)
        self.failing = failing

    def _maybe_fail(self, key):
        if key.endswith(self.failing):
            raise RuntimeError("Connection closed by peer (test)")

    def add(self, key, amount):
        self._maybe_fail(key)
        return super().add(key, amount)

    def set(self, key, value):
        self._maybe_fail(key)
        super().set(key, value)


def test_store_calls_whose_failure_costs_time_are_named(monkeypatch, caplog):
    """Where a failed store call makes another process wait longer, a warning says so: the main process's mark of its
    exit (the others then wait main_process_exit_timeout, not EXIT_GRACE), a watcher's note of the failure (the main
    process then waits NOTICE_TIMEOUT) and a watcher's withdrawal (the same)."""
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)
    monkeypatch.setattr(process_failure, "EXIT_GRACE", 0.0)
    monkeypatch.setattr(process_failure, "NOTICE_TIMEOUT", 0.2)
    monkeypatch.setattr(process_failure, "_hold_uncaught_exceptions", lambda: None)
    monkeypatch.setattr(process_failure.os, "_exit", lambda status: None)
    caplog.set_level(logging.WARNING, logger="rpg_trl.reliability.process_failure")

    monkeypatch.setattr(process_failure, "_POSTED", [(_FailingStore(("/main_exited",)), "rpg_trl/failure/test")])
    process_failure._mark_exits()
    (warning,) = rpg_warnings(caplog)
    assert "could not mark its exit for the other processes" in warning and "rpg_trl/failure/test" in warning
    assert "wait up to main_process_exit_timeout (default 60 s) after the failure instead of 0 s" in warning

    caplog.clear()
    store = _FailingStore(("/noted",))
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    watcher, main = _watcher_and_main(main_process_exit_timeout=0.05)
    monkeypatch.setattr(process_failure, "_default_store", lambda: _Store(values=store.values))  # the main's client
    process_failure.tell_other_processes(main, "the server failed (test)")
    watcher._thread.join(timeout=10)
    messages = rpg_warnings(caplog)
    assert any("Process 1 could not tell the main process that it took note of the failure" in m for m in messages)
    assert any("1 of 1 watching process(es) did not take note" in m for m in messages)  # it waited NOTICE_TIMEOUT

    caplog.clear()
    store = _FailingStore(("/watchers",), values={})
    store.failing = ()  # registers, then fails on the withdrawal
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    watcher = process_failure.FailureWatcher(_stub_trainer(1), "the vLLM server", "VLLMServerError")
    assert watcher.start()
    store.failing = ("/watchers",)
    watcher.stop()
    (warning,) = rpg_warnings(caplog)
    assert "Process 1 could not withdraw its failure watcher" in warning and "waits up to 0.2 s" in warning
    process_failure._POSTED.clear()
    process_failure._WATCHERS.clear()


@pytest.mark.slow
def test_two_trainers_in_one_process_group_have_their_own_failure_record(monkeypatch):
    """Trainers are numbered as a process builds them: the failure posted by the first trainer's main process is seen
    by the first trainer's watcher, not the second's, and each main process waits for its own watchers only. A watcher
    stopped at the end of `train()` deregisters and ends its thread."""
    store = _Store()
    monkeypatch.setattr(process_failure, "_default_store", lambda: store)
    monkeypatch.setattr(process_failure, "WATCH_INTERVAL", 0.01)
    monkeypatch.setattr(process_failure, "EXIT_GRACE", 0.0)
    first, second = _stub_trainer(1), _stub_trainer(1)
    watchers = [process_failure.FailureWatcher(t, "the vLLM server", "VLLMServerError") for t in (first, second)]
    assert watchers[0].key != watchers[1].key
    exits = []
    monkeypatch.setattr(process_failure.os, "_exit", lambda status: exits.append(status))
    monkeypatch.setattr(process_failure, "_hold_uncaught_exceptions", lambda: None)
    for watcher in watchers:
        assert watcher.start()
    main_of_first = _stub_trainer(0)
    main_of_first._rpg_failure_key = watchers[0].key
    process_failure.tell_other_processes(main_of_first, "the first trainer's server failed (test)")
    assert store.values[f"{watchers[0].key}/noted"] == 1 and f"{watchers[1].key}/noted" not in store.values
    assert watchers[0].seen.is_set() and not watchers[1].seen.is_set()
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()  # the main process, ended
    monkeypatch.setattr(process_failure, "_this_process", lambda: f"{socket.gethostname()}/{ended.pid}")
    process_failure._mark_exits()  # the main process ends: the first watcher ends its process, after EXIT_GRACE
    watchers[0]._thread.join(timeout=10)
    assert exits == [1]
    with process_failure.watching(second):  # train() of the second trainer, which ends normally
        pass
    second._rpg_failure_watcher = watchers[1]
    with process_failure.watching(second):
        assert watchers[1].running
    assert not watchers[1].running and store.values[f"{watchers[1].key}/watchers"] == 0
    process_failure._POSTED.clear()
    process_failure._WATCHERS.clear()


# ==================================================================================================== prompt rows
def _char_tokenizer():
    from rpg_trl.testing import build_char_tokenizer

    return build_char_tokenizer()  # digits, '+-*=?:. \n' and 'Answer'; no unknown token: other characters raise


def _tokenizer_with_unknown_token():
    """A word-level tokenizer over two words whose unknown token is `[UNK]` (id 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "one": 1, "[UNK]": 2, "two": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="[UNK]")


def _with_bad_row(bad, index=5, good="1+1=", rows=8):
    from datasets import Dataset

    prompts = [good] * rows
    prompts[index] = bad
    return Dataset.from_list([{"prompt": p} for p in prompts])


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ("", "is an empty string"),
        ("  \n ", "is an empty string"),
        (None, "is None"),
        ("1+é=", "makes the tokenizer raise Exception: WordLevel error: Missing [UNK] token"),
    ],
    ids=["empty", "whitespace", "none", "unencodable"],
)
def test_a_bad_string_prompt_row_is_refused_naming_row_column_and_what_is_allowed(bad, what):
    from rpg_trl.reliability import check_prompt_rows

    with pytest.raises(ValueError) as caught:
        check_prompt_rows(_with_bad_row(bad), _char_tokenizer(), "training")
    message = str(caught.value)
    assert message.startswith(f"Row 5 of the training dataset: its 'prompt' column {what}")
    assert (
        "A prompt must be a non-empty string, or a non-empty list of chat messages {'role': str, 'content'" in message
    )
    assert "gives at least one token that is not its unknown token" in message


def test_a_non_string_prompt_column_is_refused_at_its_first_row():
    from datasets import Dataset

    from rpg_trl.reliability import check_prompt_rows

    with pytest.raises(
        ValueError, match=r"^Row 0 of the evaluation dataset: its 'prompt' column is of type int, not a"
    ):
        check_prompt_rows(Dataset.from_dict({"prompt": [3, 4]}), _char_tokenizer(), "evaluation")


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ([], "is an empty list of chat messages"),
        ([{"role": "user", "content": None}], "has message 0 whose 'content' is of type NoneType, not a string or a"),
        ([{"role": None, "content": "1+1="}], "has message 0 without a string 'role' (role: None)"),
        ([{"role": "user", "content": ""}], "is a list of chat messages without any text"),
        ([{"role": "user", "content": "1+é"}], "makes the tokenizer raise Exception"),
    ],
    ids=["no-messages", "content-none", "role-none", "no-text", "unencodable"],
)
def test_a_malformed_or_unencodable_chat_prompt_row_is_refused_naming_it(bad, what):
    from rpg_trl.reliability import check_prompt_rows

    good = [{"role": "system", "content": "2+2="}, {"role": "user", "content": "1+1="}]
    with pytest.raises(ValueError) as caught:
        check_prompt_rows(_with_bad_row(bad, index=2, good=good, rows=4), _char_tokenizer(), "training")
    assert str(caught.value).startswith(f"Row 2 of the training dataset: its 'prompt' column {what}")
    check_prompt_rows(_with_bad_row(good, index=2, good=good, rows=4), _char_tokenizer())  # the good rows pass
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+1="}]}]  # content parts (multimodal form)
    check_prompt_rows(_with_bad_row(parts, index=2, good=parts, rows=4), _char_tokenizer())


def test_a_prompt_of_unknown_tokens_only_is_refused_and_one_unknown_word_is_not():
    from rpg_trl.reliability import check_prompt_rows

    tokenizer = _tokenizer_with_unknown_token()
    assert tokenizer("three four", add_special_tokens=False).input_ids == [2, 2]  # the tokenizer does not raise
    with pytest.raises(
        ValueError, match=r"^Row 5 of the training dataset: its 'prompt' column encodes to the unknown"
    ):
        check_prompt_rows(_with_bad_row("three four", good="one two"), tokenizer)
    check_prompt_rows(_with_bad_row("one three", good="one two"), tokenizer)  # some known text: kept


def test_every_row_is_checked_with_one_tokenizer_call_per_thousand_rows_and_a_bar_above_ten_thousand(capsys):
    from datasets import Dataset

    from rpg_trl.reliability import check_prompt_rows

    tokenizer = _char_tokenizer()
    calls = []
    backend_call = type(tokenizer).__call__

    class Counting(type(tokenizer)):
        def __call__(self, text, *args, **kwargs):
            calls.append(1 if isinstance(text, str) else len(text))
            return backend_call(self, text, *args, **kwargs)

    tokenizer.__class__ = Counting
    check_prompt_rows(Dataset.from_dict({"prompt": ["1+2="] * 10_000}), tokenizer)
    assert calls == [1000] * 10 and "Checking the prompts" not in capsys.readouterr().err
    calls.clear()
    rows = Dataset.from_dict({"prompt": ["1+2="] * 17_000 + ["1+é="]})
    with pytest.raises(ValueError, match=r"^Row 17000 of the training dataset"):
        check_prompt_rows(rows, tokenizer)
    # 17 calls of 1000 rows, then the last batch of one row, which raises and is encoded again alone to find the row.
    assert calls == [1000] * 17 + [1, 1]
    assert "Checking the prompts of the training dataset" in capsys.readouterr().err
    check_prompt_rows(Dataset.from_dict({"prompt": ["1+2="] * 10_001}), tokenizer, show_progress=False)
    assert "Checking the prompts" not in capsys.readouterr().err


def test_an_iterable_dataset_is_checked_row_by_row_as_the_rows_arrive():
    from datasets import Features, IterableDataset, Value

    from rpg_trl.reliability import check_prompt_rows

    prompts = [f"{i}+1=" for i in range(7)] + ["", "8+1="]
    features = Features({"prompt": Value("string"), "answer": Value("int64")})
    stream = IterableDataset.from_generator(
        lambda: ({"prompt": p, "answer": i + 1} for i, p in enumerate(prompts)), features=features
    )
    checked = check_prompt_rows(stream, _char_tokenizer(), "training")
    assert isinstance(checked, IterableDataset) and checked.features == features
    arrived = []
    with pytest.raises(ValueError, match=r"^Row 7 of the training dataset: its 'prompt' column is an empty string"):
        for row in checked:
            arrived.append(row)
    good = IterableDataset.from_generator(lambda: ({"prompt": p, "answer": 0} for p in prompts[:7]), features=features)
    assert list(check_prompt_rows(good, _char_tokenizer())) == [{"prompt": p, "answer": 0} for p in prompts[:7]]


# ==================================================================================================== a hung vLLM server
def test_every_request_of_the_server_mode_client_is_bounded_once_and_none_leaves_it_alone():
    """`bound_server_requests` wraps the client's generation, weight-sync and cache-reset methods on the main process of
    a server-mode run (once, however often it is called), and leaves the client alone with `vllm_request_timeout=None`
    or outside server mode; a bounded call that answers in time returns its answer, and its error is its own."""
    from rpg_trl.reliability.vllm_server import bound_server_requests

    class Client:
        base_url = "http://127.0.0.1:1"

        def generate(self, prompts):
            return [p * 2 for p in prompts]

        def update_named_params(self, metadata, named_params):
            return "synced"

        def reset_prefix_cache(self):
            raise ValueError("test: the cache reset's own error")

        def get_world_size(self):
            return 1

    def trainer(seconds, mode="server"):
        args = SimpleNamespace(use_vllm=True, vllm_mode=mode, vllm_request_timeout=seconds, output_dir="/nonexistent")
        return SimpleNamespace(
            args=args,
            state=SimpleNamespace(global_step=0),
            accelerator=SimpleNamespace(num_processes=1, is_main_process=True),
            vllm_generation=SimpleNamespace(vllm_client=Client()),
        )

    for unbounded in (trainer(None), trainer(5.0, mode="colocate")):
        assert not bound_server_requests(unbounded)
        client = unbounded.vllm_generation.vllm_client
        assert list(vars(client)) == []  # nothing wrapped
    bounded = trainer(5.0)
    assert bound_server_requests(bounded) and bound_server_requests(bounded)
    client = bounded.vllm_generation.vllm_client
    assert sorted(vars(client)) == ["generate", "reset_prefix_cache", "update_named_params"]
    assert client.generate.__wrapped__.__func__ is Client.generate  # wrapped once, not twice
    assert client.generate([1, 2]) == [2, 4]
    assert client.update_named_params([], iter([])) == "synced"
    with pytest.raises(ValueError, match="the cache reset's own error"):
        client.reset_prefix_cache()
    assert client.get_world_size() == 1


@pytest.fixture
def stand_in_trl(monkeypatch):
    """TRL's server mode on the stand-in server of `helpers.hung_server` (undone after the test)."""
    from helpers import hung_server

    hung_server.patch_trl(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))
    return hung_server


def _hung_run(hung_server, tiny_model_dir, tmp_path, path, at, seconds=2.0):
    """A 5-step server-mode RPGTrainer run whose stand-in server hangs at the `at`-th request to `path`: the error it
    raises, the seconds from the hung request's arrival to the error, the trainer and the server's request counts."""
    from rpg_trl.reliability import VLLMServerError

    server = hung_server.HangingServer(str(tiny_model_dir), hang_on=path, hang_at=at)
    try:
        trainer = hung_server.build_trainer(str(tiny_model_dir), tmp_path, server.url, seconds, max_steps=5)
        with pytest.raises(VLLMServerError) as error:
            trainer.train()
        return str(error.value), time.monotonic() - server.hung_at, trainer, server
    finally:
        server.close()


def _hung_message(url, request, seconds, step):
    return (
        f"The vLLM server at {url} did not answer the {request} request within {seconds:g} s (`vllm_request_timeout`) "
        f"at training step {step}: the server hangs or is overloaded."
    )


@pytest.mark.slow
def test_a_vllm_server_that_hangs_at_the_first_generation_is_named_within_vllm_request_timeout(
    stand_in_trl, tiny_model_dir, tmp_path
):
    """The stand-in server accepts the run's first generation request and never answers (TRL's request has no
    timeout): 2 s later (`vllm_request_timeout=2`) `train()` raises `VLLMServerError` naming the server's URL, the
    request, the bound and the option, at step 0."""
    message, waited, trainer, server = _hung_run(stand_in_trl, tiny_model_dir, tmp_path, "/v1/completions", 1)
    assert message.startswith(_hung_message(server.url, "generation", 2, 0)), message
    assert "No complete checkpoint was saved" in message
    assert 1.5 < waited < 10.0, waited  # from the request's arrival, just after the bound's start
    assert trainer.state.global_step == 0 and server.counts["/v1/completions"] == 1


@pytest.mark.slow
def test_a_vllm_server_that_hangs_mid_run_is_named_at_the_step_it_hangs(stand_in_trl, tiny_model_dir, tmp_path):
    """Two generations answered (two optimizer steps), the third accepted and never answered: the run stops at step 2
    with `VLLMServerError` naming the generation request, within the bound."""
    message, waited, trainer, server = _hung_run(stand_in_trl, tiny_model_dir, tmp_path, "/v1/completions", 3)
    assert message.startswith(_hung_message(server.url, "generation", 2, 2)), message
    assert 1.5 < waited < 10.0, waited  # from the request's arrival, just after the bound's start
    assert trainer.state.global_step == 2 and server.counts["/v1/completions"] == 3


@pytest.mark.slow
def test_a_vllm_server_that_hangs_in_a_cache_reset_is_named(stand_in_trl, tiny_model_dir, tmp_path):
    """The prefix-cache reset that ends the weight sync of step 1 is accepted and never answered: `VLLMServerError`
    names the cache reset request, within the bound, and no generation of step 1 is asked for."""
    message, waited, trainer, server = _hung_run(stand_in_trl, tiny_model_dir, tmp_path, "/reset_prefix_cache", 2)
    assert message.startswith(_hung_message(server.url, "cache reset", 2, 1)), message
    assert 1.5 < waited < 10.0, waited  # from the request's arrival, just after the bound's start
    assert trainer.state.global_step == 1 and server.counts["/v1/completions"] == 1


@pytest.mark.slow
def test_a_vllm_server_that_hangs_in_a_weight_sync_ends_the_run_naming_it(tiny_model_dir, tmp_path):
    """The weight transfer of step 1 (`/update_weights`, which TRL waits for beside its broadcast of the weights) is
    accepted and never answered: the main process, stuck in a call no Python code can interrupt, writes
    `VLLMServerError` naming the server, the weight sync request, the bound and the option, and ends with status 1
    (as a `weight_sync_timeout` does), 2 s after the request; the run goes no further."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[1]), str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    )
    cmd = [
        sys.executable,
        "-m",
        "helpers.hung_server",
        "/update_weights",
        "2",
        "2",
        str(tiny_model_dir),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    url = re.search(r"^stand-in server: (\S+)$", proc.stdout, re.M).group(1)
    assert re.search(rf"^VLLMServerError: {re.escape(_hung_message(url, 'weight sync', 2, 1))}", proc.stderr, re.M), (
        output[-3000:]
    )
    assert "the run finished" not in output and "finally ran" not in output
    # From the request's arrival, just after the bound's start (not the launch: the start-up depends on the machine's
    # load), to the process's end.
    seconds = ended - float(re.search(r"request held at (\d+\.\d{3})", proc.stdout).group(1))
    assert 1.5 < seconds < 30, seconds


@pytest.mark.slow
def test_a_vllm_server_that_hangs_stops_every_process_and_leaves_none():
    """2 processes under `torch.distributed.run`: the stand-in server accepts the main process's generation request
    (through the client that `bound_server_requests` bounded to 2 s) and never answers, while process 1 waits for the
    answer in a broadcast. The main process raises `VLLMServerError` naming the server, the request and the option
    2 s after the request (its `finally` runs; torchrun names it as the root cause); process 1 logs the same error as
    its own and stops; no process of the run is left."""
    import uuid

    import psutil

    tag = f"rpg-hung-{uuid.uuid4().hex}"
    returncode, output, seconds = failure_two_proc.launch("hung-generation", tag=tag)
    assert returncode != 0 and failure_two_proc.root_cause(output) == (0, 1), output[-3000:]
    assert "process 0 bounds its requests: True" in output and "process 1 bounds its requests: False" in output
    message = "did not answer the generation request within 2 s (`vllm_request_timeout`) at training step 2"
    assert re.search(
        rf"\[rank0\]: rpg_trl\.reliability\.vllm_server\.VLLMServerError: The vLLM server at http://127\.0\.0\.1:\d+ "
        rf"{re.escape(message)}",
        output,
    ), output[-4000:]
    assert output.count("VLLMServerError on process 1: The vLLM server at ") == 1, output[-4000:]
    assert re.search(rf"^VLLMServerError on process 1: The vLLM server at \S+ {re.escape(message)}", output, re.M)
    waited = float(re.search(r"process 0: finally ran after ([\d.]+) s", output).group(1))
    assert 2.0 <= waited < 10.0, waited
    assert "got an answer" not in output
    assert seconds < 60, seconds
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if tag in " ".join(p.info["cmdline"] or [])]
    assert left == [], left


# ----------------------------------------------------------------------------------------------------------------------
# The served model's configuration on every TRL of the window: TRL 1.14 and 1.15's VLLMClient has no get_server_info
# ----------------------------------------------------------------------------------------------------------------------


class _Session:
    """Stands in for a client's `requests.Session`: answers every GET with `status` and `body` (a JSON tree, or a
    `ValueError` for a body that is not JSON) and records each request's URL and keyword arguments."""

    def __init__(self, status: int, body):
        self.status, self.body, self.requests = status, body, []

    def get(self, url, **kwargs):
        self.requests.append((url, kwargs))

        def json():
            if isinstance(self.body, Exception):
                raise self.body
            return self.body

        return SimpleNamespace(status_code=self.status, json=json, text=str(self.body))


def _old_client(status, body):
    """A client of TRL 1.14 or 1.15 (no `get_server_info`) on a server answering `/server_info` with `status`, `body`."""
    return SimpleNamespace(base_url="http://127.0.0.1:8000", session=_Session(status, body))


def test_the_served_model_configuration_is_read_from_vllms_endpoint_when_the_client_lacks_get_server_info():
    """A client without `get_server_info` (TRL 1.14, 1.15): the configuration comes from the request that TRL 1.16's
    `get_server_info` makes (checked against TRL's own method where the installed TRL has it); a client with the
    method: from the method, without another request."""
    from rpg_trl.reliability.vllm_server import served_model_config

    model_config = {"model": "/models/tiny", "revision": "abc", "trust_remote_code": False}
    client = _old_client(200, {"vllm_config": {"model_config": model_config, "weight_transfer_config": None}})
    assert not hasattr(client, "get_server_info")
    assert served_model_config(client) == model_config
    assert client.session.requests == [("http://127.0.0.1:8000/server_info", {"params": {"config_format": "json"}})]
    from trl.generation.vllm_client import VLLMClient

    if hasattr(VLLMClient, "get_server_info"):  # TRL 1.16: the same request, the same answer
        trl_client = _old_client(200, client.session.body)
        assert VLLMClient.get_server_info(trl_client)["model_config"] == model_config
        assert trl_client.session.requests == client.session.requests
    new_client = SimpleNamespace(get_server_info=lambda: {"model_config": {"model": "m"}}, session=_Session(500, {}))
    assert served_model_config(new_client) == {"model": "m"} and new_client.session.requests == []


@pytest.mark.parametrize(
    "status, body",
    [(404, {"detail": "Not Found"}), (200, {"vllm_config": "ModelConfig(model='m', ...)"}), (200, ValueError("html"))],
    ids=["no development endpoints", "configuration as a string", "not JSON"],
)
def test_a_server_that_does_not_report_its_model_is_not_checked_with_a_warning(status, body):
    """Without a configuration in JSON form from `/server_info`, a client without `get_server_info` gives None, and
    the check of the served model warns, naming the server, and lets the run go on."""
    from rpg_trl.reliability.vllm_server import check_server_model, served_model_config

    client = _old_client(status, body)
    assert served_model_config(client) is None
    trainer = _server_mode_trainer(client, config=None)
    with pytest.warns(UserWarning, match=r"The vLLM server at http://127\.0\.0\.1:8000 does not report its model "):
        check_server_model(trainer)


def _server_mode_trainer(client, config):
    """What `check_server_model` reads of a one-process server-mode trainer whose model has `config`."""
    return SimpleNamespace(
        args=SimpleNamespace(use_vllm=True, vllm_mode="server"),
        vllm_generation=SimpleNamespace(vllm_client=client),
        accelerator=SimpleNamespace(is_main_process=True, num_processes=1, unwrap_model=lambda model: model),
        model=SimpleNamespace(config=config),
    )


def test_the_served_model_is_checked_through_the_fallback(tiny_model_dir):
    """Through a client without `get_server_info`, the server's model (the tiny model's folder) is read and compared:
    the trainer's own model passes; a model with another vocabulary is refused, naming the field and both sizes."""
    from transformers import AutoConfig

    from rpg_trl.reliability import VLLMServerError
    from rpg_trl.reliability.vllm_server import check_server_model

    body = {"vllm_config": {"model_config": {"model": str(tiny_model_dir), "revision": None}}}
    config = AutoConfig.from_pretrained(tiny_model_dir)
    check_server_model(_server_mode_trainer(_old_client(200, body), config))  # same shapes: no error
    other = AutoConfig.from_pretrained(tiny_model_dir, vocab_size=config.vocab_size + 8)
    with pytest.raises(
        VLLMServerError, match=rf"vocab_size: trainer {config.vocab_size + 8}, server {config.vocab_size}"
    ):
        check_server_model(_server_mode_trainer(_old_client(200, body), other))
