# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The [`RPGTrainer`]: TRL's GRPOTrainer with the RPG loss."""

from __future__ import annotations

import textwrap

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id, nanmax, nanmin

from .callbacks import RefModelSyncCallback
from .config import RPGConfig
from .dynamic_sampling import generate_with_dynamic_sampling
from .losses import PAPER_NAMES, aggregate_loss, rpg_per_token_loss, summarize_stats
from .resume import load_generation_state, save_generation_state
from .safety import ImportanceWeightMonitor, RewardGuard, check_prompt_column, check_sequence_length
from .teardown import hold_process_group_until_exit


class RPGTrainer(GRPOTrainer):
    """
    Trainer for Regularized Policy Gradient (RPG).

    RPG ([On the Design of KL-Regularized Policy Gradient Algorithms for LLM
    Reasoning](https://huggingface.co/papers/2505.17508)) derives, for forward/reverse and normalised/unnormalised KL
    regularisers, the importance weighting that makes an off-policy surrogate give the exact gradient of the
    KL-regularised objective, with fully differentiable and REINFORCE-style estimators and RPG-Style Clip. The only
    change w.r.t. [`~trl.GRPOTrainer`] is the loss (`_compute_loss`, which calls [`rpg_trl.losses.rpg_loss`]'s
    building blocks) and, with `kl_anchor="sampling"`, that no reference model is created.

    Generation, rewards, vLLM, PEFT, DeepSpeed/FSDP, gradient accumulation and logging are inherited unchanged.
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
        rpg_beta = args.beta
        # GRPOTrainer creates a reference model (and scores the batch with it) iff `beta != 0`. With the sampling
        # policy as KL anchor RPG needs none, so the parent is built as if beta were 0.
        if args.kl_anchor == "sampling":
            args.beta = 0.0
        # `sync_ref_model` is served by RPG's RefModelSyncCallback (installed below, PEFT included), not by TRL's.
        sync_ref_model, args.sync_ref_model = args.sync_ref_model, False
        try:
            super().__init__(model, reward_funcs, args=args, **kwargs)
        finally:
            args.beta = rpg_beta
            args.sync_ref_model = sync_ref_model
        #: KL coefficient of the RPG loss (`self.beta` keeps the parent's meaning: "reference log-probs needed").
        self.rpg_beta = rpg_beta
        self._tag_names = [*self._tag_names, PAPER_NAMES[(args.divergence, args.estimator)].lower()]
        self._reward_guard = RewardGuard()
        self._importance_weight_monitor = ImportanceWeightMonitor(args.importance_weight_warning_threshold)
        #: Iterative reference updates (`sync_ref_model` / `ref_model_sync_kl_threshold`), or None.
        self.ref_sync_callback = RefModelSyncCallback.install(self)
        self._check_datasets()  # a clear error now for a dataset without prompts, not a KeyError mid-training
        hold_process_group_until_exit()  # a gloo group is destroyed at exit without PyTorch's teardown deadlock

    def _compute_loss(self, model, inputs):
        args: RPGConfig = self.args
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            num_images=inputs.get("num_images"),
            pixel_attention_mask=inputs.get("pixel_attention_mask"),
            spatial_shapes=inputs.get("spatial_shapes"),
            num_tiles=inputs.get("num_tiles"),
            image_sizes=inputs.get("image_sizes"),
            token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_position_ids=inputs.get("image_position_ids"),
        )

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # TRL skips `old_per_token_logps` when the step is on-policy; then π_old = π_θ (detached).
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        ref_per_token_logps = inputs.get("ref_per_token_logps") if args.kl_anchor == "reference" else None

        per_token_loss, stats = rpg_per_token_loss(
            per_token_logps,
            old_per_token_logps,
            advantages,
            mask,
            ref_logps=ref_per_token_logps,
            divergence=args.divergence,
            estimator=args.estimator,
            beta=self.rpg_beta,
            clip=args.rpg_clip,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            clip_c=args.clip_c,
            importance_sampling_level=self.importance_sampling_level,
            kl_importance_weight=args.kl_importance_weight,
        )

        # Token selections and corrections TRL applies to its per-token loss, applied to RPG's the same way.
        loss_mask = mask.to(per_token_loss.dtype)
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            per_token_loss = per_token_loss * entropy_mask
        else:
            entropy_mask = None
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            # vLLM sampled the batch, so π_old (recomputed by the trainer) is itself off the sampler: the whole
            # estimator (reward and KL terms) is reweighted by TRL's truncated/masked π_old/π_vLLM ratio.
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]

        mode = "train" if self.model.training else "eval"
        num_items = None
        if args.aggregation == "token-mean":
            # Normalise by the global token count so that accumulation and multi-process equal one large batch.
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / args.steps_per_generation
            loss = aggregate_loss(per_token_loss, loss_mask, args.aggregation, num_items)
        else:
            loss = aggregate_loss(per_token_loss, loss_mask, args.aggregation)
            if mode == "train":
                loss = loss / self.current_gradient_accumulation_steps
        policy_loss = loss.detach()

        accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self._entropy_bonus_enabled:
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
            loss = loss - self.entropy_coef * entropy / accumulation_factor
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation_factor
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_rpg_metrics(mode, stats, mask, entropies)
        return loss

    def _log_rpg_metrics(self, mode, stats, mask, entropies):
        """Log TRL-named metrics (`kl`, `entropy`, `clip_ratio/...`) and RPG's, reduced across processes."""
        fmask = mask.to(torch.float32)
        local = summarize_stats(stats, fmask)
        means = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean", "clip_ratio/region_mean")
        means += ("importance_weight/mean",)
        count = fmask.sum()
        entropy_sum = (entropies.detach().to(torch.float32) * fmask).sum()
        totals = torch.stack([*(local[k] * count for k in means), entropy_sum, count])
        totals = self.accelerator.reduce(totals, reduction="sum")
        self._observe_reference_kl(mode, totals[0], totals[-1])
        global_count = totals[-1].clamp(min=1.0)
        for i, key in enumerate(means):
            self._metrics[mode][key].append((totals[i] / global_count).item())
        self._metrics[mode]["entropy"].append((totals[len(means)] / global_count).item())
        w_max = self.accelerator.gather(local["importance_weight/max"].reshape(1))
        w_min = self.accelerator.gather(local["importance_weight/min"].reshape(1))
        self._metrics[mode]["importance_weight/max"].append(nanmax(w_max).item())
        self._metrics[mode]["importance_weight/min"].append(nanmin(w_min).item())

    def _observe_reference_kl(self, mode, kl_sum, num_tokens):
        """Hand a training micro-batch's token KL to π_ref (summed over tokens and processes) to the reference sync."""
        if mode == "train" and self.ref_sync_callback is not None:
            self.ref_sync_callback.observe_kl(kl_sum, num_tokens)

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

    # DAPO dynamic sampling (`RPGConfig.dynamic_sampling`; `rpg_trl.dynamic_sampling.DynamicSamplingMixin` gives the
    # same overrides to other GRPOTrainer subclasses).
    def _generate_and_score_completions(self, inputs):
        if self.args.dynamic_sampling and self.model.training:
            return generate_with_dynamic_sampling(self, super()._generate_and_score_completions, inputs)
        return super()._generate_and_score_completions(inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's `_calculate_rewards` with each reward function guarded by [`rpg_trl.safety.RewardGuard`]: non-finite
        rewards count as `None` (with a warning), and a failing function is named with the sample it fails on."""
        with self._reward_guard.installed(self):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._dynamic_sampling_rewards = rewards_per_func  # gathered over processes; read by dynamic sampling
        return rewards_per_func

    # Reliability: exact resume, warnings on diverged policies and over-long prompts (`rpg_trl.resume`,
    # `rpg_trl.safety`; tests/test_reliability.py).
    def _save_rng_state(self, output_dir):
        # The buffered generation batch and the micro-step counter are sampling state, like the RNG: saved with it.
        super()._save_rng_state(output_dir)
        save_generation_state(self, output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        load_generation_state(self, checkpoint)

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        check_sequence_length(self, inputs)
        return inputs

    def log(self, logs, start_time=None):
        if self.model.training:  # warn (rate-limited) when the importance weights of this logging interval exploded
            self._importance_weight_monitor.check_logged(self._metrics["train"], self.state.global_step)
        super().log(logs, start_time)

    def _check_datasets(self):
        """Refuse training/evaluation datasets without a `prompt` column (unless an environment supplies prompts)."""
        if getattr(self, "environment_factories", None) is None:
            check_prompt_column(self.train_dataset, "training")
            check_prompt_column(self.eval_dataset, "evaluation")
