# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The steps of `GRPOTrainer._compute_loss` (TRL 1.14.2 to 1.16) around its loss, which `RPGTrainer` keeps around RPG's.

TRL computes them inline in `_compute_loss` and exposes no method for them: the policy's forward pass on the prompt
and completion (multimodal inputs passed on), the credit-assignment masks on the reward term (`top_entropy_quantile`,
`off_policy_mask_threshold`), the normaliser of each `loss_type`, the static or adaptive entropy bonus and the router's
auxiliary loss. [`GRPOLossStepsMixin`] holds this copy of TRL's code in one place, so that `RPGTrainer._compute_loss`
is these steps around the one call that differs (the RPG loss). The project's parity tests pin it to TRL's: the loss,
gradient and metrics of both trainers on the same batches, for every `loss_type` and each step, and a digest of TRL's
code for the normalisers and the entropy controller that changes when a TRL release changes them.
"""

from __future__ import annotations

import torch

from .losses import aggregate_loss


class GRPOLossStepsMixin:
    """`GRPOTrainer._compute_loss`'s steps around the loss, as methods (mixed in before `GRPOTrainer`)."""

    def _policy_logps(self, model, inputs):
        """The policy's per-token log-probs, entropies and router auxiliary loss on the batch's completions, and the
        mask of the tokens the loss acts on (completion tokens, less tool-output tokens): `(logps, entropies,
        aux_loss, mask)`, as GRPOTrainer computes them."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
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
        return logps, entropies, aux_loss, mask

    def _credit_masks(self, logps, old_logps, entropies, advantages, mask, inputs):
        """TRL's credit-assignment filters: `(reward_mask, entropy_mask)`, the tokens whose reward signal counts
        (`top_entropy_quantile`'s highest-entropy tokens, times `off_policy_mask_threshold`'s off-policy mask) and the
        entropy mask alone (the entropy bonus's tokens), each None when its filter is off. As in GRPOTrainer they act
        on the reward term only; the KL regulariser acts on every token."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        reward_mask = entropy_mask
        if self.off_policy_mask_threshold is not None:
            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            reward_mask = off_policy_mask if reward_mask is None else reward_mask * off_policy_mask
        return reward_mask, entropy_mask

    def _grpo_reduction(self, per_token_loss, mask, loss_mask, entropies, entropy_mask, aux_loss, inputs, mode):
        """The loss from the per-token loss, as GRPOTrainer reduces its own: the normaliser of `loss_type`
        ([`_aggregate`]), minus the entropy bonus ([`_entropy_bonus`], logging `policy_loss` when it is on), plus the
        router's auxiliary loss (logged as `aux_loss`). `mask` is the integer mask of the loss's tokens, `loss_mask`
        the same in the loss's dtype."""
        loss, policy_loss = self._aggregate(per_token_loss, loss_mask, inputs, mode)
        if self._entropy_bonus_enabled:
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss - self._entropy_bonus(entropies, effective_mask, mode)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation_factor
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return loss

    def _aggregate(self, per_token_loss, loss_mask, inputs, mode):
        """Reduce the per-token loss with the normaliser of TRL's `loss_type` (GRPOTrainer._compute_loss, TRL 1.16),
        so that RPG and GRPO losses are on the same scale; returns `(loss, policy_loss)` (the latter detached, before
        the gradient-accumulation scaling, as GRPOTrainer logs it); `loss_mask` is the float mask of the loss's tokens.
        Checked against GRPOTrainer's values in training and evaluation, for each `loss_type`
        (`test_loss_type_normalisers_and_masks_equal_grpo_trainer`, `test_evaluation_loss_equals_grpo_trainer`)."""
        args = self.args
        accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if args.loss_type == "dapo":
            # The token count of the whole generation batch, rescaled to one micro-batch of one process, so that
            # gradient accumulation and multi-process runs equal one large batch.
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / args.steps_per_generation
            loss = aggregate_loss(per_token_loss, loss_mask, "token-mean", num_items)
            return loss, loss.detach()
        if args.loss_type == "bnpo":  # the token count of this micro-batch
            loss = aggregate_loss(per_token_loss, loss_mask, "token-mean")
        else:
            loss = aggregate_loss(per_token_loss, loss_mask, args.aggregation, max_length=args.max_completion_length)
        return loss / accumulation_factor, loss.detach()

    def _entropy_bonus(self, entropies, effective_mask, mode):
        """The entropy bonus `coef · H` to subtract from the loss, with TRL's static (`entropy_coef`) or adaptive
        (`use_adaptive_entropy`) coefficient and GRPOTrainer's metrics (`entropy_coef`) and state.

        `H` is the mean entropy of the tokens the policy term acts on, scaled for gradient accumulation only. The
        adaptive controller applies, during a whole accumulation window, the coefficient (gated by the last measured
        entropy) fixed at the end of the previous window, then moves it by `entropy_coef_delta` toward more bonus
        when the window's entropy (summed over micro-batches and processes) is at or below `entropy_target`, and
        toward less otherwise, within [`entropy_coef_min`, `entropy_coef_max`]. The coefficient and the last entropy
        are saved in checkpoints by GRPOTrainer (`entropy_ctrl_state.json`). Checked against GRPOTrainer's logged
        values (`test_adaptive_entropy_controller_follows_grpo_trainer`).
        """
        args = self.args
        accumulation_factor = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        token_count = effective_mask.sum()
        entropy_sum = (entropies * effective_mask).sum()
        entropy = entropy_sum / token_count.clamp(min=1.0) / accumulation_factor
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
            coef = 0.0
        if self.use_adaptive_entropy and mode == "train":
            window = torch.stack([entropy_sum, token_count]).detach()
            if self._entropy_window_stats is not None:
                window = window + self._entropy_window_stats
            self._entropy_window_stats = window
            if self.accelerator.sync_gradients:  # the last micro-batch of the window: update for the next one
                total = self.accelerator.reduce(window, reduction="sum")
                world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                step = args.entropy_coef_delta if world_entropy <= args.entropy_target else -args.entropy_coef_delta
                self.entropy_coef = min(max(self.entropy_coef + step, args.entropy_coef_min), args.entropy_coef_max)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy
