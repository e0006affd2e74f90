# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""DAPO dynamic sampling (Yu et al., 2025), used by the paper's runs (Sec. 5).

A group (the `num_generations` completions of one prompt) whose rewards are all equal (accuracy all 0 or all 1) has a
zero advantage for every completion: it gives no reward gradient and only dilutes the batch. Dynamic sampling drops
such groups and generates completions for new prompts until every process holds a full generation batch of groups
with signal, for at most `dynamic_sampling_max_rounds` generation rounds; when the bound is hit the batch is filled
with the zero-variance groups generated so far (advantage 0: they only carry the KL term).

How it fits TRL's [`~trl.GRPOTrainer`]:

- TRL gives each process a local generation batch of `per_device_train_batch_size * steps_per_generation` rows, in
  which every prompt is repeated `num_generations` times consecutively (its `RepeatSampler`). When that local size is a
  multiple of `num_generations` (checked by [`~rpg_trl.RPGConfig`]) every group lives on one process, so groups are
  kept or dropped whole, on the process that generated them, without moving tensors between processes.
- Rewards are gathered across processes inside TRL (`_calculate_rewards`), so every process knows the signal of every
  group and takes the same decisions (how many rounds, how many prompts per round).
- Extra prompts come from the data in order, as DAPO takes its next prompts from the data loader: a
  [`PromptStream`] reads the training set's indices in successive shuffled passes (seeded by the trainer's `seed`),
  so over a run every prompt is drawn about equally often and the stream advances through the data. A batch never
  holds a prompt twice: prompts already in it (the data loader's, gathered from every process, and earlier rounds')
  are passed over, unless the dataset is too small to avoid it. Every process holds the same stream and draws the same
  global prompts, and takes its own slice (disjoint prompts). The stream's position is saved in checkpoints
  ([`DynamicSamplingMixin`]), so a resumed run draws what the interrupted one would have. An extra round
  draws as many prompts as the observed keep rate predicts are still missing on the neediest process, at most a full
  batch. (TRL's data loader keeps its own epoch: the replacement prompts do not shorten it.)
- Advantages are TRL's, computed per generation round: with `scale_rewards="group"` or `"none"` (the paper's) they
  are per-group quantities and do not depend on the round; with `"batch"` the std is that of the round's batch.
- TRL's reward metrics (`reward`, `frac_reward_zero_std`, the completions table) describe every generated sample,
  before filtering, like DAPO's logs. Dynamic sampling adds `dynamic_sampling/rounds` (generation rounds for this
  batch), `dynamic_sampling/kept_fraction` (fraction of generated groups with signal) and
  `dynamic_sampling/filled_fraction` (fraction of the batch filled with zero-variance groups; 0 unless the bound
  was hit).

