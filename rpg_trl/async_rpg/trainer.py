# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The [`AsyncRPGTrainer`]: TRL's asynchronous GRPO trainer with the RPG loss."""

from __future__ import annotations

import math
import time

import torch
from accelerate.utils import is_peft_model
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TREE_ATTENTION
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, pad

from ..losses import aggregate_loss, rpg_per_token_loss, summarize_stats
from ..losses.surrogate import TOKEN_MEAN_METRICS, nan_extreme
from ..reliability.checkpoints import CommittedCheckpointsMixin
from ..reliability.importance_weights import ImportanceWeightMonitorMixin
from ..reliability.kl_drift import KLDriftMonitorMixin
from ..reliability.process_failure import watching
from ..reliability.vllm_server import (
    ProbeWhileWaiting,
    server_errors_named,
    watch_for_server_failure,
    weight_sync_deadline,
)
from ..trainer import RPGTrainer
from .config import AsyncRPGConfig
from .rollouts import POLL_INTERVAL, NamedWorkerFailure, bound_rollout_requests, guard_worker_stop


#: Key under which a rollout sample's policy version rides in its per-sample `metrics` from the rollout queue to the
#: collator (the only per-sample field TRL's `RolloutQueueDataset` passes through); removed there before TRL's
#: collator logs the metrics.
POLICY_VERSION_KEY = "__rpg_trl_policy_version__"
#: Batch column of the policy version of each sample of a row, `-1` for padding (shape `(processes, samples)`).
SAMPLE_VERSION_COLUMN = "sample_model_version"


class _VersionStampingQueue:
    """The rollout queue as the trainer's data pipeline reads it: each sample's `model_version` is copied into a new
    `metrics` dict of the sample, under [`POLICY_VERSION_KEY`]."""

    def __init__(self, rollout_queue):
        self.queue = rollout_queue

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        sample.metrics = {**sample.metrics, POLICY_VERSION_KEY: float(sample.model_version)}
        return sample

    def __getattr__(self, name):
        return getattr(self.queue, name)


class _PolicyVersionCollator:
    """TRL's `DataCollatorForRollout`, plus the column [`SAMPLE_VERSION_COLUMN`]: the policy version of each sample
    of each row, in the order of the row's `segment_id`s."""

    def __init__(self, collator: DataCollatorForRollout):
        self.collator = collator

    def __call__(self, examples):
        (rows,) = examples
        versions = [[int(example["metrics"].pop(POLICY_VERSION_KEY, -1)) for example in row.samples] for row in rows]
        batch = self.collator(examples)
        batch[SAMPLE_VERSION_COLUMN] = pad([torch.tensor(v, dtype=torch.long) for v in versions], padding_value=-1)
        return batch


