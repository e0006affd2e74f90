# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""TRL's and transformers' private surface that the library relies on, in one table, and the check of it (the tests'
own: tests/test_trl_surface.py runs it; the library itself needs only its supported releases, `rpg_trl.trl_release`).

`RPGTrainer` subclasses TRL's `GRPOTrainer` and `AsyncRPGTrainer` TRL's `AsyncGRPOTrainer`, as TRL's own experimental
trainers do (GMPO, SDPO, ...): the loss, the batch and a few checkpoint steps are reached through private methods,
attributes and batch keys, which a TRL release may rename without notice. [`PRIVATE_SURFACE`] lists every one of them
with what the library does with it; [`check_private_surface`] compares the table with the installed TRL and
transformers and returns what moved. tests/test_trl_surface.py runs it, and also checks that the table is complete
(every private name of TRL's trainers that the library touches, and every batch key it reads, is listed).

The library supports a window of TRL releases (``trl>=1.14.2,<1.17`` in ``setup.cfg``,
`rpg_trl.trl_release.TRL_WINDOW`), and the table
is written for each of them: an entry that a release of the window has otherwise, or lacks, says for which releases it
holds (`releases`: the asynchronous trainer's names from TRL 1.16, [`ASYNC_TRL`]), and the check compares the installed
TRL with the entries of its own release. Before widening the window to a new release: install it, run
tests/test_trl_surface.py, and go through what it lists (docs/design.md, "Bumping TRL").

Why private overrides rather than public hooks: TRL 1.16 has no public hook for the loss (`_compute_loss` is what
`compute_loss` delegates to, and what TRL's own experimental trainers override), for the generated batch
(`_generate_and_score_completions`, `_calculate_rewards`, `_prepare_inputs`), or for state saved in and restored from a
checkpoint at a given point of the save (`_save_checkpoint`, `_load_optimizer_and_scheduler`, `_save_rng_state`,
`_load_rng_state`, `_load_callback_state`): a callback's `on_save` runs after the checkpoint is written, and no callback
is told which checkpoint a run resumes from. Where a public name serves (the tokenizer through `processing_class`), the
library uses it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rpg_trl.trl_release import ASYNC_TRL, TRL_WINDOW, in_trl_window, installed_trl_release


GRPO = "trl.GRPOTrainer"
ASYNC_GRPO = "trl.experimental.async_grpo.AsyncGRPOTrainer"
TRAINER = "transformers.Trainer"

#: What the library does with a name: defines it in a subclass (`override`), calls it (`call`), reads or writes it on
#: the instance (`state`), redefines it on the class (`class attribute`), reads it from a batch (`batch key`), or relies
#: on what the owner's ``__init__`` does with an argument (`behaviour`).
KINDS = ("override", "call", "state", "class attribute", "batch key", "behaviour")


@dataclass(frozen=True)
class PrivateName:
    """One private name of TRL or transformers that the library relies on."""

    #: Where it lives: a class (``trl.GRPOTrainer``) or, for a batch key, the function whose source produces or reads it.
    owner: str
    #: The attribute, method or batch key.
    name: str
    kind: str
    #: The library modules that use it.
    used_in: tuple[str, ...]
    #: For `override` and `call`: the method's parameters after ``self``, as the library calls or overrides it. For
    #: `behaviour`: source fragments of the owner's method that the library's use depends on.
    signature: tuple[str, ...] = ()
    note: str = ""
    #: The TRL releases of the window for which the entry holds, as a version specifier (``">=1.16.0"``); empty: all.
    releases: str = ""

    def holds_for(self, release: str) -> bool:
        """Whether the entry describes TRL `release` ("1.14.2")."""
        return not self.releases or SpecifierSet(self.releases).contains(Version(release), prereleases=True)


def _methods(owner, kind, used_in, note, releases="", **signatures):
    return [
        PrivateName(owner, name, kind, used_in, tuple(params), note, releases) for name, params in signatures.items()
    ]


def _keys(owner, used_in, names, note="", releases=""):
    return [PrivateName(owner, name, "batch key", used_in, (), note, releases) for name in names]


_TRAINER_PY, _DS, _REL = "trainer.py", "dynamic_sampling.py", "reliability/"
#: GRPOTrainer._compute_loss's steps around the loss, which RPGTrainer keeps (rpg_trl/_grpo_loss_steps.py).
_STEPS = "_grpo_loss_steps.py"
_ASYNC = "async_rpg/trainer.py"
#: The entries of TRL's asynchronous trainer: `trl.experimental.async_grpo` as the library uses it is TRL 1.16's.
_FROM_ASYNC_TRL = f">={ASYNC_TRL}"
_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

# fmt: off
#: Every private name of TRL and transformers that the library relies on (TRL 1.14.2 to 1.16, [`TRL_WINDOW`];
#: transformers 5.17 to 5.24).
PRIVATE_SURFACE: tuple[PrivateName, ...] = (
    # ---- GRPOTrainer: the loss and the generated batch
    *_methods(GRPO, "override", (_TRAINER_PY,), "RPG's loss (Sec. 3, Tables 1 and 4) replaces GRPO's.",
              _compute_loss=("model", "inputs")),
    *_methods(GRPO, "override", (_DS, _REL),
              "Dynamic sampling regenerates; non-finite vLLM log-probs counted.",
              _generate_and_score_completions=("inputs",)),
    *_methods(GRPO, "override", (_DS, _REL), "The reward guard; dynamic sampling keeps each round's rewards.",
              _calculate_rewards=("inputs", "prompts", "completions", "completion_ids_list")),
    *_methods(GRPO, "override", (_REL,), "Generation errors name the vLLM server (passed through unchanged).",
              _generate_single_turn=("prompt_ids", "images", "multimodal_fields", "num_generations",
                                     "has_tool_images")),
    *_methods(GRPO, "override", (_REL,), "Length checks on the batch; the generation state for exact resume.",
              _prepare_inputs=("generation_batch",)),
    *_methods(GRPO, "call", (_STEPS,), "The policy's log-probs and entropies, as GRPO computes them.",
              releases=">=1.15", _get_per_token_logps_and_entropies=(
                  "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                  "compute_aux_loss", *_MULTIMODAL)),
    *_methods(GRPO, "call", (_STEPS,),
              "TRL 1.14 passes the same arguments on to `_full_logits_logps` (or, with Liger, `_chunked_logps`), "
              "whose parameters are those of 1.15's `_get_per_token_logps_and_entropies`.",
              releases="<1.15", _get_per_token_logps_and_entropies=("model", "args", "batch_size", "compute_aux_loss",
                                                                     "kwargs")),
    # ---- transformers.Trainer: checkpoints and datasets
    *_methods(TRAINER, "override", (_TRAINER_PY, "reliability/checkpoints.py"),
              "The synced reference and the commit record go into the checkpoint; the Hub push waits for the "
              "commit (args.push_to_hub is off during the save).",
              _save_checkpoint=("model", "trial")),
    *_methods(TRAINER, "override", (_TRAINER_PY,), "Resume restores the synced reference (all backends).",
              _load_optimizer_and_scheduler=("checkpoint",)),
    *_methods(TRAINER, "override", (_TRAINER_PY,), "The adaptive KL controller stays the trainer's own.",
              _load_callback_state=()),
    *_methods(TRAINER, "override", (_DS, _REL), "Generation state saved and loaded beside the RNG state.",
              _save_rng_state=("output_dir",), _load_rng_state=("checkpoint",)),
    *_methods(TRAINER, "call", ("ref_sync/callback.py", "reliability/checkpoints.py"),
              "Where the checkpoint of this step goes.", _get_output_dir=("trial",)),
    *_methods(TRAINER, "call", ("reliability/checkpoints.py",),
              "The checkpoint is pushed to the Hub after its commit (transformers pushes it inside the save).",
              _push_from_checkpoint=("checkpoint_folder",)),
    *_methods(TRAINER, "call", (_DS,), "Dynamic sampling draws extra prompts as the train dataloader does.",
              _remove_unused_columns=("dataset", "description"),
              _get_collator_with_removed_columns=("data_collator", "description")),
    # ---- GRPOTrainer's state
    PrivateName(GRPO, "_metrics", "state", (_TRAINER_PY, _STEPS, _DS, "kl_control.py", "ref_sync/callback.py",
                                            "reliability/importance_weights.py", "reliability/kl_drift.py"),
                note="mode -> metric -> list of values; GRPOTrainer.log averages and logs them."),
    PrivateName(GRPO, "_step", "state", ("reliability/generation_state.py",),
                note="Micro-batch counter that picks the buffered generation batch; restored on resume."),
    PrivateName(GRPO, "_buffered_inputs", "state", ("reliability/generation_state.py",),
                note="The generation batch served over `steps_per_generation`; saved for an exact resume."),
    PrivateName(GRPO, "_entropy_bonus_enabled", "state", (_STEPS,), note="Entropy bonus on or off."),
    PrivateName(GRPO, "_entropy_window_stats", "state", (_STEPS,),
                note="The adaptive entropy controller's window, updated as GRPOTrainer._compute_loss does."),
    PrivateName(GRPO, "_last_world_entropy", "state", (_STEPS,),
                note="The adaptive entropy controller's last entropy (saved by GRPOTrainer)."),
    *[PrivateName(GRPO, name, "class attribute", (_TRAINER_PY, _ASYNC), note="Model card: tags, name, paper.")
      for name in ("_tag_names", "_name", "_paper")],
    # ---- GRPOTrainer.__init__
    PrivateName(GRPO, "__init__", "behaviour", (_TRAINER_PY,),
                ("self.beta = args.beta", "if self.beta == 0.0:", "self.ref_model = None"),
                "With kl_anchor='sampling', RPGTrainer builds GRPOTrainer with beta = 0 (no reference model) "
                "and sets it back."),
    PrivateName(GRPO, "__init__", "behaviour", (_TRAINER_PY,),
                ("if args.sync_ref_model:", "SyncRefModelCallback"),
                "RPGTrainer builds GRPOTrainer with sync_ref_model = False and installs its own "
                "RefModelSyncCallback."),
    # ---- kl_estimate="vocabulary" (TRL 1.16 on): the fused LM head's kernel, replaced for the loss's call
    PrivateName("trl.trainer.utils", "add_fused_lm_head", "behaviour", ("vocabulary_kl.py",),
                ("_ChunkedLogProbFunction.apply(", "compact = _use_triton(", "hidden_states[mask] if compact",
                 "labels[mask] if compact else labels.clamp(min=0).reshape(-1)"),
                "The loss's scoring pass looks its kernel up by this name at call time; RPGTrainer hands it one that "
                "also computes each position's KL, for the labelled rows (compact) or every shifted position.",
                releases=">=1.16"),
    PrivateName(GRPO, "_get_per_token_logps_and_entropies", "behaviour", ("vocabulary_kl.py",),
                ("labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)",
                 "labels[:, :-logits_to_keep] = -100", "fused_lm_head=True"),
                "The labelled rows are the completion tokens where the mask is set: the anchor's states are matched "
                "to them through completion_mask.", releases=">=1.16"),
    # ---- the batch of GRPOTrainer._generate_and_score_completions, read by _compute_loss
    *_keys(f"{GRPO}._generate_and_score_completions", (_STEPS, _DS), ("completion_ids",)),
    *_keys(f"{GRPO}._generate_and_score_completions", (_STEPS, _DS, "reliability/importance_weights.py"),
           ("completion_mask", "tool_mask")),
    *_keys(f"{GRPO}._generate_and_score_completions", (_STEPS,), ("prompt_ids", "prompt_mask")),
    *_keys(f"{GRPO}._generate_and_score_completions", (_TRAINER_PY,),
           ("advantages", "old_per_token_logps", "ref_per_token_logps")),
    *_keys(f"{GRPO}._generate_and_score_completions", ("reliability/checks.py",), ("prompt_mask",)),
    *_keys(f"{GRPO}._generate_and_score_completions", (_STEPS, _DS), ("num_items_in_batch",),
           "Dynamic sampling recounts it for the batch it keeps."),
    *_keys(f"{GRPO}._generate_and_score_completions", (_TRAINER_PY,), ("importance_sampling_ratio",)),
    *_keys(f"{GRPO}._generate_and_score_completions", (_STEPS, "reliability/importance_weights.py"),
           ("sampling_per_token_logps",), "Non-finite values (vLLM's NaN log-probs) are counted."),
    *_keys(f"{GRPO}._compute_loss", (_STEPS,), _MULTIMODAL, "Passed on to the model as GRPOTrainer does."),
    # ---- AsyncGRPOTrainer: the packed stream, its loss and its step accounting (TRL 1.16 on: _FROM_ASYNC_TRL)
    PrivateName(ASYNC_GRPO, "_metrics", "state", (_ASYNC,), note="mode -> metric -> list of values.",
                releases=_FROM_ASYNC_TRL),
    PrivateName(ASYNC_GRPO, "_rollout_dataset", "state", (_ASYNC,),
                note="The rollout queue's dataset (main process): its health check also probes the vLLM server.",
                releases=_FROM_ASYNC_TRL),
    PrivateName("trl.experimental.async_grpo.async_grpo_trainer.RolloutQueueDataset", "check_health_fn", "state",
                (_ASYNC,), note="The health check it calls while the trainer waits on an empty queue.",
                releases=_FROM_ASYNC_TRL),
    *_methods(ASYNC_GRPO, "override", (_ASYNC,), "A weight sync probes the vLLM server and names it when it is dead.",
              releases=_FROM_ASYNC_TRL, _sync_weight=()),
    PrivateName(ASYNC_GRPO, "__init__", "behaviour", (_ASYNC,), ("StepIntervalCallback(self._sync_weight",),
                "Every weight sync after the cold one goes through self._sync_weight (the override above).",
                releases=_FROM_ASYNC_TRL),
    *[PrivateName(ASYNC_GRPO, name, "state", (_ASYNC,),
                  note="Per-step accounting flushed by AsyncGRPOTrainer._log_step_metrics (throughput, MFU).",
                  releases=_FROM_ASYNC_TRL)
      for name in ("_last_forward_time_s", "_step_forward_s", "_step_forward_tokens", "_step_samples",
                   "_step_seq_len_weighted", "_step_trained_tokens")],
    *_keys(f"{ASYNC_GRPO}.compute_loss", (_ASYNC,),
           ("attention_mask", "input_ids", "position_ids", "shift_labels", "token_index", "old_log_probs",
            "advantages", "segment_id", "global_n_tokens", "global_n_forward_tokens", "mean_seq_len",
            "tree_max_seqlens", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_kv_index"),
           releases=_FROM_ASYNC_TRL),
)
# fmt: on


def _resolve(dotted: str):
    """The object at `dotted` ("package.module.Name.attr"): the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _source_of_class(cls) -> str:
    """The source of `cls` and of its bases from TRL and transformers (where an instance attribute is set)."""
    chunks = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("trl", "transformers"):
            try:
                chunks.append(inspect.getsource(base))
            except (OSError, TypeError):
                pass
    return "\n".join(chunks)


def check_private_surface(surface=PRIVATE_SURFACE, release: str | None = None) -> list[str]:
    """
    Compare the entries of `surface` that hold for the installed TRL's release (`release` when given: the entries of
    that release, [`PrivateName.holds_for`]) with the installed TRL and transformers; return one line per name that
    moved (empty when everything the library relies on is where it expects it), and a first line when the release is
    outside [`TRL_WINDOW`] (the table has not been checked against it):

    * `override`/`call`: the owner has the method, with exactly the parameters of `signature` after ``self``;
    * `state`: the owner (or one of its TRL/transformers bases) assigns ``self.<name>``;
    * `class attribute`: the owner has the attribute;
    * `batch key`: the owner's source mentions the key as a string;
    * `behaviour`: the owner's method contains each source fragment of `signature`.
    """
    release = release or installed_trl_release()
    problems = []
    if not in_trl_window(release):
        problems.append(f"TRL {release} is outside the window the table is written for ({TRL_WINDOW})")
    sources: dict[str, str] = {}
    for entry in surface:
        if not entry.holds_for(release):
            continue
        where = f"{entry.owner}.{entry.name} ({entry.kind}, used in {', '.join(entry.used_in)})"
        try:
            owner = _resolve(entry.owner)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{where}: the owner {entry.owner} is gone ({exc!r})")
            continue
        if entry.kind in ("override", "call"):
            method = getattr(owner, entry.name, None)
            if not callable(method):
                problems.append(f"{where}: no such method")
                continue
            params = tuple(inspect.signature(method).parameters)[1:]
            if params != entry.signature:
                problems.append(f"{where}: parameters {params}, expected {entry.signature}")
        elif entry.kind == "state":
            if entry.owner not in sources:
                sources[entry.owner] = _source_of_class(owner)
            assignment = rf"self\.{re.escape(entry.name)}\s*(?::[^=\n]*)?=(?!=)"  # `self._x = ...`, `self._x: T = ...`
            if not re.search(assignment, sources[entry.owner]):
                problems.append(f"{where}: {entry.owner} no longer sets self.{entry.name}")
        elif entry.kind == "class attribute":
            if not hasattr(owner, entry.name):
                problems.append(f"{where}: no such class attribute")
        elif entry.kind == "batch key":
            text = inspect.getsource(owner)
            if f'"{entry.name}"' not in text and f"'{entry.name}'" not in text:
                problems.append(f"{where}: the key is no longer in the source of {entry.owner}")
        elif entry.kind == "behaviour":
            text = inspect.getsource(getattr(owner, entry.name))
            missing = [fragment for fragment in entry.signature if fragment not in text]
            if missing:
                problems.append(f"{where}: {entry.owner}.{entry.name} no longer contains {missing} ({entry.note})")
        else:
            problems.append(f"{where}: unknown kind {entry.kind!r}; choose one of {KINDS}")
    return problems
