# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Checkpoints that are complete or do not count: a commit record written last, and a resume that requires it.

`transformers` writes a checkpoint file by file (weights, optimizer and scheduler, RNG state, `trainer_state.json`)
and every process writes its own files; `get_last_checkpoint` then takes the highest-numbered `checkpoint-*` folder,
complete or not. A run killed while it saves (a SIGKILL, a dead node, a full disk) leaves a folder that
`resume_from_checkpoint=True` picks and cannot load (`FileNotFoundError: .../trainer_state.json`), or worse, loads in
part. And `save_total_limit` may already have deleted the previous, complete checkpoint.

[`CommittedCheckpointsMixin`] makes each save a transaction over all processes:

1. before anything is written, the process(es) that save (`args.should_save`) mark the folder as being written (the
   commit record [`COMMIT_RECORD`] with `"complete": false`), remove what an earlier save at the same step left there
   (a save that did not finish, or one by more processes), and every process waits for that;
2. the trainer saves as usual (model or shards, optimizer, scheduler, RNG, RPG's own files, `trainer_state.json`);
3. every process waits for the others (`accelerator.wait_for_everyone()`: all of them have written and closed their
   files), then the saving process reads every file of the folder once (the sha256 digest of its content), flushes
   it to the disk (`fsync`) and replaces the record, atomically, by `"complete": true` with the list of the files,
   their sizes and their digests;
4. only then is the checkpoint pushed to the Hub (`push_to_hub` with `hub_strategy="checkpoint"` or
   `"all_checkpoints"`: `transformers` pushes from inside its save, before the commit, a folder that a resume
   refuses), and older checkpoints rotated out (`save_total_limit`), complete ones only: the newest complete
   checkpoint is never deleted, whatever the state of newer folders.

Resuming ([`resolve_resume_checkpoint`]): `resume_from_checkpoint=True` takes the newest complete checkpoint and skips
each incomplete folder with a warning that names it and what it lacks; a checkpoint named explicitly that is
incomplete is refused with an error listing what is missing. The record holds the size and the digest (sha256) of
each file, computed as the save is committed; a resume checks both, so a file cut short or changed after the commit
(the same size, other bytes) makes the checkpoint not count, naming the file (a record without digests, of an earlier
version, is checked by size). A folder without a commit record was written by a trainer that does not commit (TRL's
`GRPOTrainer`, `transformers`' `Trainer`): it counts as complete when it holds what `transformers` writes, as far as
the folder tells, and its `trainer_state.json` parses ([`checkpoint_problems`]). With or without a record, RNG files
that do not match the resuming processes (files that no process loads, or a process that finds none of its own) are
named in a warning, and so are RNG files of a save by one process and of a save by several side by side (one set is
stale).

A checkpoint names its model: the record holds the model's identity ([`model_identity`]: its configuration without
the keys that do not make another model, and the names and shapes of its parameters, with their digests), taken as
`train()` begins, and a resume with another model is refused with a `ValueError` that says so and what differs
([`check_checkpoint_model`]), before `transformers` loads a weight: a model of the same shapes would otherwise resume
silently, and one of other shapes fail with a size mismatch that does not say the checkpoint is another model's. A
checkpoint without the identity (an earlier record, a trainer that does not commit) resumes as before. An error that
stops a run names the newest complete checkpoint as the resume would take it ([`saved_checkpoints_sentence`]).

A full disk during a save stops the run with a [`DiskFullError`] naming the checkpoint folder and the file being
written; that folder stays marked incomplete, and the previous checkpoint complete. What these guarantee, and the
tests that prove it, is listed in docs: *Guarantees*, "What survives a crash".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import logging


logger = logging.get_logger(__name__)

#: File name, inside a checkpoint folder, of its commit record: `{"complete": false, ...}` while it is being written,
#: `{"complete": true, "files": {relative path: size in bytes}, "digests": {relative path: hex digest},
#: "digest": "sha256", "world_size": ..., ...}` once every process has written its files: every file of the save,
#: those a resume reads (weights, optimizer, RNG and generation state of each process) included, the digest of each
#: file's content, the number of processes that wrote it, and the identity of the model that wrote it (`"model"`, see
#: [`model_identity`]). A record without `"digests"` (written before they were added) is checked by size only; one
#: without `"model"` is not held against the resuming model.
COMMIT_RECORD = "rpg_checkpoint.json"
#: The `hashlib` algorithm of the digests in a commit record (sha256: the fastest of `hashlib`'s on CPUs with SHA
#: instructions, x86 since 2017 and ARMv8; docs: *Guarantees*, "What survives a crash", gives the measured cost).
DIGEST_ALGORITHM = "sha256"
_DIGEST_CHUNK = 4 * 2**20
#: Written by `transformers` after the weights, optimizer, scheduler and RNG state (the last file of a save).
TRAINER_STATE = "trainer_state.json"
#: Model weights as the `transformers` back-ends save them (full or sharded, PEFT adapters, FSDP, DeepSpeed).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "pytorch_model_fsdp.bin",
    "pytorch_model_fsdp_0",
)
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: Below this many free bytes, a write error during a save is taken for a full disk (PyTorch's `torch.save` reports
#: ENOSPC as "file write failed", without an errno).
DISK_FULL_FREE_BYTES = 64 * 2**20


class DiskFullError(OSError):
    """The disk filled up while a checkpoint was written (an `OSError` with `errno.ENOSPC`)."""


# ------------------------------------------------------------------------------------------------ what a folder holds
def _read_record(checkpoint: str) -> dict | None:
    path = os.path.join(checkpoint, COMMIT_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {"complete": False, "unreadable": True}
    return record if isinstance(record, dict) else {"complete": False, "unreadable": True}


def _has_weights(checkpoint: str) -> bool:
    if any(os.path.exists(os.path.join(checkpoint, name)) for name in WEIGHT_FILES):
        return True
    # DeepSpeed: `global_step{N}/` with the model states (ZeRO-3 may save no full weights file at all).
    return any(
        name.startswith("global_step") and os.path.isdir(os.path.join(checkpoint, name))
        for name in os.listdir(checkpoint)
    )


def _has_optimizer(checkpoint: str) -> bool:
    names = os.listdir(checkpoint)
    if any(name in ("optimizer.pt", "optimizer.bin", "optimizer_0") for name in names):
        return True
    return any(
        name.startswith("global_step")
        and os.path.isdir(os.path.join(checkpoint, name))
        and any(f.endswith("optim_states.pt") for f in os.listdir(os.path.join(checkpoint, name)))
        for name in names
    )


def _absent_parts(checkpoint: str, world_size: int | None, save_only_model: bool) -> list[str]:
    """What a checkpoint folder that did not commit lacks among the files `transformers` writes."""
    absent = []
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        absent.append(TRAINER_STATE)
    elif unreadable := _unreadable_trainer_state(checkpoint):
        absent.append(unreadable)
    if not _has_weights(checkpoint):
        absent.append("the model weights (" + " / ".join(WEIGHT_FILES[:2]) + " / ...)")
    if not save_only_model and not _has_optimizer(checkpoint):
        absent.append("the optimizer state (optimizer.pt or the DeepSpeed/FSDP optimizer files)")
    if save_only_model:  # no RNG state is written
        return absent
    if world_size is not None:
        names = _rng_files(world_size)
    elif indices := _rng_ranks(checkpoint):  # 0..max must all be there, and 1 at least (one process writes
        names = [f"rng_state_{i}.pth" for i in range(max(*indices, 1) + 1)]  # rng_state.pth, not rng_state_0.pth)
    elif os.path.isfile(os.path.join(checkpoint, "rng_state.pth")):
        names = []
    else:
        return absent + ["the RNG state (rng_state.pth, or rng_state_{rank}.pth of each process)"]
    return absent + [name for name in names if not os.path.isfile(os.path.join(checkpoint, name))]


def _unreadable_trainer_state(checkpoint: str) -> str | None:
    """What is wrong with `trainer_state.json` in words, when it does not parse as `transformers` reads it (a JSON
    object): a file cut short by a kill in the middle of its write, which `transformers` would fail to load
    (`JSONDecodeError`). None when it parses."""
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        return f"a readable {TRAINER_STATE} (it does not parse, {type(exc).__name__}: {exc}; cut short by a kill?)"
    if not isinstance(state, dict):
        return f"a readable {TRAINER_STATE} (it holds a JSON {type(state).__name__}, not an object)"
    return None


def file_digest(path: str, algorithm: str = DIGEST_ALGORITHM) -> str:
    """The hex digest of the content of the file at `path` (`hashlib`'s `algorithm`), read in chunks of 4 MiB."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _rng_ranks(checkpoint: str) -> list[int]:
    """The ranks of the `rng_state_{rank}.pth` files in `checkpoint`."""
    return [int(m.group(1)) for n in os.listdir(checkpoint) if (m := re.match(r"rng_state_(\d+)\.pth$", n))]


def _rng_files(world_size: int) -> list[str]:
    """The RNG files `transformers` writes, and reads back, with `world_size` processes."""
    return ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{i}.pth" for i in range(world_size)]


def checkpoint_problems(checkpoint: str, verify_digests: bool = True) -> list[str]:
    """What makes the checkpoint folder `checkpoint` incomplete, in words (an empty list: it is complete).

    With a commit record: complete when the record says so and every file it lists is there with the size it had at
    the commit and, with `verify_digests` (every file read once), the same digest of its content (a record written
    before digests were recorded: the size only). Without one (a checkpoint of a trainer that does not commit, e.g.
    TRL's `GRPOTrainer`): complete when it holds what `transformers` writes, as far as the folder tells:
    `trainer_state.json`, which parses, the model weights, the optimizer state and the RNG state (`rng_state.pth`, or
    `rng_state_{rank}.pth` of ranks 0 to the highest there, and at least 0 and 1: one process writes
    `rng_state.pth`). A missing file of the highest rank is not visible here; [`resolve_resume_checkpoint`] names the
    files that the resuming processes do not find.
    """
    if not os.path.isdir(checkpoint):
        return ["the folder itself"]
    record = _read_record(checkpoint)
    if record is None:  # not written by a committing trainer: what transformers writes must all be there
        return _absent_parts(checkpoint, world_size=None, save_only_model=False)
    if record.get("unreadable"):
        return [f"a readable {COMMIT_RECORD}"]
    if not record.get("complete"):
        absent = _absent_parts(checkpoint, record.get("world_size"), bool(record.get("save_only_model")))
        return [f"its commit ({COMMIT_RECORD} says the save did not finish)", *absent]
    digests = (record.get("digests") or {}) if verify_digests else {}
    algorithm = record.get("digest", DIGEST_ALGORITHM)
    if digests and algorithm not in hashlib.algorithms_available:
        logger.warning(
            f"{checkpoint}: its commit records {algorithm} digests, which this Python cannot compute: the files are "
            "checked by size only."
        )
        digests = {}
    problems = []
    for name, size in sorted(record.get("files", {}).items()):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            problems.append(name)
        elif os.path.getsize(path) != size:
            problems.append(f"{name} as committed ({size} bytes; {os.path.getsize(path)} now)")
        elif name in digests and file_digest(path, algorithm) != digests[name]:
            problems.append(
                f"{name} as committed (the same size, another content: its {algorithm} digest differs from the "
                "commit's)"
            )
    return problems


def is_complete(checkpoint: str, verify_digests: bool = True) -> bool:
    """Whether `checkpoint` is a complete checkpoint folder (see [`checkpoint_problems`])."""
    return not checkpoint_problems(checkpoint, verify_digests)


def _checkpoint_folders(output_dir: str) -> list[str]:
    """The `checkpoint-{step}` folders of `output_dir`, newest (highest step) first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(name))]
    folders = [os.path.join(output_dir, name) for _, name in sorted(steps, reverse=True)]
    return [folder for folder in folders if os.path.isdir(folder)]


def last_complete_checkpoint(output_dir: str, verify_digests: bool = True, warn: bool = True) -> str | None:
    """The highest-numbered complete checkpoint of `output_dir` (None if there is none), warning (with `warn`) about
    each incomplete folder above it: its path and what it lacks (the files missing, cut short or changed)."""
    for folder in _checkpoint_folders(output_dir):
        problems = checkpoint_problems(folder, verify_digests)
        if not problems:
            return folder
        if warn:
            logger.warning(f"Skipping the incomplete checkpoint {folder}: it lacks {'; '.join(problems)}.")
    return None


def saved_checkpoints_sentence(output_dir: str) -> str:
    """A sentence on the checkpoints saved in `output_dir`, for an error that stops a run: the newest complete one, as
    `resume_from_checkpoint=True` takes it (the same [`last_complete_checkpoint`], digests included: a checkpoint
    damaged after its commit, even with its sizes unchanged, is not named; this reads the files of the newest
    checkpoints once, as a resume does), or that none was saved (a restart starts from the beginning)."""
    newest = last_complete_checkpoint(output_dir, warn=False)
    if newest is None:
        return (
            f"No complete checkpoint was saved in {output_dir} yet: restart the server and start the run again "
            "(`resume_from_checkpoint` has nothing to continue from)."
        )
    return (
        f"The checkpoints saved in {output_dir} are complete or do not count (the newest complete one: {newest}); "
        "restart the server and continue with `resume_from_checkpoint`."
    )


def resolve_resume_checkpoint(
    resume_from_checkpoint: str | bool | None, output_dir: str, world_size: int | None = None
) -> str | None:
    """`Trainer.train`'s `resume_from_checkpoint`, resolved to a complete checkpoint.

    `True`: the newest complete checkpoint of `output_dir` ([`last_complete_checkpoint`]); a `ValueError` when there
    is none. A path: the path, if the checkpoint there is complete (a `ValueError` listing what it lacks otherwise; a
    path that is not a folder is left to `transformers`, which reports it). `None`/`False`: `None`. With the
    `world_size` of the resuming run, a warning names the RNG files that its processes will not find (`transformers`
    then continues them with fresh random state, silently).
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        checkpoint = last_complete_checkpoint(output_dir)
        if checkpoint is None:
            incomplete = _checkpoint_folders(output_dir)
            detail = f" (incomplete: {', '.join(incomplete)})" if incomplete else ""
            raise ValueError(f"No complete checkpoint found in output directory ({output_dir}){detail}.")
    else:
        checkpoint = os.fspath(resume_from_checkpoint)
        if not os.path.isdir(checkpoint):
            return checkpoint
        problems = checkpoint_problems(checkpoint)
        if problems:
            record = _read_record(checkpoint)
            if record is not None and record.get("complete"):
                what = (
                    "incomplete, damaged after its save (a file changed since its commit: deleted, cut short, "
                    "overwritten, or corrupted on the disk or in a copy)"
                )
            else:
                what = "incomplete (its save did not finish"
                if record is None:  # a trainer that does not commit may also have saved the model only
                    what += ", or it holds the model only (`save_only_model=True`: start a new run from its weights)"
                what += ")"
            raise ValueError(
                f"Cannot resume from {checkpoint}: the checkpoint is {what}; it lacks "
                f"{'; '.join(problems)}. Resume from a complete checkpoint, or pass `resume_from_checkpoint=True` to "
                "take the newest complete one."
            )
    if world_size is not None:
        _check_resume_processes(checkpoint, world_size)
    return checkpoint


#: Files that no resume reads (documentation and Git attributes of a folder downloaded from the Hub): outside the
#: commit record, they are named in a warning, not refused. `huggingface_hub`'s download metadata (`.cache/`) is ignored.
INERT_SUFFIXES = (".md", ".txt", ".gitattributes")


def unlisted_files(checkpoint: str, record: dict) -> list[str]:
    """The files under `checkpoint` that its complete commit `record` does not list (relative paths, sorted): left by
    an earlier save or upload into the same folder, e.g. `last-checkpoint` on the Hub, which `upload_folder` adds to
    and replaces files in, and never deletes from."""
    listed = set(record.get("files", {}))
    found = []
    for root, _, names in os.walk(checkpoint):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), checkpoint)
            if relative.startswith(".cache" + os.sep) or relative == COMMIT_RECORD:
                continue
            if not name.startswith(COMMIT_RECORD + ".") and relative not in listed:
                found.append(relative)
    return sorted(found)


def _warn_on_two_rng_layouts(checkpoint: str, world_size: int) -> bool:
    """A checkpoint without a commit record that holds both `rng_state.pth` (a save by one process) and
    `rng_state_{rank}.pth` files (a save by several): one of the two sets was left by an earlier save into the same
    folder, and nothing tells which; a warning names the files and those this resume loads. Whether it warned."""
    ranks = sorted(_rng_ranks(checkpoint))
    if not ranks or not os.path.isfile(os.path.join(checkpoint, "rng_state.pth")):
        return False
    per_rank = ", ".join(f"rng_state_{rank}.pth" for rank in ranks)
    loaded = [name for name in _rng_files(world_size) if os.path.isfile(os.path.join(checkpoint, name))]
    logger.warning(
        f"Resuming from {checkpoint} with {world_size} process(es): it holds rng_state.pth (the RNG state of a save by "
        f"one process) and {per_rank} (of a save by several), and no commit record ({COMMIT_RECORD}) that says which "
        "save it is: one of the two was left by an earlier save into the same folder. This resume loads "
        f"{', '.join(loaded) or 'none of them'}, which may be the stale one, so the resumed run may not be an exact "
        "continuation. Delete the RNG files of the earlier save (those older than trainer_state.json), then resume."
    )
    return True


def _check_resume_processes(checkpoint: str, world_size: int) -> None:
    """The resume with `world_size` processes against the checkpoint's commit record: files that the commit does not
    list (stale files of an earlier save or upload into the folder, which the resume could load as this run's state:
    an RNG file of a process, weights, optimizer) are refused, but for documentation ([`INERT_SUFFIXES`]), which is
    named in a warning; another number of processes than the record's, RNG files that the resuming processes do not
    find (`transformers` would continue those processes with fresh random state, silently) or do not load (the random
    state of the processes of a larger save), with or without a record, are named in a warning."""
    record = _read_record(checkpoint) or {}
    if record.get("complete"):
        unlisted = unlisted_files(checkpoint, record)
        stale = [name for name in unlisted if not name.endswith(INERT_SUFFIXES)]
        if stale:
            shown = ", ".join(stale[:8]) + (f", ... ({len(stale)} in all)" if len(stale) > 8 else "")
            raise ValueError(
                f"Cannot resume from {checkpoint}: it holds {shown}, which its commit ({COMMIT_RECORD}, a save by "
                f"{record.get('world_size', '?')} process(es)) does not list: left by an earlier save or upload into "
                "the same folder (an upload to the Hub's `last-checkpoint` adds and replaces files, never deletes "
                "them), which the resume could load as this run's state. Delete those files (the commit lists every "
                "file of the checkpoint), then resume."
            )
        if unlisted:
            logger.warning(
                f"{checkpoint} holds files that its commit does not list ({', '.join(unlisted)}): not part of the "
                "checkpoint; no resume reads them."
            )
    if record.get("save_only_model"):
        return
    if not record and _warn_on_two_rng_layouts(checkpoint, world_size):  # no commit record: nothing tells which
        return  # files belong to the save
    _warn_on_rng_files_of_another_process_count(checkpoint, world_size, record)


def _rng_names(checkpoint: str) -> list[str]:
    """The RNG files in `checkpoint` (`rng_state.pth`, then `rng_state_{rank}.pth` by rank)."""
    ranked = [f"rng_state_{rank}.pth" for rank in sorted(_rng_ranks(checkpoint))]
    return (["rng_state.pth"] if os.path.isfile(os.path.join(checkpoint, "rng_state.pth")) else []) + ranked


def _named(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def _warn_on_rng_files_of_another_process_count(checkpoint: str, world_size: int, record: dict) -> None:
    """A resume with `world_size` processes whose RNG files (those `transformers` reads: `rng_state.pth` for one
    process, `rng_state_{rank}.pth` of each process for several) are not the checkpoint's: the files that no resuming
    process loads (their random state is dropped) and those that it does not find (`transformers` then continues the
    process with fresh random state, silently) are named in a warning, with the number of processes that wrote the
    checkpoint (its record's, or as far as its files tell)."""
    held = _rng_names(checkpoint)
    expected = _rng_files(world_size)
    missing = [name for name in expected if name not in held]
    unused = [name for name in held if name not in expected]
    written = record.get("world_size") if record.get("complete") else None
    if not missing and not unused and not (written and written != world_size):
        return
    ranks = _rng_ranks(checkpoint)
    writers = written or (max(ranks) + 1 if ranks else 1 if held else None)
    loaded = [name for name in expected if name in held]
    effects = [f"this resume loads {_named(loaded) if loaded else 'none of them'}"]
    if missing:
        effects.append(f"`transformers` continues the process(es) without {_named(missing)} with fresh random state")
    if unused:
        effects.append(f"the random state saved in {_named(unused)} is not restored")
    detail = f"it holds {_named(held) if held else 'no RNG file'}: " + "; ".join(effects)
    if written and written != world_size:
        logger.warning(
            f"Resuming from {checkpoint} with {world_size} process(es), but it was written by {written}: the random "
            f"state (and RPG's buffered generation batch) of each process is not restored as saved ({detail}), so "
            f"the resumed run is not an exact continuation. Resume with {written} process(es) for an exact one."
        )
        return
    if missing:
        if written:
            why = f"it was written by {written} process(es)"
        else:
            why = "it was written by another number of processes, or by a save that its highest rank did not finish"
        clause = f"it has no {_named(missing)} ({why})"
    else:
        clause = f"its RNG files are those of a save by {writers} process(es)"
    advice = f"Resume with {writers} process(es)" if writers else "Resume with the number of processes that wrote it"
    logger.warning(
        f"Resuming from {checkpoint} with {world_size} process(es), but {clause}; {detail}, so the resumed run is not "
        f"an exact continuation. {advice} for an exact one."
    )


# ------------------------------------------------------------------------------------------------ the model's identity
#: Configuration keys that do not make another model: written by the version of `transformers` or the place the model
#: was loaded from (`transformers_version`, `_name_or_path`, `architectures`, which `save_pretrained` fills in), the
#: precision it is loaded in (`dtype`) or run-time switches (the cache, the attention kernel, the outputs returned).
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "experts_implementation",
        "_experts_implementation",
    }
)
#: Module names that wrappers insert into parameter names (FSDP's, activation checkpointing's, `torch.compile`'s): a
#: parameter is named as in the bare model.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _stable_config(value):
    """A configuration's `to_dict()` without the [`VOLATILE_CONFIG_KEYS`] (at every level: sub-configurations such as
    `text_config` carry their own), as a JSON tree (keys strings, as the commit record stores them)."""
    if isinstance(value, dict):
        return {str(k): _stable_config(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_stable_config(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # e.g. a dtype or an enum left in a custom configuration


def _parameter_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _parameter_shapes(model) -> dict[str, str]:
    """`{name: "d0xd1x..."}` of every parameter of `model` (trainable or frozen: a PEFT model's base weights and its
    adapters), named as in the bare model. The full shape of a parameter that DeepSpeed ZeRO-3 partitions
    (`ds_shape`; its local tensor is empty), and of each parameter that an FSDP1 `FlatParameter` holds (its `_fqns`
    and `_shapes`)."""
    shapes = {}
    for name, param in model.named_parameters():
        fqns, flat_shapes = getattr(param, "_fqns", None), getattr(param, "_shapes", None)
        if fqns is not None and flat_shapes is not None:  # FSDP1 without `use_orig_params`: "<module>._flat_param"
            prefix = name.rpartition(".")[0]
            for fqn, shape in zip(fqns, flat_shapes):
                shapes[_parameter_name(f"{prefix}.{fqn}" if prefix else fqn)] = "x".join(map(str, shape))
            continue
        shape = getattr(param, "ds_shape", None)
        shape = param.shape if shape is None else shape
        shapes[_parameter_name(name)] = "x".join(map(str, shape))
    return shapes


def _json_digest(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.new(DIGEST_ALGORITHM, text.encode()).hexdigest()


def model_identity(model) -> dict | None:
    """What a commit record holds of the model that wrote the checkpoint (its `"model"` entry): its configuration
    (`config.to_dict()` without the [`VOLATILE_CONFIG_KEYS`]) and the names and shapes of its parameters, each with
    its digest ([`DIGEST_ALGORITHM`] of the JSON text). Names and shapes only: no weight is read (a few milliseconds
    for a model of a thousand tensors). None for a model without a configuration (nothing to compare then)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    stable = _stable_config(config.to_dict())
    parameters = _parameter_shapes(model)
    return {
        "config_digest": _json_digest(stable),
        "config": stable,
        "parameters_digest": _json_digest(parameters),
        "parameters": parameters,
    }


def _flat(tree: dict, prefix: str = "") -> dict:
    """`{"a.b": value}` of a configuration's nested dictionaries (`text_config`, `rope_parameters`, ...)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _listed(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def model_differences(saved: dict, current: dict) -> list[str]:
    """What differs, in words, between the model identity of a commit record (`saved`) and that of the model being
    trained (`current`), both from [`model_identity`]: the configuration keys whose values differ, and the parameters
    only in one of them or of another shape (an empty list: the same model). A configuration key that one of them
    lacks is not a difference: `transformers` adds keys to `to_dict()` from one version to the next (a model of
    another type differs in `model_type`, and in its parameters)."""
    differences = []
    if saved.get("config_digest") != current.get("config_digest"):
        then, now = _flat(saved.get("config") or {}), _flat(current.get("config") or {})
        keys = sorted(key for key in then.keys() & now.keys() if then[key] != now[key])
        if keys:
            shown = [f"{key}: {json.dumps(then[key])} in the checkpoint, {json.dumps(now[key])} here" for key in keys]
            differences.append(f"its configuration differs in {len(keys)} key(s) ({_listed(shown, 4)})")
    if saved.get("parameters_digest") != current.get("parameters_digest"):
        then, now = saved.get("parameters") or {}, current.get("parameters") or {}
        only_saved = sorted(then.keys() - now.keys())
        only_here = sorted(now.keys() - then.keys())
        reshaped = sorted(name for name in then.keys() & now.keys() if then[name] != now[name])
        if only_saved:
            differences.append(f"{len(only_saved)} parameter(s) only in the checkpoint ({_listed(only_saved)})")
        if only_here:
            differences.append(f"{len(only_here)} parameter(s) only in this model ({_listed(only_here)})")
        if reshaped:
            shown = [f"{name}: {then[name]} in the checkpoint, {now[name]} here" for name in reshaped]
            differences.append(f"{len(reshaped)} parameter(s) of another shape ({_listed(shown, 4)})")
    return differences


def check_checkpoint_model(checkpoint: str, identity: dict | None) -> None:
    """Refuse, with a `ValueError` that says so and what differs ([`model_differences`]), a resume from `checkpoint`
    whose commit record names another model than `identity` (the model being trained, [`model_identity`]). A
    checkpoint without the model's identity (a commit record of an earlier version, a trainer that does not commit,
    e.g. TRL's `GRPOTrainer`) or a model without one is not checked."""
    saved = (_read_record(checkpoint) or {}).get("model")
    if not isinstance(saved, dict) or identity is None:
        return
    differences = model_differences(saved, identity)
    if differences:
        raise ValueError(
            f"Cannot resume from {checkpoint}: the checkpoint belongs to another model than the one being trained "
            f"({'; '.join(differences)}; from its commit record, {COMMIT_RECORD}). Resume with the model that wrote "
            "it, or train this model in another `output_dir` (`resume_from_checkpoint=True` takes the newest "
            "complete checkpoint of `output_dir`). If it is the same model (e.g. a `transformers` upgrade changed "
            f'how its configuration is written), delete the `"model"` entry of {COMMIT_RECORD} to resume unchecked.'
        )


def trainer_model_identity(trainer) -> dict | None:
    """The [`model_identity`] of the trainer's model, unwrapped (`accelerator.unwrap_model`: DDP, DeepSpeed, FSDP's
    outer wrapper; the names that inner wrappers add are dropped). None without a model."""
    model = getattr(trainer, "model", None)
    if model is None:
        return None
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    return model_identity(model)


# --------------------------------------------------------------------------------------------------------- writing
def _write_json_atomically(path: str, content: dict, suffix: str) -> None:
    tmp = f"{path}.{suffix}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform or filesystem lets a folder be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _committed_files(checkpoint: str) -> tuple[dict[str, int], dict[str, str]]:
    """Every file under `checkpoint`, the commit record excluded, flushed to the disk: relative path -> size, and
    relative path -> digest of its content ([`DIGEST_ALGORITHM`], read back right after it was written: from the page
    cache, as a rule)."""
    files, digests = {}, {}
    for root, dirs, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, checkpoint)
            if relative == COMMIT_RECORD or name.startswith(COMMIT_RECORD + "."):
                continue
            digest = hashlib.new(DIGEST_ALGORITHM)
            with open(path, "rb") as f:
                size = 0
                while chunk := f.read(_DIGEST_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                os.fsync(f.fileno())  # a file written by another process on this machine is flushed as well
            files[relative], digests[relative] = size, digest.hexdigest()
        for name in dirs:
            _fsync_dir(os.path.join(root, name))
    _fsync_dir(checkpoint)
    return files, digests


def mark_being_written(trainer, checkpoint: str) -> None:
    """Record, on the saving processes, that `checkpoint` is being written (`"complete": false`). Called first by
    [`begin_checkpoint`], and by a part of the trainer that writes into the folder before it (RPG's synced
    reference), so that a folder re-saved at the same step never claims to be complete while it is rewritten."""
    args = trainer.args
    # The first call of a save (the reference's, or begin_checkpoint's) starts the folder afresh.
    first = getattr(trainer, "_rpg_checkpoint_begun", None) != checkpoint
    trainer._rpg_checkpoint_begun = checkpoint
    if args.should_save:
        os.makedirs(checkpoint, exist_ok=True)
        record = {
            "complete": False,
            "step": trainer.state.global_step,
            "world_size": args.world_size,
            "save_only_model": bool(args.save_only_model),
        }
        _write_json_atomically(os.path.join(checkpoint, COMMIT_RECORD), record, f"p{args.process_index}")
        if first:
            remove_leftovers(checkpoint)


def remove_leftovers(checkpoint: str) -> list[str]:
    """Delete everything in the folder `checkpoint` but its commit record: what an earlier save at the same step left
    there (a save that did not finish, or one by more processes, whose `rng_state_{rank}.pth` the new save would not
    overwrite and the commit would then list). Called once the record says the folder is being written, so that a
    crash in between leaves it incomplete. Returns the names deleted (top level), and logs them."""
    leftovers = sorted(name for name in os.listdir(checkpoint) if name != COMMIT_RECORD)
    for name in leftovers:
        path = os.path.join(checkpoint, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    if leftovers:
        _fsync_dir(checkpoint)
        shown = ", ".join(leftovers[:8]) + (f", ... ({len(leftovers)} in all)" if len(leftovers) > 8 else "")
        logger.warning(f"Saving {checkpoint} again: removed what an earlier save left there first ({shown}).")
    return leftovers


def begin_checkpoint(trainer, checkpoint: str) -> None:
    """Mark `checkpoint` as being written ([`mark_being_written`]), then wait until every process got here, so that
    no process writes into a folder that still claims to be complete (a folder re-saved at the same step)."""
    mark_being_written(trainer, checkpoint)
    trainer.accelerator.wait_for_everyone()


def commit_checkpoint(trainer, checkpoint: str) -> None:
    """Wait until every process has written (and closed) its files of `checkpoint`, then flush them all to the disk
    and record the checkpoint as complete, with its files, their sizes and the digests of their contents, and the
    identity of the model that wrote it ([`model_identity`]: taken as `train()` began, before the model was wrapped;
    none for a trainer without a model) (on the saving processes)."""
    trainer.accelerator.wait_for_everyone()
    args = trainer.args
    if args.should_save:
        files, digests = _committed_files(checkpoint)
        record = {
            "complete": True,
            "step": trainer.state.global_step,
            "world_size": args.world_size,
            "save_only_model": bool(args.save_only_model),
            "files": files,
            "digest": DIGEST_ALGORITHM,
            "digests": digests,
        }
        identity = getattr(trainer, "_rpg_model_identity", None) or trainer_model_identity(trainer)
        if identity is not None:
            record["model"] = identity
        _write_json_atomically(os.path.join(checkpoint, COMMIT_RECORD), record, f"p{args.process_index}")


def rotate_complete_checkpoints(
    run_dir: str, save_total_limit: int | None, newest: str, best_model_checkpoint: str | None = None
) -> list[str]:
    """`transformers`' `rotate_checkpoints` over complete checkpoints only: delete the oldest complete checkpoints of
    `run_dir` beyond `save_total_limit`, never `newest` (the one just committed) nor `best_model_checkpoint`, in
    `transformers`' order (modification time, or step where the filesystem's times are not reliable). Incomplete
    folders are neither counted nor deleted (a resumed run writes over them when it reaches their step). Returns the
    deleted folders."""
    if save_total_limit is None or save_total_limit <= 0:
        return []
    ordered = sort_checkpoints(run_dir, use_mtime=True, best_model_checkpoint=best_model_checkpoint)
    complete = [c for c in ordered if is_complete(c, verify_digests=False)]  # sizes: no re-reading at each save
    protected = {os.path.abspath(newest)}
    if best_model_checkpoint is not None:
        protected.add(os.path.abspath(best_model_checkpoint))
    deleted = []
    keep = max(save_total_limit, len(protected))
    for checkpoint in complete:
        if len(complete) - len(deleted) <= keep:
            break
        if os.path.abspath(checkpoint) in protected:
            continue
        logger.info(f"Deleting older checkpoint [{checkpoint}] due to args.save_total_limit")
        shutil.rmtree(checkpoint, ignore_errors=True)
        deleted.append(checkpoint)
    return deleted


# ------------------------------------------------------------------------------------------------------- full disk
def _disk_full(exc: BaseException, folder: str) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return True
        message = str(exc)
        if "No space left on device" in message or "Disk quota exceeded" in message:
            return True
        if "file write failed" in message and _free_bytes(folder) < DISK_FULL_FREE_BYTES:  # torch.save
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_bytes(folder: str) -> int:
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return -1


def _failed_file(exc: BaseException) -> str | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.filename:
            return os.fspath(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def disk_full_named(checkpoint: str, run_dir: str):
    """Turn an error of a full disk while `checkpoint` is written into a [`DiskFullError`] that says so, names the
    folder (and the file, when the error names it) and the newest complete checkpoint, which the failed save left
    intact (the one `resume_from_checkpoint=True` takes: checked as a resume checks it, digests included). Other
    errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        if not _disk_full(exc, checkpoint):
            raise
        previous = last_complete_checkpoint(run_dir)  # the resume's own check, digests included
        free = _free_bytes(checkpoint)
        where = _failed_file(exc) or checkpoint
        message = (
            f"The disk is full: writing the checkpoint {checkpoint} failed ({type(exc).__name__}: {exc}); "
            f"{free if free >= 0 else 'unknown'} bytes are free on the filesystem of {run_dir}. That checkpoint is "
            "left incomplete (a resume skips it); "
            + (
                f"the newest complete checkpoint, {previous}, is intact. "
                if previous
                else "there is no earlier complete checkpoint. "
            )
            + "Free some space, then resume with `resume_from_checkpoint=True`."
        )
        raise DiskFullError(errno.ENOSPC, message, where) from exc


# ----------------------------------------------------------------------------------------------------------- mixin
class CommittedCheckpointsMixin:
    """Checkpoints that are complete or do not count, for a `transformers.Trainer` subclass (put it before the trainer
    in the class line): each save is committed once every process has written its files, rotation keeps the newest
    complete checkpoint, a resume takes complete checkpoints only, and a full disk is named (see the module)."""

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir, self.args.world_size)
        # The model's identity is taken here, before `transformers` wraps the model (DeepSpeed, FSDP): the names and
        # full shapes of its parameters, which each commit records and a resume compares.
        self._rpg_model_identity = trainer_model_identity(self)
        if checkpoint is not None:
            check_checkpoint_model(checkpoint, self._rpg_model_identity)
        return super().train(
            resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
        )

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        args = self.args
        # `transformers` rotates inside `_save_checkpoint`, before the other processes may have finished writing:
        # rotation is deferred to after the commit, and counts complete checkpoints only.
        save_total_limit, args.save_total_limit = args.save_total_limit, None
        # `transformers` also pushes the checkpoint to the Hub from inside `_save_checkpoint` (`push_to_hub` with
        # `hub_strategy="checkpoint"` or `"all_checkpoints"`), before the commit: the push is deferred to after it.
        push_to_hub, args.push_to_hub = args.push_to_hub, False
        try:
            with disk_full_named(checkpoint, run_dir):
                begin_checkpoint(self, checkpoint)
                super()._save_checkpoint(model, trial)
                commit_checkpoint(self, checkpoint)
        finally:
            args.save_total_limit, args.push_to_hub = save_total_limit, push_to_hub
            self._rpg_checkpoint_begun = None
        if push_to_hub:
            self._push_from_checkpoint(checkpoint)  # the committed folder, its record included (process 0 only)
        if args.should_save:
            rotate_complete_checkpoints(run_dir, save_total_limit, checkpoint, self.state.best_model_checkpoint)