class AsyncRPGTrainer(CommittedCheckpointsMixin, ImportanceWeightMonitorMixin, KLDriftMonitorMixin, AsyncGRPOTrainer):
    """
    Trainer for Regularized Policy Gradient (RPG) with asynchronous rollouts.

    RPG ([On the Design of KL-Regularized Policy Gradient Algorithms for LLM
    Reasoning](https://huggingface.co/papers/2505.17508)) gives the importance-weighted surrogates whose gradient is
    exactly that of a KL-regularised objective when the data come from an older policy π_old ≠ π_θ, which is what an
    asynchronous trainer trains on: every rollout was sampled by a policy version that lags the trainer. The only
    change w.r.t. TRL's [`~trl.experimental.async_grpo.AsyncGRPOTrainer`] is the loss on the packed token stream
    (`compute_loss`, which calls [`rpg_trl.losses.rpg_per_token_loss`]): π_old is the sampler, whose log-probabilities
    the rollout samples carry, and the KL is anchored to it (`kl_anchor="sampling"`, the default) or to a frozen copy
    of the initial model (`kl_anchor="reference"`). It logs RPG's metrics (`kl`, `clip_ratio/*`,
    `importance_weight/*`) and the policy-version lag of each batch (`staleness/mean`, `staleness/max`).

    Rollouts, vLLM, weight sync, packing, PEFT, FSDP and the rest of the pipeline are inherited unchanged. With
    `beta=0`, `estimator="differentiable"` and a `clip_c` too large to act, the loss and its gradient are
    AsyncGRPOTrainer's (RPG-Style Clip reduces to PPO's clip). Checkpoints count once every process has written them
    ([`~rpg_trl.reliability.checkpoints.CommittedCheckpointsMixin`], as for [`~rpg_trl.RPGTrainer`]).
    """

    _tag_names = ["trl", "async-grpo", "rpg"]
    _name = "AsyncRPG"
    _paper = RPGTrainer._paper  # the RPG paper's title, id and citation, declared once

    def __init__(self, model: str, reward_funcs=None, args: AsyncRPGConfig | None = None, **kwargs):
        if args is None:
            args = AsyncRPGConfig(f"{model.split('/')[-1]}-AsyncRPG")
        elif not isinstance(args, AsyncRPGConfig):
            hint = (
                " Replace `AsyncGRPOConfig(...)` by `AsyncRPGConfig(...)`."
                if isinstance(args, AsyncGRPOConfig)
                else ""
            )
            raise TypeError(
                f"`args` must be an `AsyncRPGConfig` (TRL's `AsyncGRPOConfig` with RPG's fields); got "
                f"{type(args).__name__}.{hint}"
            )
        #: The RPG loss (divergence, estimator, β, clip), built once from `args`.
        self.loss_spec = args.rpg_loss_spec()
        self._tag_names = [*type(self)._tag_names, self.loss_spec.paper_name.lower()]
        super().__init__(model, reward_funcs, args=args, **kwargs)
        #: The vLLM server that TRL's rollout worker samples from or TRL's weight transfer pushes to (None when both
        #: are injected, e.g. `rpg_trl.testing.cpu_rollouts`): a weight sync probes it first and names it when it stops
        #: answering.
        uses_server = kwargs.get("rollout_worker") is None or kwargs.get("weight_transfer") is None
        self._vllm_server_url = args.vllm_server_base_url if uses_server else None
        if self._vllm_server_url is not None:  # every process stops, naming it, when it fails in a weight sync
            watch_for_server_failure(self, self._vllm_server_url)
        #: Whether TRL's rollout worker (main process) bounds its completion requests by `vllm_request_timeout` and
        #: ends, naming the server, when one hangs or keeps failing (`rpg_trl.async_rpg.rollouts`).
        self._rollout_requests_bounded = bound_rollout_requests(self.rollout_worker, args.vllm_request_timeout)
        guard_worker_stop(self.rollout_worker)  # a worker that failed is joined, not waited on forever
        #: Frozen KL anchor with `kl_anchor="reference"` (None with PEFT: the base model, adapter disabled).
        self.ref_model = None
        if args.kl_anchor == "reference" and not is_peft_model(self.accelerator.unwrap_model(self.model)):
            self.ref_model = self._create_reference_model(model)

    def train(self, *args, **kwargs):
        # The failure watcher (processes other than the main one) is stopped and joined when training ends.
        with watching(self):
            return super().train(*args, **kwargs)

    def _sync_weight(self):
        # A dead server raises `VLLMServerError` with its URL on every process at once (TRL: a bare `requests` error on
        # the main process while the others wait in a barrier); a transfer that hangs instead is ended, named, after
        # `weight_sync_timeout` seconds.
        if self._vllm_server_url is None:
            return super()._sync_weight()
        url = self._vllm_server_url
        with weight_sync_deadline(self, url, self.args.weight_sync_timeout), server_errors_named(self, url):
            return super()._sync_weight()

    def _create_reference_model(self, model_id: str):
        """A frozen copy of the initial policy, loaded as the parent loads the policy (tree attention, fused head)."""
        init_kwargs = dict(self.args.model_init_kwargs or {})
        init_kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
        init_kwargs.setdefault("dtype", self.args.dtype)
        ref_model = create_model_from_path(
            model_id, device_map=None, attn_implementation=TREE_ATTENTION, **init_kwargs
        )
        add_fused_lm_head(ref_model, temperature=self.temperature, outputs=("log_probs",))
        ref_model.requires_grad_(False).eval()
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def get_train_dataloader(self):
        # Each sample's policy version goes with it to the loss (for `staleness/*`): stamped when the sample leaves the
        # rollout queue, turned into the batch column `sample_model_version` by the collator.
        if self.accelerator.is_main_process and not isinstance(self.rollout_queue, _VersionStampingQueue):
            self.rollout_queue = _VersionStampingQueue(self.rollout_queue)
        dataloader = super().get_train_dataloader()
        loader = getattr(dataloader, "base_dataloader", dataloader)  # accelerate's DataLoaderDispatcher wraps it
        if not isinstance(loader.collate_fn, DataCollatorForRollout | _PolicyVersionCollator):
            raise TypeError(
                f"AsyncRPGTrainer expects AsyncGRPOTrainer's DataCollatorForRollout (TRL 1.16); got "
                f"{type(loader.collate_fn).__name__}."
            )
        if isinstance(loader.collate_fn, DataCollatorForRollout):
            loader.collate_fn = _PolicyVersionCollator(loader.collate_fn)
        dataset = self._rollout_dataset if self.accelerator.is_main_process else None  # TRL's view of the queue
        # A worker that ended on a bounded request (`vllm_request_timeout`) is raised as the `VLLMServerError` it ended
        # on, and looked at every second (TRL: 5 s) while the queue is empty, so that the error comes within the bound.
        if (
            self._rollout_requests_bounded
            and dataset is not None
            and dataset.check_health_fn == self.rollout_worker.check_health
        ):
            dataset.check_health_fn = NamedWorkerFailure(self.rollout_worker, self)
            dataset.poll_interval_s = min(dataset.poll_interval_s, POLL_INTERVAL)
        # While the main process waits on an empty queue: the server probed too, and a failure told to every process.
        probing = isinstance(getattr(dataset, "check_health_fn", None), ProbeWhileWaiting)
        if self._vllm_server_url is not None and dataset is not None and not probing:
            dataset.check_health_fn = ProbeWhileWaiting(dataset.check_health_fn, self, self._vllm_server_url)
        return dataloader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The RPG loss (paper Sec. 3-4, Eq. 4.1 for the REINFORCE estimator) on one packed micro-batch.

        The inputs are AsyncGRPOTrainer's packed row (TRL 1.16): the forward is the parent's, then each trained token
        has `log π_θ` (`log_probs`), `log π_old` (the sampler's, `old_log_probs`) and the advantage of its completion.
        They form one (1, M) row for [`rpg_per_token_loss`]; the loss is its token mean over the micro-batch's trained
        tokens (AsyncGRPO's normaliser: the global token count per process), divided by the accumulation steps.
        """
        args: AsyncRPGConfig = self.args
        forward_inputs, terms = self._packed_row(inputs)
        token_index, segment_id = terms["token_index"], terms["segment_id"]
        old_log_probs, advantages = terms["old_log_probs"], terms["advantages"]

        forward_start = time.time()
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(**forward_inputs, fused_lm_head=True, **router_kwargs)
        log_probs = outputs.log_probs.flatten()[token_index]
        entropy = outputs.entropy.flatten()[token_index]
        self._last_forward_time_s = time.time() - forward_start
        ref_log_probs = None
        if args.kl_anchor == "reference":
            ref_log_probs = self._reference_log_probs(model, forward_inputs)[token_index]

        mask = torch.ones_like(log_probs).unsqueeze(0)
        per_token_loss, stats = rpg_per_token_loss(
            log_probs.unsqueeze(0),
            old_log_probs.unsqueeze(0),
            advantages.unsqueeze(0),
            mask,
            self.loss_spec,
            ref_logps=None if ref_log_probs is None else ref_log_probs.unsqueeze(0),
        )
        # Token mean over the micro-batch (all processes), as AsyncGRPOTrainer: each process divides its sum by the
        # global token count / world size, and DDP/FSDP average the gradients.
        global_n_tokens = inputs["global_n_tokens"][0]
        world_size = self.accelerator.num_processes
        tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0).to(torch.float32)
        loss = aggregate_loss(per_token_loss, mask, "token-mean", num_items=tokens_per_rank)
        loss = loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps

        self._log_rpg_metrics(stats, mask, entropy, segment_id, inputs.get(SAMPLE_VERSION_COLUMN))
        if self.aux_loss_enabled:
            aux = self.accelerator.reduce(outputs.aux_loss.detach().to(torch.float32), reduction="sum")
            self._metrics["train"]["aux_loss"].append((aux / world_size).item())

        # AsyncGRPOTrainer's per-step accounting, flushed by its `_log_step_metrics` (throughput, MFU).
        n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += n_forward_tokens
        self._step_trained_tokens += float(global_n_tokens)
        self._step_seq_len_weighted += mean_seq_len * n_forward_tokens
        self._step_samples += n_forward_tokens / mean_seq_len
        self._step_forward_s += self._last_forward_time_s
        return loss

    @staticmethod
    def _packed_row(inputs) -> tuple[dict, dict]:
        """This process's packed row (AsyncGRPOTrainer's batch layout, TRL 1.16) without the inter-process padding:
        the model's inputs (tokens, positions, next-token labels, tree-attention segments) and the loss terms, one per
        trained token (`token_index`: the packed position that predicts it; `old_log_probs`, `advantages`,
        `segment_id`: its completion in the row)."""
        mask = inputs["attention_mask"].bool()
        forward_inputs = {key: inputs[key][mask].unsqueeze(0) for key in ("input_ids", "position_ids", "shift_labels")}
        for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
            forward_inputs[key] = inputs[key][inputs[key] >= 0]
        forward_inputs["tree_max_seqlen_q"], forward_inputs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][
            0
        ].tolist()
        selected = inputs["token_index"] >= 0
        terms = {key: inputs[key][selected] for key in ("token_index", "old_log_probs", "advantages", "segment_id")}
        return forward_inputs, terms

    @torch.no_grad()
    def _reference_log_probs(self, model, forward_inputs) -> torch.Tensor:
        """`log π_ref` of every labelled position of the packed row (flattened), from the reference model, or from the
        policy with its adapter disabled under PEFT."""
        if self.ref_model is not None:
            return self.ref_model(**forward_inputs, fused_lm_head=True).log_probs.flatten()
        with self.accelerator.unwrap_model(model).disable_adapter():
            return model(**forward_inputs, fused_lm_head=True).log_probs.flatten()

    def _log_rpg_metrics(self, stats, mask, entropy, segment_id, sample_versions) -> None:
        """RPG's metrics (those of `RPGTrainer`) and the policy-version lag, reduced over processes."""
        metrics = self._metrics["train"]
        local = summarize_stats(stats, mask, diagnostics=False)
        count = local["num_tokens"]
        totals = [local[key] * count for key in TOKEN_MEAN_METRICS] + [entropy.detach().float().sum(), count]
        # `kl/weight_share` as a ratio of sums over the processes (the whole-completion diagnostics of RPGTrainer need
        # completions, which the packed row does not delimit for `summarize_stats`: not logged here).
        fmask = mask.to(stats["kl_gradient_weight"].dtype)
        kl_abs = (stats["kl_gradient_weight"].abs() * fmask).sum().float()
        totals += [kl_abs, kl_abs + (stats["reward_gradient_weight"].abs() * fmask).sum().float()]
        if sample_versions is not None:
            valid = sample_versions >= 0
            totals += [(sample_versions * valid).sum().float(), valid.sum().float()]
        totals = self.accelerator.reduce(torch.stack(totals), reduction="sum")
        global_count = totals[len(TOKEN_MEAN_METRICS) + 1].clamp(min=1.0)
        kl_abs, all_abs = totals[len(TOKEN_MEAN_METRICS) + 2], totals[len(TOKEN_MEAN_METRICS) + 3]
        weight_share = torch.where(all_abs > 0, kl_abs / all_abs.clamp(min=torch.finfo(all_abs.dtype).tiny), 0.0)
        weight_share = torch.where(totals[len(TOKEN_MEAN_METRICS) + 1] > 0, weight_share, math.nan)

        # Per-completion extremes of the clip fractions (as AsyncGRPOTrainer) and of the importance weight.
        num_seq = int(segment_id.max()) + 1 if segment_id.numel() else 1

        def per_sequence(values):
            sums = torch.zeros(num_seq, device=values.device).index_add_(0, segment_id, values[0].float())
            return sums / torch.zeros(num_seq, device=values.device).index_add_(0, segment_id, mask[0].float())

        extremes = torch.stack(
            [
                nan_extreme(per_sequence(stats["is_low_clipped"]), largest=False),
                nan_extreme(per_sequence(stats["is_high_clipped"]), largest=True),
                local["importance_weight/max"].float(),
                local["importance_weight/min"].float(),
            ]
        )
        extremes = self.accelerator.gather(extremes.unsqueeze(0))
        # Copied to the host at once (one synchronisation, as in RPGTrainer).
        values = torch.cat(
            [
                totals[: len(TOKEN_MEAN_METRICS) + 1] / global_count,  # the token means, then `entropy`
                torch.stack(
                    [
                        nan_extreme(extremes[:, 0], largest=False),
                        nan_extreme(extremes[:, 1], largest=True),
                        nan_extreme(extremes[:, 2], largest=True),
                        nan_extreme(extremes[:, 3], largest=False),
                        weight_share,
                    ]
                ).to(totals.dtype),
            ]
        ).tolist()
        keys = (*TOKEN_MEAN_METRICS, "entropy", "clip_ratio/low_min", "clip_ratio/high_max")
        keys += ("importance_weight/max", "importance_weight/min", "kl/weight_share")
        for key, value in zip(keys, values, strict=True):
            metrics[key].append(value)

        if sample_versions is not None:
            # Lag of the batch: the trainer's policy version (the main process keeps it; it is the one that logs)
            # minus the version that sampled each completion.
            oldest = torch.where(sample_versions >= 0, sample_versions, torch.iinfo(torch.long).max).amin()
            oldest = self.accelerator.gather(oldest.reshape(1)).amin().item()
            mean_version = (totals[-2] / totals[-1].clamp(min=1.0)).item()
            metrics["staleness/mean"].append(self.model_version - mean_version)
            metrics["staleness/max"].append(float(self.model_version - oldest))
