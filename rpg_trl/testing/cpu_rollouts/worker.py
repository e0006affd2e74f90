# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""Run TRL's asynchronous trainers without a vLLM server: an in-process rollout worker at a fixed policy lag.

TRL's [`~trl.experimental.async_grpo.AsyncGRPOTrainer`] (and so [`AsyncRPGTrainer`]) samples from a vLLM server. This
module replaces the server by a local worker, through the trainer's own extension points (`rollout_worker`,
`weight_transfer`), so that the asynchronous trainers run on a CPU (with [`~rpg_trl.testing.cpu_rollouts.cpu_backend`]
for the attention kernel): for the tests, and for the research package's benchmark `rpg-trl bench-async`.

* [`LocalRolloutWorker`] (a [`~trl.experimental.async_grpo.async_grpo_trainer.RolloutWorkerProtocol`]): a thread
  that keeps its own copy of the policy (SDPA attention), samples completions with transformers' `generate`, scores
  them with the reward functions and pushes TRL `RolloutSample`s (with the sampler's log-probabilities, computed by a
  forward pass at the sampling temperature) onto the trainer's queue. The samples of optimizer step `s` are drawn from
  policy version `max(1, s - lag)`: every batch after the first `lag` ones is exactly `lag` versions stale, whatever
  the relative speed of generation and training, which makes the staleness a controlled variable.
* [`LocalWeightTransfer`] (a `WeightTransferProtocol`): each weight sync copies the trainer's parameters into
  [`PolicyVersions`], where the worker finds them by version number (under a lock shared with the worker).

Sampling draws Gumbel noise from the worker's own `torch.Generator` (the Gumbel-max trick, exact sampling at the
temperature), so a run is reproducible from its seed even though the worker thread and the trainer share the process
(the global RNG is left alone).
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------------------------------
# Weight transfer
# ----------------------------------------------------------------------------------------------------------------------


class PolicyVersions:
    """The policy versions the trainer published, by version number, for the local rollout worker.

    A weight sync stages a copy of the parameters ([`stage`]); the trainer's version bump that follows
    (`update_model_version`) files it under its number ([`commit`]). [`wait_for`] blocks until a version exists.
    Versions older than the oldest one still wanted are dropped ([`release_before`]).
    """

    def __init__(self):
        self._condition = threading.Condition()
        self._staged: dict[str, torch.Tensor] | None = None
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._closed = False

    def stage(self, weights: dict[str, torch.Tensor]) -> None:
        with self._condition:
            self._staged = weights

    def commit(self, version: int) -> None:
        with self._condition:
            if self._staged is None:
                raise RuntimeError(
                    f"Policy version {version} was announced but no weights were sent before it: pass the worker's "
                    "`weight_transfer` to the trainer together with the worker."
                )
            self._versions[version], self._staged = self._staged, None
            self._condition.notify_all()

    def wait_for(self, version: int, stop: threading.Event) -> dict[str, torch.Tensor] | None:
        """The weights of `version`, once published; `None` if `stop` is set (or [`close`] called) first."""
        with self._condition:
            while version not in self._versions:
                if stop.is_set() or self._closed:
                    return None
                self._condition.wait(timeout=0.5)
            return self._versions[version]

    def release_before(self, version: int) -> None:
        with self._condition:
            for old in [v for v in self._versions if v < version]:
                del self._versions[old]

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()


class LocalWeightTransfer:
    """`WeightTransferProtocol` of [`LocalRolloutWorker`]: each sync copies the trainer's parameters (the
    `(name, tensor)` stream of `AsyncGRPOTrainer._streaming_iter`) to the CPU, into [`PolicyVersions`]."""

    def __init__(self, versions: PolicyVersions):
        self.versions = versions

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass  # nothing to pause: the worker reads committed versions only, never the one being sent

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.versions.stage({name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator})

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        self.versions.close()


# ----------------------------------------------------------------------------------------------------------------------
# Rollout worker
# ----------------------------------------------------------------------------------------------------------------------


def _gumbel_sampler(generator: torch.Generator, temperature: float):
    """A logits processor that turns greedy decoding into exact sampling at `temperature` (Gumbel-max trick) with the
    random stream of `generator`."""
    from transformers import LogitsProcessor

    class GumbelSampler(LogitsProcessor):
        def __call__(self, input_ids, scores):
            uniform = torch.rand(scores.shape, generator=generator, dtype=torch.float32).to(scores.device)
            gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
            return scores.float() / temperature + gumbel

    return GumbelSampler()