The functions below are pure (tensors and dicts in, tensors and dicts out) and are tested without a trainer;
[`generate_with_dynamic_sampling`] runs the loop for a trainer, [`~rpg_trl.RPGTrainer`] calls it when
`dynamic_sampling=True`, and [`DynamicSamplingMixin`] adds it to any other `GRPOTrainer` subclass (e.g. TRL's own GRPO
and DAPO losses, for the baselines of the project's math example, `rpg_math.py`). [`DynamicSamplingArguments`] declares
its configuration fields (`dynamic_sampling`, `dynamic_sampling_max_rounds`, `dynamic_sampling_metric`), mixed into
each configuration that offers it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from trl.trainer.utils import pad


#: Keys of TRL's scored batch that are left-padded (prompts); every other 2-D entry is right-padded (completions).
LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")
#: Keys whose first dimension is not the sample (images, patches): dynamic sampling supports text-only batches.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)


def groups_with_signal(rewards: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """
    Which groups have a non-zero reward variance (DAPO's group filter).

    Args:
        rewards (`torch.Tensor`):
            Shape `(num_groups * num_generations,)`: one reward per completion, the completions of a group consecutive.
            NaN (unscorable completion) is ignored.
        num_generations (`int`):
            Completions per group (G).
        atol (`float`, *optional*, defaults to `1e-6`):
            Rewards closer than this count as equal.

    Returns:
        `torch.BoolTensor` of shape `(num_groups,)`: `True` where the finite rewards of the group are not all equal.
        A group with fewer than two finite rewards has no signal.
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"`rewards` must be 1-D with a length divisible by num_generations={num_generations}; got shape "
            f"{tuple(rewards.shape)}."
        )
    groups = rewards.detach().to(device="cpu", dtype=torch.float64).view(-1, num_generations)
    finite = torch.isfinite(groups)
    highest = torch.where(finite, groups, -math.inf).amax(dim=1)
    lowest = torch.where(finite, groups, math.inf).amin(dim=1)
    return (highest - lowest) > atol  # -inf for a group without finite reward


def choose_groups(signals: Sequence[torch.Tensor], num_groups: int) -> tuple[list[list[int]], int]:
    """
    Picks `num_groups` groups from a process's generation rounds: groups with signal first (earliest round first),
    then, only if there are not enough, zero-variance groups (the best available, advantage 0).

    Args:
        signals (`Sequence[torch.Tensor]`):
            One boolean tensor per round, shape `(groups in that round,)`, from [`groups_with_signal`].
        num_groups (`int`):
            Groups the batch must hold.

    Returns:
        `tuple[list[list[int]], int]`: For each round, the indices of the chosen groups (ascending), and how many of
        the chosen groups are zero-variance fillers.
    """
    available = sum(s.numel() for s in signals)
    if available < num_groups:
        raise ValueError(f"Only {available} groups were generated but the batch needs {num_groups}.")
    picks: list[list[int]] = [[] for _ in signals]
    taken = 0
    for want_signal in (True, False):
        if not want_signal:
            fillers = num_groups - taken
        for round_picks, signal in zip(picks, signals):
            candidates = torch.nonzero(signal.cpu() == want_signal).flatten().tolist()
            take = candidates[: num_groups - taken]
            round_picks.extend(take)
            taken += len(take)
    return [sorted(p) for p in picks], fillers


def groups_to_draw(missing: int, kept_fraction: float, full: int) -> int:
    """
    Groups per process to generate in the next round: enough to replace `missing` groups at the keep rate observed so
    far (`ceil(missing / kept_fraction)`), at least 1 and at most `full` (a full generation batch).
    """
    if missing <= 0:
        return 0
    if kept_fraction <= 0:
        return full
    return max(1, min(full, math.ceil(missing / kept_fraction)))


#: Mixed into the seed of the replacement-prompt order, so that it is not the order of TRL's own sampler.
_STREAM_SEED_TAG = 0x52504753


class PromptStream:
    """
    The indices of a dataset of `dataset_size` rows in successive shuffled passes, read in order: where dynamic
    sampling takes its replacement prompts. Pass `epoch` is a permutation seeded by `(seed, epoch)`; `position` is the
    next row of the current pass. The state is `(dataset_size, seed, epoch, position)` ([`state_dict`]): equal on
    every process, saved in checkpoints.
    """

    def __init__(self, dataset_size: int, seed: int, epoch: int = 0, position: int = 0):
        if dataset_size < 1:
            raise ValueError("Dynamic sampling needs a non-empty training dataset to draw replacement prompts from.")
        if not 0 <= position <= dataset_size or epoch < 0:
            raise ValueError(f"Invalid stream position: epoch {epoch}, position {position} of {dataset_size} rows.")
        self.dataset_size, self.seed, self.epoch, self.position = dataset_size, seed, epoch, position
        self._order_epoch, self._order = None, None

    def state_dict(self) -> dict:
        return {"dataset_size": self.dataset_size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def next_index(self) -> int:
        """The next index of the stream (a new pass starts when one ends)."""
        if self.position == self.dataset_size:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([int(self.seed), _STREAM_SEED_TAG, self.epoch])
            self._order_epoch, self._order = self.epoch, rng.permutation(self.dataset_size)
        self.position += 1
        return int(self._order[self.position - 1])

    def take(self, count: int, key: Callable[[int], Hashable], exclude: set) -> list[int]:
        """
        The next `count` indices of the stream whose `key` (e.g. the prompt's fingerprint) is not in `exclude`; the
        keys taken are added to `exclude`. Indices passed over are consumed. Once every row has been passed over (all
        are excluded: a dataset smaller than the batch), the next indices are taken as they come.
        """
        indices, passed_over = [], 0
        while len(indices) < count:
            index = self.next_index()
            index_key = key(index)
            if index_key in exclude and passed_over < 2 * self.dataset_size:  # 2 passes' worth: every row was seen
                passed_over += 1
                continue
            exclude.add(index_key)
            indices.append(index)
        return indices


def prompt_key(prompt) -> int:
    """A 64-bit fingerprint of a prompt (a string or a list of chat messages), equal for equal prompts everywhere."""
    digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def select_groups(batch: dict, groups: Sequence[int], num_generations: int) -> dict:
    """
    The rows of `groups` (whole groups, in the given order) of a scored batch from `_generate_and_score_completions`.

    Per-sample entries (tensors whose first dimension is the number of rows, and lists of that length) are indexed;
    0-d tensors are batch totals (e.g. `num_items_in_batch`) that no longer apply to the selection, and are dropped:
    recompute them. `None` entries stay `None`. Multimodal entries are not supported.
    """
    unsupported = sorted(k for k in batch if k in MULTIMODAL_KEYS)
    if unsupported:
        raise ValueError(f"Dynamic sampling supports text-only batches; this batch has {unsupported}.")
    num_rows = len(batch["completion_ids"])
    if groups and not 0 <= min(groups) <= max(groups) < num_rows // num_generations:
        raise IndexError(
            f"Groups {list(groups)} are out of range for a batch of {num_rows // num_generations} groups."
        )
    rows = [g * num_generations + j for g in groups for j in range(num_generations)]
    selected = {}
    for key, value in batch.items():
        if value is None:
            selected[key] = None
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            continue
        elif len(value) != num_rows:
            raise ValueError(f"Entry {key!r} has {len(value)} rows; expected {num_rows} (one per completion).")
        elif isinstance(value, torch.Tensor):
            selected[key] = value[torch.tensor(rows, dtype=torch.long, device=value.device)]
        else:
            selected[key] = [value[i] for i in rows]
    return selected


def concat_batches(batches: Sequence[dict], pad_token_id: int) -> dict:
    """
    Concatenates scored batches row-wise, padding 2-D entries to the widest one: prompts on the left (`prompt_ids`
    with `pad_token_id`, `prompt_mask` with 0), completion-side entries on the right (`completion_ids` with
    `pad_token_id`, `tool_mask` with 1, everything else with 0; padded positions are masked out).
    """
    if not batches:
        raise ValueError("Nothing to concatenate.")
    keys = list(batches[0])
    for batch in batches[1:]:
        if set(batch) != set(keys):
            raise ValueError(f"Batches have different entries: {sorted(keys)} vs {sorted(batch)}.")
    merged = {}
    for key in keys:
        values = [batch[key] for batch in batches]
        if all(v is None for v in values):
            merged[key] = None
        elif any(v is None for v in values):
            raise ValueError(f"Entry {key!r} is None in some batches only.")
        elif not isinstance(values[0], torch.Tensor):
            merged[key] = [item for v in values for item in v]
        elif values[0].dim() <= 1 or len({v.shape[1:] for v in values}) == 1:
            merged[key] = torch.cat(values, dim=0)
        else:
            if key.endswith("_ids"):
                padding_value = pad_token_id
            elif key == "tool_mask":
                padding_value = 1
            else:
                padding_value = 0
            side = "left" if key in LEFT_PADDED_KEYS else "right"
            merged[key] = pad([row for v in values for row in v], padding_value=padding_value, padding_side=side)
    return merged


def num_loss_tokens(batch: dict) -> torch.Tensor:
    """Local number of completion tokens that enter the loss (TRL's `num_items_in_batch` before the gather)."""
    mask = batch["completion_mask"]
    if batch.get("tool_mask") is not None:
        mask = mask * batch["tool_mask"]
    return mask.sum()


def weighted_reward_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward as GRPOTrainer sums it: the weighted sum of its reward functions' values, NaN (an
    unscorable completion) where every function returned None."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def _signal_rewards(trainer, rewards_per_func: torch.Tensor, metric: str | None) -> torch.Tensor:
    """The per-completion rewards (gathered over processes) that decide which groups have signal."""
    if metric is None:
        return weighted_reward_sum(rewards_per_func, trainer.reward_weights)
    if metric not in trainer.reward_func_names:
        raise ValueError(
            f"`dynamic_sampling_metric={metric!r}` is not one of the reward functions {trainer.reward_func_names}. "
            "Use one of these names (e.g. 'accuracy_reward', the paper's filter) or None for the weighted sum."
        )
    return rewards_per_func[:, trainer.reward_func_names.index(metric)]


def _batch_prompt_keys(trainer, inputs: list) -> set:
    """Fingerprints of the prompts of the data loader's batch, every process's (a collective call)."""
    accelerator = trainer.accelerator
    local = [prompt_key(row["prompt"]) for row in inputs[:: trainer.num_generations]]
    return set(accelerator.gather(torch.tensor(local, dtype=torch.long, device=accelerator.device)).tolist())


def _draw_extra_inputs(trainer, groups_per_process: int, exclude: set) -> list:
    """Local inputs for an extra round: the next `groups_per_process` prompts of this process's slice of the trainer's
    [`PromptStream`] (prompts in `exclude` passed over), each repeated G times."""
    import datasets

    dataset = trainer.train_dataset
    if isinstance(dataset, torch.utils.data.IterableDataset | datasets.IterableDataset):
        raise ValueError(
            "Dynamic sampling draws replacement prompts by index and needs a map-style training dataset; got an "
            "iterable dataset. Load it without `streaming=True`, or set `dynamic_sampling=False`."
        )
    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
        collate = trainer.data_collator
    else:
        collate = trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
    stream = trainer.prompt_stream
    if stream is None or stream.dataset_size != len(dataset):
        stream = trainer.prompt_stream = PromptStream(len(dataset), trainer.args.seed)
    rows = {}

    def key(index):
        rows[index] = dataset[index]
        return prompt_key(rows[index]["prompt"])

    accelerator = trainer.accelerator
    indices = stream.take(groups_per_process * accelerator.num_processes, key, exclude)
    local = indices[
        accelerator.process_index * groups_per_process : (accelerator.process_index + 1) * groups_per_process
    ]
    return collate([rows[i] for i in local for _ in range(trainer.num_generations)])


def generate_with_dynamic_sampling(
    trainer, generate_round: Callable[[list], tuple[dict, torch.Tensor]], inputs: list
) -> dict:
    """
    DAPO dynamic sampling around a GRPO trainer's generation rounds (see the module docstring).

    Args:
        trainer ([`~trl.GRPOTrainer`]):
            The trainer: its `args` has `dynamic_sampling_max_rounds` and `dynamic_sampling_metric`, and its
            `prompt_stream` attribute holds the [`PromptStream`] of replacement prompts (None until the first extra
            round creates it; see [`DynamicSamplingMixin`]).
        generate_round (`Callable[[list], tuple[dict, torch.Tensor]]`):
            One generation round: local inputs in; out, the scored local batch (the parent's
            `_generate_and_score_completions`) and the round's rewards, `(completions of all processes, reward
            functions)`, gathered over processes in process order (what `_calculate_rewards` returns).
        inputs (`list`):
            The local generation batch from the training dataloader.

    Returns:
        `dict`: A scored local batch of `len(inputs)` rows (the same entries as `generate_round`'s), made of whole
        groups, with `num_items_in_batch` recomputed for it.
    """
    args = trainer.args
    num_generations = trainer.num_generations
    if len(inputs) % num_generations != 0:
        raise ValueError(
            f"The local generation batch has {len(inputs)} rows, not a multiple of num_generations={num_generations}: "
            "groups would straddle processes. Make per_device_train_batch_size * steps_per_generation a multiple of "
            "num_generations."
        )
    accelerator = trainer.accelerator
    num_processes, process_index = accelerator.num_processes, accelerator.process_index
    groups_needed = len(inputs) // num_generations

    outputs, local_signals = [], []
    kept_per_process = torch.zeros(num_processes, dtype=torch.long)
    generated = 0
    round_inputs = inputs
    in_batch = None  # fingerprints of the batch's prompts, gathered at the first extra round
    for round_index in range(1, args.dynamic_sampling_max_rounds + 1):
        batch, rewards_per_func = generate_round(round_inputs)
        outputs.append(batch)
        # Gathered over processes in process order, so every process sees the same (P, groups per process) table.
        rewards = _signal_rewards(trainer, rewards_per_func, args.dynamic_sampling_metric)
        signal = groups_with_signal(rewards, num_generations)
        signal = signal.view(num_processes, -1).cpu()
        local_signals.append(signal[process_index])
        kept_per_process += signal.sum(dim=1)
        generated += signal.numel()
        missing = int((groups_needed - kept_per_process).clamp(min=0).max())
        if missing == 0 or round_index == args.dynamic_sampling_max_rounds:
            break
        kept_fraction = kept_per_process.sum().item() / generated
        if in_batch is None:
            in_batch = _batch_prompt_keys(trainer, inputs)
        round_inputs = _draw_extra_inputs(trainer, groups_to_draw(missing, kept_fraction, groups_needed), in_batch)

    picks, _ = choose_groups(local_signals, groups_needed)
    pieces = [select_groups(out, p, num_generations) for out, p in zip(outputs, picks) if p]
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # a processor holds one
    batch = concat_batches(pieces, tokenizer.pad_token_id)
    batch["num_items_in_batch"] = accelerator.gather(num_loss_tokens(batch)).sum()

    fillers = (groups_needed - kept_per_process).clamp(min=0).sum().item()
    metrics = trainer._metrics["train"]
    metrics["dynamic_sampling/rounds"].append(float(len(outputs)))
    metrics["dynamic_sampling/kept_fraction"].append(kept_per_process.sum().item() / generated)
    metrics["dynamic_sampling/filled_fraction"].append(fillers / (groups_needed * num_processes))
    return batch


@dataclass
class DynamicSamplingArguments:
    """The configuration fields of DAPO dynamic sampling (Yu et al., 2025; the paper's runs, Sec. 5), as a mixin of a
    `GRPOConfig` subclass. Shared by [`~rpg_trl.RPGConfig`], the REINFORCE++ baselines of the project's research
    package and the baseline configurations of the project's math example (`rpg_math.py`); [`~rpg_trl.RPGTrainer`] and
    [`DynamicSamplingMixin`] read them."""

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: drop the groups whose rewards are all equal (accuracy all 0 or all 1: zero "
            "advantage) and generate completions for new training prompts until every generation batch is full of "
            "groups with signal, for at most `dynamic_sampling_max_rounds` generation rounds. Default False (TRL's "
            "sampling); the paper's runs use it. Requires per_device_train_batch_size * steps_per_generation to be a "
            "multiple of num_generations and a map-style training dataset."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=20,
        metadata={
            "help": "Most generation rounds (the first included) per generation batch with `dynamic_sampling`; if the "
            "batch is still short after the last round it is filled with zero-variance groups (advantage 0) and "
            "`dynamic_sampling/filled_fraction` says how many. Default 20 (the paper's setup)."
        },
    )
    dynamic_sampling_metric: str | None = field(
        default=None,
        metadata={
            "help": "Name of the reward function whose per-group variance decides which groups are kept (e.g. "
            "'accuracy_reward', DAPO's and the paper's filter on accuracy, so that an overlong penalty alone does not "
            "keep a group). None (default): the weighted sum of all rewards (TRL's `reward`)."
        },
    )

    def check_dynamic_sampling_arguments(self) -> None:
        """Validate the dynamic-sampling fields against the batch geometry of the TRL config they are mixed into."""
        max_rounds = self.dynamic_sampling_max_rounds
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(
                f"`dynamic_sampling_max_rounds` must be an integer >= 1 (generation rounds per batch, the first "
                f"included; the paper uses 20); got {max_rounds!r}."
            )
        local_generation_batch = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and local_generation_batch % self.num_generations != 0:
            raise ValueError(
                f"`dynamic_sampling` keeps or drops whole groups on the process that generated them, so each process's "
                f"generation batch (per_device_train_batch_size * steps_per_generation = {local_generation_batch}) "
                f"must be a multiple of num_generations ({self.num_generations}). Change per_device_train_batch_size "
                "or steps_per_generation (or generation_batch_size)."
            )


#: File, inside a checkpoint folder, where [`DynamicSamplingMixin`] saves its [`PromptStream`]'s position.
PROMPT_STREAM_FILE = "rpg_prompt_stream.json"


class DynamicSamplingMixin:
    """
    Adds DAPO dynamic sampling to a [`~trl.GRPOTrainer`] subclass, e.g. `class DAPOTrainer(DynamicSamplingMixin,
    GRPOTrainer)`. Its `args` must carry [`~rpg_trl.RPGConfig`]'s `dynamic_sampling`, `dynamic_sampling_max_rounds` and
    `dynamic_sampling_metric` ([`DynamicSamplingArguments`]; a plain `GRPOConfig` has none of them:
    sampling is then TRL's).

    Its state is its own: `prompt_stream`, where the replacement prompts continue, is saved with the RNG state of each
    checkpoint ([`PROMPT_STREAM_FILE`]) and restored on resume, so a resumed run draws what the interrupted one would
    have. Subclasses see each generation round through one public hook, [`score_generation_round`], which receives
    the round's scored batch and its gathered rewards before groups are chosen (the baselines add per-completion
    columns there).
    """

    #: The replacement prompts of dynamic sampling ([`PromptStream`]); None until the first extra round needs one.
    prompt_stream: PromptStream | None = None

    def score_generation_round(self, batch: dict, rewards_per_func: torch.Tensor) -> dict:
        """Hook called once per generation round (training and evaluation, with or without dynamic sampling) with
        the round's scored local batch and its rewards `(completions of all processes, reward functions)`, gathered
        over processes; returns the batch, to which a subclass may add per-completion entries (tensors or lists with
        one row per completion: they are kept or dropped with their group). The default returns it unchanged."""
        return batch

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._round_rewards_per_func = rewards_per_func  # gathered over processes; handed on by `_generate_round`
        return rewards_per_func

    def _generate_round(self, inputs) -> tuple[dict, torch.Tensor]:
        """One round of the parent's `_generate_and_score_completions`, passed through [`score_generation_round`];
        returns the batch and the round's gathered rewards."""
        self._round_rewards_per_func = None
        batch = super()._generate_and_score_completions(inputs)
        rewards_per_func = self._round_rewards_per_func
        if rewards_per_func is None:
            raise RuntimeError(
                f"{type(self).__name__}._generate_and_score_completions did not call `_calculate_rewards`: dynamic "
                "sampling needs the rewards of each round. Put DynamicSamplingMixin before GRPOTrainer in the class "
                "line, and call `super()._calculate_rewards` in overrides."
            )
        return self.score_generation_round(batch, rewards_per_func), rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if getattr(self.args, "dynamic_sampling", False) and self.model.training:
            return generate_with_dynamic_sampling(self, self._generate_round, inputs)
        return self._generate_round(inputs)[0]

    def _save_rng_state(self, output_dir):
        # Where the replacement prompts continue is sampling state, like the RNG: saved with it, by the processes that
        # write the checkpoint (the stream is the same on every process), read by every process on resume.
        super()._save_rng_state(output_dir)
        if self.prompt_stream is not None and self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, PROMPT_STREAM_FILE), "w") as f:
                json.dump(self.prompt_stream.state_dict(), f)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, PROMPT_STREAM_FILE)
        if path is not None and os.path.isfile(path):
            with open(path) as f:
                self.prompt_stream = PromptStream(**json.load(f))
