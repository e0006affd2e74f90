# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Reliability of a GRPOTrainer run, as a mixin: bad rewards, exact resume, over-long prompts, malformed datasets.

[`ReliabilityMixin`] goes before `GRPOTrainer` (or a subclass) in a class line; [`~rpg_trl.RPGTrainer`] and the
baseline trainers of the project's math example (`rpg_math.py`) use it, so that RPG and its baselines differ in the
loss only. What each part guarantees, and the test that proves it, is listed in docs: *Guarantees*.

* [`reward_guard`]: non-finite rewards count as `None` (with a warning); a failing reward function is named with the
  sample it fails on.
* [`rpg_trl.reliability.checkpoints`]: a checkpoint is complete or does not count: each save is committed once every
  process has written its files, `save_total_limit` never deletes the newest complete checkpoint, a resume takes
  complete checkpoints only (naming each incomplete one and what it lacks), and a full disk is named.
* [`rpg_trl.reliability.generation_state`]: the buffered generation batch and the micro-step counter are saved with each checkpoint, so a
  resumed run continues exactly where the interrupted one was, also in the middle of a generation cycle.
* [`checks`]: datasets without a `prompt` column, and rows whose prompt is empty, None, not a string or chat messages,
  or not encodable by the tokenizer, are refused when the trainer is built (rows of an iterable dataset as its
  dataloader reads them; the trainer keeps the user's dataset objects), naming the row; a prompt that, with
  `max_completion_length`, exceeds the model's positions is reported once.
* [`rpg_trl.reliability.importance_weights`]: non-finite sampling log-probs from the vLLM server are counted
  (`vllm/nonfinite_logps`) and reported once.
* [`rpg_trl.reliability.importance_weights`]: exploding importance weights are reported (rate-limited), by a mixin of
  its own ([`ImportanceWeightMonitorMixin`]) that the RPG trainers list in their class line.
* [`rpg_trl.reliability.teardown`]: a 2-process CPU (gloo) run exits without PyTorch's teardown deadlock; a colocated
  vLLM engine is shut down before the process groups it uses.
* [`rpg_trl.reliability.vllm_server`]: in vLLM server mode, a server that serves another model is refused before
  training, and a server that stops answering (dead, or hung: no answer to a request within `vllm_request_timeout`
  seconds) stops the run with an error naming its URL, in bounded time, on every process; the main process reports it and cleans up, the others stop after it
  ([`rpg_trl.reliability.process_failure`]).
"""

from __future__ import annotations

from .checkpoints import CommittedCheckpointsMixin, DiskFullError
from .checks import (
    check_prompt_column,
    check_prompt_rows,
    check_sequence_length,
    check_trainer_prompt_rows,
    iterable_rows_checked,
    rows_checked_as_they_arrive,
)
from .generation_state import load_generation_state, save_generation_state
from .importance_weights import ImportanceWeightMonitor, ImportanceWeightMonitorMixin, count_nonfinite_sampling_logps
from .process_failure import watching
from .reward_guard import RewardFunctionError, RewardGuard
from .teardown import hold_process_group_until_exit, shutdown_colocated_vllm
from .vllm_server import (
    VLLMServerError,
    bound_server_requests,
    check_server_model,
    server_errors_named,
    watch_for_server_failure,
)


class ReliabilityMixin(CommittedCheckpointsMixin):
    """Reward guard, committed checkpoints and exact resume, length check, dataset and prompt-row checks, and the count
    of non-finite vLLM sampling log-probs, for a `GRPOTrainer` subclass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reward_guard = RewardGuard()
        # A clear error now for a dataset without prompts, not a KeyError mid-training (unless an environment supplies
        # the prompts).
        if self._checks_prompt_rows():
            check_prompt_column(self.train_dataset, "training")
            check_prompt_column(self.eval_dataset, "evaluation")
            # ... and a clear error now for a bad row (empty, None, not a string or chat messages, not encodable),
            # naming it, not a nameless error when it is sampled, maybe hours in (iterable datasets: as rows arrive,
            # see get_train_dataloader).
            check_trainer_prompt_rows(self)
        hold_process_group_until_exit()  # a gloo group is destroyed at exit without PyTorch's teardown deadlock
        check_server_model(self)  # vLLM server mode: the server's model has the trained model's weight shapes
        bound_server_requests(self)  # ... every request to it ends within `vllm_request_timeout` seconds
        watch_for_server_failure(self)  # ... and every process stops, naming it, when it fails mid-request

    def _checks_prompt_rows(self) -> bool:
        # The prompts are the dataset's, unless an environment supplies them (TRL then trains on placeholder rows).
        return getattr(self, "environment_factories", None) is None

    def get_train_dataloader(self):
        # The rows of an iterable training dataset are checked as the dataloader reads them: it reads their checked
        # map, and `self.train_dataset` stays the user's object (TRL's contract), the map living in the dataloader only.
        if not self._checks_prompt_rows():
            return super().get_train_dataloader()
        with iterable_rows_checked(self, "train_dataset", "training"):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        # As get_train_dataloader, for the evaluation dataset: `self.eval_dataset` (a dict's dataset named by a string)
        # or one passed to `evaluate`.
        if not self._checks_prompt_rows():
            return super().get_eval_dataloader(eval_dataset)
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            return super().get_eval_dataloader(rows_checked_as_they_arrive(self, eval_dataset, "evaluation"))
        with iterable_rows_checked(self, "eval_dataset", "evaluation", name=eval_dataset):
            return super().get_eval_dataloader(eval_dataset)

    def train(self, *args, **kwargs):
        # The failure watcher (vLLM server mode, processes other than the main one) runs while the trainer may use the
        # server, and is stopped and joined when the outermost of train(), evaluate() and predict() ends, before the
        # script destroys the process group and the interpreter shuts down.
        with watching(self):
            return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        # An evaluation after training generates with the server too: a server that dies then reaches every process.
        with watching(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with watching(self):
            return super().predict(*args, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        # vLLM server mode: a dead or failing server is named with its URL (health probe first, bounded time).
        with server_errors_named(self):
            return super()._generate_single_turn(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's `_calculate_rewards` with each reward function guarded by [`RewardGuard`]."""
        with self._reward_guard.installed(self):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _save_rng_state(self, output_dir):
        # The buffered generation batch and the micro-step counter are sampling state, like the RNG: saved with it.
        super()._save_rng_state(output_dir)
        save_generation_state(self, output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        load_generation_state(self, checkpoint)

    def _generate_and_score_completions(self, inputs):
        # vLLM's sampling log-probs that are NaN or infinite are counted, logged and reported (TRL silently gives them
        # an importance-sampling ratio of 1).
        batch = super()._generate_and_score_completions(inputs)
        count_nonfinite_sampling_logps(self, batch)
        return batch

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        check_sequence_length(self, inputs)
        return inputs


__all__ = [
    "CommittedCheckpointsMixin",
    "DiskFullError",
    "ImportanceWeightMonitor",
    "ImportanceWeightMonitorMixin",
    "ReliabilityMixin",
    "RewardFunctionError",
    "RewardGuard",
    "VLLMServerError",
    "check_prompt_column",
    "check_prompt_rows",
    "check_sequence_length",
    "count_nonfinite_sampling_logps",
    "iterable_rows_checked",
    "rows_checked_as_they_arrive",
    "shutdown_colocated_vllm",
]