class LocalRolloutWorker:
    """
    In-process rollout worker for [`AsyncGRPOTrainer`] / [`AsyncRPGTrainer`] (module docstring): samples with
    transformers' `generate` from its own copy of the policy, `lag` policy versions behind the trainer.

    Pass both the worker and its [`weight_transfer`] to the trainer:

    ```python
    worker = LocalRolloutWorker("path/to/model", tokenizer, dataset, [reward], num_generations=8, samples_per_step=64,
                                max_completion_length=4, lag=2)
    with cpu_backend():
        trainer = AsyncRPGTrainer("path/to/model", args=config, train_dataset=dataset, processing_class=tokenizer,
                                  rollout_worker=worker, weight_transfer=worker.weight_transfer)
        trainer.train()
    ```

    Args:
        model (`str` or `PreTrainedModel`): the policy, as a path/id loaded with SDPA attention (the worker's own
            copy), or a model the worker may use as its own (it is overwritten by every weight sync).
        processing_class: the tokenizer (left padding).
        train_dataset: prompts (`prompt` column: text or a conversation), with any extra column passed to the reward
            functions as TRL does. Cycled in an order reshuffled every pass with `seed`.
        reward_funcs: functions `f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]`;
            their sum is the reward (`None` is skipped; all `None` gives the advantage 0, as in TRL's worker).
        num_generations: completions per prompt (a group).
        samples_per_step: completions consumed per optimizer step (`per_device_train_batch_size ×
            gradient_accumulation_steps × processes` with the trainer's `token_budget=0`), a multiple of
            `num_generations`.
        max_completion_length: most new tokens per completion.
        lag: policy versions between the sampler and the trainer (>= 1): step `s` trains on samples of version
            `max(1, s - lag)`. The trainer's `max_staleness` must be >= `lag`.
        temperature: sampling temperature (the trainer's `temperature`, which scales its log-probabilities).
        scale_rewards: `"none"`: advantage = reward − group mean (the paper's, Sec. 5); `"group"`: divided by the
            group's standard deviation too (TRL's `AsyncRolloutWorker`).
        seed: seed of the prompt order and of the sampling.
    """

    def __init__(
        self,
        model,
        processing_class,
        train_dataset,
        reward_funcs: Callable | list[Callable],
        *,
        num_generations: int,
        samples_per_step: int,
        max_completion_length: int,
        lag: int = 1,
        temperature: float = 1.0,
        scale_rewards: str = "none",
        seed: int = 0,
        queue_maxsize: int = 0,
    ):
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(
                f"`lag` must be an integer >= 1 (policy versions between sampler and trainer; 0 would make the "
                f"trainer wait for samples of the policy it is computing); got {lag!r}."
            )
        if num_generations < 1 or samples_per_step < num_generations or samples_per_step % num_generations:
            raise ValueError(
                f"`samples_per_step` ({samples_per_step}) must be a positive multiple of `num_generations` "
                f"({num_generations}): a group of completions is consumed within one optimizer step."
            )
        if scale_rewards not in ("none", "group"):
            raise ValueError(f"`scale_rewards` must be 'none' or 'group'; got {scale_rewards!r}.")
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0; got {temperature!r}.")
        if train_dataset is None or "prompt" not in train_dataset.column_names:
            raise ValueError("`train_dataset` must have a `prompt` column.")
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", dtype=torch.float32)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = processing_class
        self.dataset = train_dataset
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.num_generations = num_generations
        self.groups_per_step = samples_per_step // num_generations
        self.max_completion_length = max_completion_length
        self.lag = lag
        self.temperature = temperature
        self.scale_rewards = scale_rewards
        self.seed = seed

        self.versions = PolicyVersions()
        self.weight_transfer = LocalWeightTransfer(self.versions)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        #: The trainer's policy version, as last announced by `update_model_version`.
        self.model_version = 0
        #: `(optimizer step, policy version)` of each step's samples, in the order they were generated.
        self.sampled_versions: list[tuple[int, int]] = []
        self._generator = torch.Generator().manual_seed(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_heartbeat = time.monotonic()
        self._lock = threading.Lock()  # guards the worker's model while weights are loaded into it or it samples

    # RolloutWorkerProtocol ------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LocalRolloutWorker.start() was called twice; build one worker per training run.")
        self._thread = threading.Thread(target=self._run, name="local-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.versions.close()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def update_model_version(self, model_version: int) -> None:
        self.versions.commit(model_version)
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"The local rollout worker failed: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("The local rollout worker thread stopped unexpectedly.")
        if time.monotonic() - self._last_heartbeat > stale_after_s:
            raise RuntimeError(f"The local rollout worker produced nothing for {stale_after_s:.0f} s.")

    # The loop -------------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            step, group_id = 0, 0
            prompts = self._prompt_indices()
            while not self._stop.is_set():
                step += 1
                version = max(1, step - self.lag)
                weights = self.versions.wait_for(version, self._stop)
                if weights is None:
                    return
                self._load(weights)
                self.versions.release_before(version)
                indices = [next(prompts) for _ in range(self.groups_per_step)]
                start = time.perf_counter()
                samples = self._rollout(indices, version, first_group_id=group_id)
                group_id += len(indices)
                self.sampled_versions.append((step, version))
                self.metrics_queue.put({"rollout/generation_s": time.perf_counter() - start})
                for sample in samples:
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                self._last_heartbeat = time.monotonic()
        except BaseException as error:  # noqa: BLE001 - reported to the trainer by check_health
            self._error = error

    def _prompt_indices(self) -> Iterator[int]:
        epoch = 0
        while True:
            order = list(range(len(self.dataset)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            yield from order
            epoch += 1

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        parameters = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(parameters))
        if unknown:
            raise KeyError(f"The trainer sent parameters the worker's model does not have: {unknown[:5]}")
        with self._lock, torch.no_grad():
            for name, tensor in weights.items():
                parameters[name].copy_(tensor)

    def _prompt_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def _rollout(self, indices: list[int], version: int, first_group_id: int) -> list:
        from transformers import GenerationConfig
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        rows = [self.dataset[i] for i in indices]
        texts = [self._prompt_text(row["prompt"]) for row in rows]
        tokenizer, G = self.tokenizer, self.num_generations
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_ids = encoded["input_ids"].repeat_interleave(G, 0)
        prompt_mask = encoded["attention_mask"].repeat_interleave(G, 0)
        eos = tokenizer.eos_token_id
        config = GenerationConfig(
            max_new_tokens=self.max_completion_length,
            do_sample=False,  # sampling is done by the Gumbel processor, with the worker's own generator
            temperature=None,
            top_k=None,
            top_p=None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        with self._lock:
            output = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                logits_processor=[_gumbel_sampler(self._generator, self.temperature)],
            )
        completion_ids = []
        for row in output[:, prompt_ids.size(1) :].tolist():
            completion_ids.append(row[: row.index(eos) + 1] if eos in row else row)
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        sequences = [p + c for p, c in zip(prompts, completion_ids, strict=True)]
        logps = self._sampling_log_probs(sequences, [len(p) for p in prompts])

        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompt_column = [row["prompt"] for row in rows for _ in range(G)]
        columns = {
            key: [row[key] for row in rows for _ in range(G)] for key in self.dataset.column_names if key != "prompt"
        }
        per_func = []
        for func in self.reward_funcs:
            values = func(prompts=prompt_column, completions=completions, completion_ids=completion_ids, **columns)
            per_func.append([math.nan if v is None else float(v) for v in values])
        scores = np.array(per_func, dtype=float).reshape(len(self.reward_funcs), -1)
        unscored = np.all(np.isnan(scores), axis=0)
        rewards = np.where(unscored, np.nan, np.nansum(scores, axis=0))

        samples = []
        for g in range(len(rows)):
            group = slice(g * G, (g + 1) * G)
            group_rewards = rewards[group]
            scored = ~np.isnan(group_rewards)
            advantages = np.zeros(G)
            mean = std = math.nan
            if scored.any():
                mean, std = float(group_rewards[scored].mean()), float(group_rewards[scored].std())
                advantages[scored] = group_rewards[scored] - mean
                if self.scale_rewards == "group":
                    advantages[scored] /= std + 1e-8
            for j in range(G):
                i = g * G + j
                prompt_length = len(prompts[i])
                metrics = {"reward": float(rewards[i]), "reward_std": std}
                for func, values in zip(self.reward_funcs, per_func, strict=True):
                    metrics[f"rewards/{getattr(func, '__name__', type(func).__name__)}"] = values[i]
                samples.append(
                    RolloutSample(
                        prompt=[{"role": "user", "content": texts[g]}],
                        completion=[{"role": "assistant", "content": completions[i]}],
                        input_ids=np.asarray(sequences[i], dtype=np.int64),
                        completion_mask=np.asarray([0] * prompt_length + [1] * len(completion_ids[i]), dtype=np.int64),
                        old_log_probs=np.asarray([0.0] * prompt_length + logps[i], dtype=np.float32),
                        advantage=float(advantages[j]),
                        model_version=version,
                        group_id=first_group_id + g,
                        metrics=metrics,
                        enqueued_at=time.time(),
                    )
                )
        return samples

    def _sampling_log_probs(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
        """log π(token | prefix) at the sampling temperature of the completion tokens of each sequence (those after
        its prompt), from one forward pass of the worker's model (right padding)."""
        length = max(map(len, sequences))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([s + [pad] * (length - len(s)) for s in sequences])
        attention_mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in sequences])
        with self._lock:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        logps = torch.log_softmax(logits[:, :-1] / self.temperature, dim=-1)
        logps = logps.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).tolist()
        return [row[start - 1 : len(s) - 1] for row, start, s in zip(logps, prompt_lengths, sequences, strict=True)]
