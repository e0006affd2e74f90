# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The [`RPGTrainer`]: TRL's GRPOTrainer with the RPG loss."""

from __future__ import annotations

import math
import textwrap
from collections import namedtuple

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from ._grpo_loss_steps import GRPOLossStepsMixin
from .config import RPGConfig
from .dynamic_sampling import DynamicSamplingMixin
from .kl_control import AdaptiveKLCallback
from .losses import rpg_per_token_loss
from .losses.surrogate import SEQUENCE_SUM_ROWS, TOKEN_MEAN_METRICS, diagnostic_metrics_of, sequence_sums
from .ref_sync import RefModelSyncCallback
from .reliability import ImportanceWeightMonitorMixin, ReliabilityMixin
from .reliability.kl_drift import KLDriftMonitorMixin
from .vocabulary_kl import VocabularyKLMixin


#: The rows of [`~rpg_trl.losses.surrogate.sequence_sums`] as the trainer calls it (one `extra` row: the entropy),
#: each a sum per completion; then the totals reduced over the processes: those rows summed, the whole-completion KL
#: estimates' sum and the number of completions with a token. Each name is its metric's numerator.
_SEQUENCE_ROWS = (*SEQUENCE_SUM_ROWS, "entropy", "reward_weight/abs_sum", "kl_weight/abs_sum", "num_tokens")
_REDUCED_TOTALS = (*TOKEN_MEAN_METRICS, *_SEQUENCE_ROWS[len(SEQUENCE_SUM_ROWS) :], "kl/sequence", "num_sequences")
assert len(TOKEN_MEAN_METRICS) == len(SEQUENCE_SUM_ROWS)  # the token means' numerators, row for row

#: What the metrics need of each completion (gathered over the processes): its fractions of low- and high-clipped
#: tokens, its number of tokens and its whole-completion log importance weight log W.
_Completion = namedtuple("_Completion", "low_clipped high_clipped num_tokens log_weight")
#: What they need of each process: its largest and smallest importance weight over its tokens, and their number.
_ProcessExtremes = namedtuple("_ProcessExtremes", "largest smallest num_tokens")


def _to_host(**tensors: torch.Tensor) -> dict[str, list[float]]:
    """The values of several device tensors on the host in one copy (one wait), each flattened, by name."""
    flat = [tensor.reshape(-1) for tensor in tensors.values()]
    values = torch.cat(flat).tolist()
    host, start = {}, 0
    for name, tensor in zip(tensors, flat, strict=True):
        host[name], start = values[start : start + tensor.numel()], start + tensor.numel()
    return host


def _records(record, values: list[float]) -> list:
    """`values` (rows of a gathered (N, len(record._fields)) tensor, flattened) as N records."""
    width = len(record._fields)
    return [record(*values[i : i + width]) for i in range(0, len(values), width)]


class RPGTrainer(
    ReliabilityMixin,
    DynamicSamplingMixin,
    ImportanceWeightMonitorMixin,
    KLDriftMonitorMixin,
    VocabularyKLMixin,
    GRPOLossStepsMixin,
    GRPOTrainer,
):
    """
    Trainer for Regularized Policy Gradient (RPG).

    RPG ([On the Design of KL-Regularized Policy Gradient Algorithms for LLM
    Reasoning](https://huggingface.co/papers/2505.17508)) derives, for forward/reverse and normalised/unnormalised KL
    regularisers, the importance weighting that makes an off-policy surrogate give the exact gradient of the
    KL-regularised objective, with fully differentiable and REINFORCE-style estimators and RPG-Style Clip. Compared
    with [`~trl.GRPOTrainer`], the loss is RPG's ([`rpg_trl.losses`]), normalised as TRL normalises each `loss_type`,
    and with `kl_anchor="sampling"` no reference model is created.

    The class line shows its parts, each with its own state: [`~rpg_trl.reliability.ReliabilityMixin`] (reward guard,
    exact resume, dataset and length checks) and [`~rpg_trl.dynamic_sampling.DynamicSamplingMixin`] (DAPO dynamic
    sampling), which the baseline trainers share, and
    [`~rpg_trl.reliability.importance_weights.ImportanceWeightMonitorMixin`] (a warning when importance weights
    explode), which [`~rpg_trl.async_rpg.AsyncRPGTrainer`] shares, and
    [`~rpg_trl.reliability.kl_drift.KLDriftMonitorMixin`] (a warning when the KL to a reference model stops holding
    the policy), and `GRPOLossStepsMixin` (GRPOTrainer's own steps around its loss, which TRL computes inline: the
    forward pass, the credit-assignment masks, the normaliser of each `loss_type`, the entropy bonus; pinned to TRL's
    code by the parity tests). RPG's own methods: `_compute_loss` (those steps around RPG's per-token loss, and its
    metrics), `_save_checkpoint` and
    `_load_optimizer_and_scheduler` (the synced reference of the paper's iterative reference update, Sec. 5,
    [`RefModelSyncCallback`]). With `kl_target`, [`~rpg_trl.kl_control.AdaptiveKLCallback`] sets β (`rpg_beta`) after
    every optimizer step from the KL that `_log_rpg_metrics` hands it.

    Generation, rewards, vLLM, PEFT, DeepSpeed/FSDP, gradient accumulation and logging are otherwise TRL's. Everything
    this class and its mixins do beyond the loss, each with the option that turns it off and the test that checks it,
    is one table of the rpg_trl docs, "Beyond the loss".
    """

    _tag_names = ["trl", "rpg"]
    _name = "RPG"
    _paper = {
        "title": "On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning",
        "id": "2505.17508",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @inproceedings{zhang2026design,
                title        = {{On the Design of KL-Regularized Policy Gradient Algorithms for LLM Reasoning}},
                author       = {Yifan Zhang and Yifeng Liu and Huizhuo Yuan and Quanquan Gu and Andrew Chi-Chih Yao},
                booktitle    = {The Fourteenth International Conference on Learning Representations},
                year         = 2026,
                eprint       = {arXiv:2505.17508},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: RPGConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = RPGConfig(f"{model_name.split('/')[-1]}-RPG")
        elif not isinstance(args, RPGConfig):
            raise TypeError(
                f"`args` must be an `RPGConfig` (a subclass of `GRPOConfig` with RPG's fields); got "
                f"{type(args).__name__}. Replace `GRPOConfig(...)` by `RPGConfig(...)`."
            )
        #: The RPG loss (divergence, estimator, β, clip, levels), built once from `args`.
        self.loss_spec = args.rpg_loss_spec()
        rpg_beta = args.beta
        # GRPOTrainer creates a reference model (and scores the batch with it) iff `beta != 0`. With the sampling
        # policy as KL anchor RPG needs none, so the parent is built as if beta were 0.
        if args.kl_anchor == "sampling":
            args.beta = 0.0
        # `sync_ref_model` is served by RPG's RefModelSyncCallback (installed below, PEFT included), not by TRL's.
        sync_ref_model, args.sync_ref_model = args.sync_ref_model, False
        # The variant's tag goes on the model too (GRPOTrainer adds `_tag_names` to the model in its __init__).
        self._tag_names = [*type(self)._tag_names, self.loss_spec.paper_name.lower()]
        try:
            super().__init__(model, reward_funcs, args=args, **kwargs)
        finally:
            args.beta = rpg_beta
            args.sync_ref_model = sync_ref_model
        self.check_vocabulary_kl()
        #: Iterative reference updates (`sync_ref_model` / `ref_model_sync_kl_threshold`), or None.
        self.ref_sync_callback = RefModelSyncCallback.install(self)
        #: The adaptive KL coefficient (`kl_target`), or None: it sets `rpg_beta` after each optimizer step.
        self.kl_control_callback = AdaptiveKLCallback.install(self)
        #: What the diagnostics ([`~rpg_trl.losses.DIAGNOSTIC_METRICS`]) of the current optimizer step need from its
        #: micro-batches so far, on the host: the log W of every completion with a token (all processes'), and the
        #: sums ``(Σ|w·A|, Σ|β·K̃|, tokens)`` over the processes; or None.
        self._diagnostic_window = None

    @property
    def rpg_beta(self) -> float:
        """KL coefficient of the RPG loss (`self.beta` keeps the parent's meaning: "reference log-probs needed")."""
        return self.loss_spec.beta

    @rpg_beta.setter
    def rpg_beta(self, value: float) -> None:
        # The one place β changes during training (the adaptive KL coefficient): the loss reads `loss_spec`.
        self.loss_spec = self.loss_spec.replace(beta=float(value))

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        logps, entropies, aux_loss, mask = self._policy_logps(model, inputs)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # TRL skips `old_per_token_logps` when the step is on-policy; then π_old = π_θ (detached).
        old_logps = inputs.get("old_per_token_logps")
        old_logps = logps.detach() if old_logps is None else old_logps
        ref_logps = inputs.get("ref_per_token_logps") if self.args.kl_anchor == "reference" else None
        reward_mask, entropy_mask = self._credit_masks(logps, old_logps, entropies, advantages, mask, inputs)
        # kl_estimate="vocabulary": each position's exact KL, from both models' hidden states and heads.
        position_kl = self.vocabulary_position_kl(mask) if self._vocabulary_kl else None
        # kl_to_go_baseline: the completions of one prompt share its label (the rows of `prompt_ids` and its mask).
        groups = None
        if self.loss_spec.kl_to_go_baseline != "none":
            prompts = torch.cat([inputs["prompt_ids"], inputs["prompt_mask"]], 1)
            groups = torch.unique(prompts, dim=0, return_inverse=True)[1]

        # RPG's loss (Sec. 3, Tables 1 and 4), in place of GRPO's clipped surrogate and β·k3 term.
        per_token_loss, stats = rpg_per_token_loss(
            logps,
            old_logps,
            advantages,
            mask,
            self.loss_spec,
            ref_logps=ref_logps,
            reward_mask=reward_mask,
            position_kl=position_kl,
            groups=groups,
        )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            # vLLM sampled the batch, and π_old (recomputed by the trainer) is not the sampler: both the reward term
            # and the KL term are expectations under the samples, so TRL's truncated/masked π_old/π_vLLM ratio
            # reweights both. (GRPOTrainer reweights only its policy term, adding β·k3 afterwards.)
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
            for key in ("reward_gradient_weight", "kl_gradient_weight"):  # the weights the gradient gets
                stats[key] = stats[key] * inputs["importance_sampling_ratio"]

        loss_mask = mask.to(per_token_loss.dtype)
        loss = self._grpo_reduction(per_token_loss, mask, loss_mask, entropies, entropy_mask, aux_loss, inputs, mode)
        self._log_rpg_metrics(mode, stats, loss_mask, entropies)
        return loss

    def _log_rpg_metrics(self, mode, stats, fmask, entropies):
        """Log TRL-named metrics (`kl`, `entropy`, `clip_ratio/...`) and RPG's, reduced across processes (`fmask`: the
        float mask of the loss's tokens), and hand a training micro-batch's KL to the callbacks fed one: the reference
        sync gets the token KL, the adaptive KL coefficient the KL that β weighs (`loss_spec.controlled_kl`).

        The diagnostics of the whole-completion weights and of the KL's share of the gradient
        ([`~rpg_trl.losses.DIAGNOSTIC_METRICS`]) are exact over an optimizer step: the completions' log W are
        gathered from the processes at every micro-batch (with the clip fractions and the importance-weight extremes),
        kept on the host until the step's last micro-batch, and the diagnostics computed from all of them
        ([`~rpg_trl.losses.surrogate.diagnostic_metrics_of`]) and logged once per step (once per micro-batch in
        evaluation)."""
        # On the device, per completion, every sum the metrics need, in one reduction (the token means' stats, the
        # entropy, the two parts of the gradient weight in absolute value, the token count), summed over the batch and
        # the processes; the per-completion values the extremes and the diagnostics need, gathered. One copy to the
        # host, where the rest is a few float operations: on a GPU each tensor op of the metrics is a kernel launched
        # alone (the loss's metrics were most of its time), and every `.item()` a wait.
        per_sequence, weight_extremes = sequence_sums(stats, fmask, extra=(entropies,))
        rows = dict(zip(_SEQUENCE_ROWS, per_sequence.unbind(), strict=True))
        has_sequence = rows["num_tokens"] > 0
        totals = torch.cat(
            [
                per_sequence.sum(-1),
                torch.stack([(stats["sequence_kl"] * has_sequence).sum(), has_sequence.sum().to(per_sequence.dtype)]),
            ]
        )
        reduced = self.accelerator.reduce(totals, reduction="sum")
        if mode == "train":
            reduced_totals = dict(zip(_REDUCED_TOTALS, reduced.unbind(), strict=True))
            if self.ref_sync_callback is not None:
                self.ref_sync_callback.observe_kl(reduced_totals["kl"], reduced_totals["num_tokens"])
            if self.kl_control_callback is not None:
                controlled = self.loss_spec.controlled_kl
                self.kl_control_callback.observe_kl(
                    reduced_totals[controlled.metric], reduced_totals[controlled.count]
                )
        # The two clip fractions in one division on the device: GRPOTrainer's float32 values (NaN for a completion
        # without tokens).
        fractions = torch.stack([rows["is_low_clipped"], rows["is_high_clipped"]]) / rows["num_tokens"]
        log_weights = stats["log_prefix_weight"].to(per_sequence.dtype)
        columns = torch.stack([*fractions, rows["num_tokens"], log_weights], -1)  # one _Completion per row
        extremes = torch.cat([weight_extremes, totals[_REDUCED_TOTALS.index("num_tokens")].reshape(1)])
        host = _to_host(
            totals=reduced,
            completions=self.accelerator.gather(columns),
            processes=self.accelerator.gather(extremes.reshape(1, len(_ProcessExtremes._fields))),
        )
        host_sums = dict(zip(_REDUCED_TOTALS, host["totals"], strict=True))
        completions = _records(_Completion, host["completions"])
        processes = _records(_ProcessExtremes, host["processes"])

        token_count = max(host_sums["num_tokens"], 1.0)
        metrics = {key: host_sums[key] / token_count for key in (*TOKEN_MEAN_METRICS, "entropy")}
        metrics["kl/sequence"] = host_sums["kl/sequence"] / max(host_sums["num_sequences"], 1.0)
        # Per-sequence extremes, as GRPOTrainer logs them: the smallest sequence fraction of low-clipped tokens and
        # the largest of high-clipped tokens over the batch (NaN-free over empty sequences); the importance weight's
        # largest and smallest over the processes (NaN from a process without tokens left out).
        active = [row for row in completions if row.num_tokens > 0]
        metrics["clip_ratio/low_min"] = min((row.low_clipped for row in active), default=math.nan)
        metrics["clip_ratio/high_max"] = max((row.high_clipped for row in active), default=math.nan)
        processes = [row for row in processes if row.num_tokens > 0]  # with tokens
        # NaN-free as TRL's nanmax/nanmin
        metrics["importance_weight/max"] = max(
            (row.largest for row in processes if row.largest == row.largest), default=math.nan
        )
        metrics["importance_weight/min"] = min(
            (row.smallest for row in processes if row.smallest == row.smallest), default=math.nan
        )
        # The diagnostics over the optimizer step (every micro-batch's completions and sums; each micro-batch's in
        # evaluation), from the completions' log W.
        pending = mode == "train" and self._diagnostic_window is not None
        window_log_weights, sums = self._diagnostic_window if pending else ([], (0.0, 0.0, 0.0))
        window_log_weights = window_log_weights + [row.log_weight for row in active]
        keys = ("reward_weight/abs_sum", "kl_weight/abs_sum", "num_tokens")
        sums = tuple(total + host_sums[key] for total, key in zip(sums, keys, strict=True))
        flush = mode != "train" or self.accelerator.sync_gradients
        if mode == "train":
            self._diagnostic_window = None if flush else (window_log_weights, sums)
        if flush:
            metrics.update(diagnostic_metrics_of(window_log_weights, *sums))
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _load_callback_state(self):
        # With `restore_callback_states_from_checkpoint=True` transformers replaces each stateful callback by a copy
        # built from its saved arguments; the KL controller must stay the trainer's own (it restores its state itself).
        super()._load_callback_state()
        if self.kl_control_callback is not None:
            self.kl_control_callback.reinstall(self)

    def _save_checkpoint(self, model, trial):
        # A synced reference is training state: it goes into the checkpoint with the optimizer.
        if self.ref_sync_callback is not None:
            self.ref_sync_callback.save_checkpoint(self, trial)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called once when resuming, on every backend, after the models are wrapped: restore the synced reference too.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.ref_sync_callback is not None:
            self.ref_sync_callback.load_checkpoint(self, checkpoint)
