# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""How `RPGTrainer` computes ``kl_estimate="vocabulary"``: each completion position's exact KL between the policy's and
the anchor's next-token distributions, inside the loss's own scoring pass.

TRL 1.16's GRPOTrainer scores every completion through a fused LM head (`trl.trainer.utils.add_fused_lm_head`): the
backbone's last hidden state, projected in tiles by TRL's chunked log-prob kernel, never as ``(B, T, V)`` logits.
[`VocabularyKLMixin`] adds no forward pass:

* The anchor's final hidden states at the completion positions are read, with a forward hook on the backbone, from a
  pass GRPOTrainer already makes when it builds the batch: the reference model's scoring pass
  (``kl_anchor="reference"``, also with PEFT, where the reference is the base model or the "ref" adapter) or the pass
  that scores `old_per_token_logps` (``kl_anchor="sampling"``, π_old). They enter the batch as
  `rpg_anchor_hidden_states` ((B, T, H), the model's dtype), so TRL's shuffling and splitting, dynamic sampling and
  the resume of a generation cycle carry them with the batch.
* In the loss's scoring pass, TRL's fused head is handed, for that one call, a kernel that computes the same
  log-probs and entropies and, from the same tiles, each position's KL to the anchor
  ([`rpg_trl.losses.vocabulary_kernel`]): the anchor's head adds one projection forward and one backward, and the KL
  runs inside the model's forward pass, as the log-probs do.
* Where π_old = π_θ (``kl_anchor="sampling"`` when GRPOTrainer skips π_old's pass because every step is on-policy,
  or when no optimizer step has been taken since π_old scored the batch), each position's KL and its gradient are
  exactly 0, and nothing is computed.

The anchor's head is read where the loss runs: the reference model's, or the policy's own for π_old. A head that can
change between the scoring pass and the loss (the policy's when it trains, π_old's head being the one at generation;
the reference's when reference syncs are on) is copied at generation instead (a (V, H) tensor), and the copy is saved
with a checkpoint taken inside a generation cycle (the resume keeps the batch and its head together; a checkpoint
follows an optimizer step, so the resumed micro-steps of the cycle all compute their KL).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .trl_release import require_trl


#: The first TRL release whose GRPOTrainer scores through the fused LM head and ships the tiled divergence kernel.
VOCABULARY_KL_TRL = "1.16.0"
#: The batch entry of the anchor's hidden states at the completion positions, (B, T, H).
ANCHOR_HIDDEN_KEY = "rpg_anchor_hidden_states"


def _causal_lm(model) -> PreTrainedModel:
    """The causal LM under PEFT's wrapper (the module TRL patches with its fused head)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _backbone(causal_lm):
    """The backbone whose `last_hidden_state` TRL's fused head projects (its `base_model`)."""
    return causal_lm.base_model


def _head_parameters(causal_lm) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = causal_lm.get_output_embeddings()
    return head.weight, head.bias


def _full(tensor):
    """A tensor as a whole: FSDP2's DTensor shards gathered (differentiably), anything else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _Scoring:
    """One scoring call's log-probs (the very tensor GRPOTrainer returns, to tell which entry of the batch it became),
    its hidden states at the completion positions, and the causal LM that made them."""

    def __init__(self, logps, hidden, causal_lm):
        self.logps, self.hidden, self.causal_lm = logps, hidden, causal_lm


class VocabularyKLMixin:
    """Captures both models' hidden states for ``kl_estimate="vocabulary"`` (module docstring), mixed in right before
    GRPOTrainer's own steps, so that it wraps one round of `_generate_and_score_completions` (dynamic sampling draws
    several and joins them). Does nothing with ``kl_estimate="sample"``."""

    #: Each position's exact KL of the loss's last scoring pass, (B, T), or None where π_old = π_θ.
    _vocabulary_position_kl = None
    #: The scoring calls of the generation round in progress, or None outside one.
    _vocabulary_round = None
    #: Per mode ("train", "eval"): the anchor's head copied at the last generation, or None where the live head serves.
    _vocabulary_anchor_heads = None
    #: Per mode, with ``kl_anchor="sampling"``: the optimizer step at which π_old scored the last generation batch.
    _vocabulary_generation_steps = None

    @property
    def _vocabulary_kl(self) -> bool:
        return self.loss_spec.kl_estimate == "vocabulary"

    def check_vocabulary_kl(self) -> None:
        """Refuse, at construction, what ``kl_estimate="vocabulary"`` cannot run on: a TRL older than 1.16 (or one whose
        fused head calls its kernel otherwise), ZeRO-3 or FSDP, an LM head other than a plain linear layer (one that
        PEFT adapts or saves is not the head the kernel would read). The logits' transform (temperature, scale,
        soft-capping) is the one TRL's fused head passes its kernel, for either model."""
        if not self._vocabulary_kl:
            return
        require_trl(VOCABULARY_KL_TRL, "kl_estimate='vocabulary'", "Use kl_estimate='sample' with the installed TRL.")
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if getattr(self, "is_fsdp_enabled", False) or (plugin is not None and plugin.zero_stage == 3):
            # The kernel's backward pass (and the anchor's live head) would read sharded weights outside a gather.
            raise ValueError(
                "kl_estimate='vocabulary' is not yet supported with sharded parameters (DeepSpeed ZeRO-3, FSDP): its "
                "kernel reads both models' LM heads in the backward pass, where they are not gathered. Use DDP or "
                "ZeRO-2 with it, or kl_estimate='sample'."
            )
        models = [("the policy", self.model)]
        if self.ref_model is not None and self.args.kl_anchor == "reference":
            models.append(("the reference model", self.ref_model))
        for name, model in models:
            causal_lm = _causal_lm(self.accelerator.unwrap_model(model))
            head = causal_lm.get_output_embeddings()
            if type(head) is not torch.nn.Linear:
                raise ValueError(
                    f"kl_estimate='vocabulary' reads the LM head's weight directly, and the head of {name} is a "
                    f"{type(head).__name__}, not a torch.nn.Linear (e.g. a LoRA adapter or `modules_to_save` on the "
                    "head): leave the head out of the PEFT config, or use kl_estimate='sample'."
                )
        import trl
        import trl.trainer.utils as trl_utils

        if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
            raise ImportError(
                "kl_estimate='vocabulary' computes the KL inside TRL's fused LM head, whose kernel this TRL "
                f"({trl.__version__}) does not call `trl.trainer.utils._ChunkedLogProbFunction`: use a TRL release "
                "that setup.cfg admits, or kl_estimate='sample'."
            )
        self._vocabulary_anchor_heads, self._vocabulary_generation_steps = {}, {}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if not self._vocabulary_kl or self._vocabulary_round is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        # A scoring pass of the generation round: keep the backbone's states, for the anchor's.
        causal_lm = _causal_lm(self.accelerator.unwrap_model(model))
        states = []

        def keep(module, inputs, output):
            states.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        handle = _backbone(causal_lm).register_forward_hook(keep)
        try:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            handle.remove()
        # The state at position j predicts token j + 1: the completion's tokens are predicted by the `logits_to_keep`
        # states before the last one (TRL's fused head drops the last and keeps the labels' positions).
        hidden = torch.cat([state[:, -logits_to_keep - 1 : -1] for state in states])
        self._vocabulary_round.append(_Scoring(result[0], hidden, causal_lm))
        return result

    def _policy_logps(self, model, inputs):
        """The loss's scoring pass (GRPOTrainer's, through TRL's fused head) with each position's exact KL computed in
        the same tiles ([`rpg_trl.losses.vocabulary_kernel`]): TRL's kernel is handed [`_FusedKL`] for this one call,
        and the KL it computes is kept for [`vocabulary_position_kl`]."""
        self._vocabulary_position_kl = None
        if not self._vocabulary_kl:
            return super()._policy_logps(model, inputs)
        mode = "train" if self.model.training else "eval"
        anchor_hidden = inputs.get(ANCHOR_HIDDEN_KEY)
        if anchor_hidden is None or self._vocabulary_generation_steps.get(mode) == self.state.global_step:
            # π_old = π_θ: on-policy (GRPOTrainer skipped π_old's pass), or no optimizer step since π_old's pass. Then
            # KL(π_θ‖π_old) = 0 at every position, and so is its gradient (exactly: no computation).
            return super()._policy_logps(model, inputs)
        anchor_head = self._vocabulary_anchor_heads.get(mode)
        if anchor_head is None:
            anchor_head = _head_parameters(self._anchor_causal_lm())
            anchor_head = tuple(None if p is None else _full(p).detach() for p in anchor_head)
        fused = _FusedKL(
            anchor_hidden,
            anchor_head,
            inputs["completion_mask"] != 0,
            self.loss_spec.kl_term.direction == "reverse",
        )
        import trl.trainer.utils as trl_utils

        original, trl_utils._ChunkedLogProbFunction = trl_utils._ChunkedLogProbFunction, fused
        try:
            result = super()._policy_logps(model, inputs)
        finally:
            trl_utils._ChunkedLogProbFunction = original
        if fused.kl is None:
            raise RuntimeError(
                "kl_estimate='vocabulary': the loss's scoring pass did not go through TRL's fused LM head "
                "(trl.trainer.utils.add_fused_lm_head), so no KL was computed."
            )
        self._vocabulary_position_kl = fused.kl
        return result

    def _generate_and_score_completions(self, inputs):
        if not self._vocabulary_kl:
            return super()._generate_and_score_completions(inputs)
        self._vocabulary_round = []
        try:
            batch = super()._generate_and_score_completions(inputs)
            scorings = self._vocabulary_round
        finally:
            self._vocabulary_round = None
        key = "ref_per_token_logps" if self.args.kl_anchor == "reference" else "old_per_token_logps"
        logps = batch.get(key)
        if logps is None:
            if key == "ref_per_token_logps":
                raise RuntimeError("kl_estimate='vocabulary' with kl_anchor='reference' found no reference scoring.")
            return batch  # on-policy: π_old = π_θ, every position's KL is 0
        scoring = next((s for s in scorings if s.logps is logps), None)
        if scoring is None:
            raise RuntimeError(
                f"kl_estimate='vocabulary' could not find the scoring pass of `{key}` (an override of "
                "`_get_per_token_logps_and_entropies` that returns other log-probs than it computes?)."
            )
        batch[ANCHOR_HIDDEN_KEY] = scoring.hidden.detach().clone()  # the slice alone, not the prompt's states
        mode = "train" if self.model.training else "eval"
        self._vocabulary_anchor_heads[mode] = self._anchor_head_copy(scoring.causal_lm)
        if self.args.kl_anchor == "sampling":
            self._vocabulary_generation_steps[mode] = self.state.global_step
        return batch

    def _anchor_head_copy(self, causal_lm):
        """A copy of the anchor's head when it can change before the loss reads it, else None (the live head)."""
        weight, bias = _head_parameters(causal_lm)
        syncs = getattr(self, "ref_sync_callback", None) is not None
        if not (weight.requires_grad if self.args.kl_anchor == "sampling" else syncs):
            return None
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        weight, bias = _full(weight), None if bias is None else _full(bias)
        with torch.no_grad(), maybe_gather_lm_head_ctx(*(p for p in (weight, bias) if p is not None)):
            return weight.detach().clone(), None if bias is None else bias.detach().clone()

    def _anchor_causal_lm(self):
        if self.args.kl_anchor == "reference" and self.ref_model is not None:
            return _causal_lm(self.accelerator.unwrap_model(self.ref_model))
        return _causal_lm(self.accelerator.unwrap_model(self.model))

    def vocabulary_position_kl(self, mask: torch.Tensor) -> torch.Tensor:
        """Each completion position's exact KL to the anchor, (B, T) float32, 0 where `mask` is 0: the one computed in
        the loss's scoring pass just made ([`_policy_logps`]), or zeros where π_old = π_θ."""
        kl, self._vocabulary_position_kl = self._vocabulary_position_kl, None
        if kl is None:
            return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        return torch.where(mask != 0, kl, 0.0)


class _FusedKL:
    """Stands in for TRL's `ChunkedLogProbFunction` in one call of TRL's fused head (the loss's scoring pass of a
    micro-batch): the same log-probs and entropies, and each position's exact KL to the anchor from the same tiles
    ([`rpg_trl.losses.vocabulary_kernel.LogProbKLFunction`]), kept as `kl` ((B, T), with the policy's graph).

    TRL's head passes the states of the positions whose next token is a label: only those (on a device with Triton),
    or every position of the (B, L − 1) shifted sequence (elsewhere; the others' outputs are then zeroed by TRL). The
    labels are the completion tokens where `completion_mask` is set, so the rows are matched to the anchor's states
    (B, T, H) through that mask, in the same row-major order."""

    def __init__(self, anchor_hidden, anchor_head, completion_mask, reverse: bool):
        self.anchor_hidden, self.anchor_head, self.reverse = anchor_hidden, anchor_head, reverse
        self.mask = completion_mask
        self.kl = None

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        from .losses.vocabulary_kernel import LogProbKLFunction

        if self.kl is not None:
            raise RuntimeError("kl_estimate='vocabulary': TRL's fused head was called twice in one loss pass.")
        unknown = set(outputs) - {"log_probs", "entropy"}
        if unknown:
            raise RuntimeError(
                f"kl_estimate='vocabulary' does not compute the fused head's outputs {sorted(unknown)}."
            )
        mask = self.mask.to(hidden.device)
        labelled = int(mask.sum())
        batch, length = mask.shape
        rows, all_rows = hidden, None
        if hidden.shape[0] != labelled:  # every position of the shifted sequence: keep the completion's labelled ones
            if hidden.shape[0] % batch != 0 or hidden.shape[0] // batch < length:
                raise RuntimeError(
                    f"kl_estimate='vocabulary': TRL's fused head passed {hidden.shape[0]} positions, which are neither "
                    f"the {labelled} labelled ones nor every position of {batch} sequences of at least {length}."
                )
            shifted = hidden.shape[0] // batch
            all_rows = torch.zeros(batch, shifted, dtype=torch.bool, device=mask.device)
            all_rows[:, shifted - length :] = mask
            all_rows = all_rows.reshape(-1)
            rows, targets = hidden[all_rows], targets[all_rows]
        anchor_weight, anchor_bias = self.anchor_head
        log_probs, entropy, kl = LogProbKLFunction.apply(
            rows,
            weight,
            bias,
            targets,
            self.anchor_hidden.to(hidden.device)[mask],
            anchor_weight,
            anchor_bias,
            self.reverse,
            (logit_scale, softcap, 1.0 / temperature),
        )
        # A KL is >= 0; the online logsumexp can round a vanishing one a few ulps below 0.
        kl = kl.clamp(min=0.0)
        self.kl = kl.new_zeros(mask.shape).masked_scatter(mask, kl)
        if all_rows is not None:
            log_probs = log_probs.new_zeros(all_rows.shape).masked_scatter(all_rows, log_probs)
            entropy = entropy.new_zeros(all_rows.shape).masked_scatter(all_rows, entropy)
        return log_probs, entropy if "entropy" in outputs else None, None, None, None


def memory_estimate(
    hidden_size: int,
    vocab_size: int,
    completion_length: int,
    generation_batch: int,
    micro_batch: int,
    bytes_per_value: int = 2,
    head_trains: bool = True,
) -> dict[str, int]:
    """What ``kl_estimate="vocabulary"`` holds in a process's memory beyond ``"sample"``, in bytes, from the shapes
    alone (no allocation):

    * ``anchor_hidden_states``: the anchor's states in the generation batch, ``generation_batch × length × H`` values
      of the model's dtype (`bytes_per_value`), held from generation to the batch's last micro-step;
    * ``anchor_head_copy``: π_old's head copied at generation when it trains (`head_trains`: full fine-tuning; not with
      LoRA, and not for a reference model without syncs), ``V × H`` values;
    * ``anchor_rows``: the micro-batch's anchor states at its labelled positions, kept for the backward pass,
      ``micro_batch × length × H`` values (at most);
    * ``kernel_tiles``: the fused kernel's four float32 tiles (the two models' logits and exponentials),
      ``min(N, 4096) × min(V, 16384)`` each (``N = micro_batch × length``), during the loss's forward and backward
      passes, in place of TRL's kernel's, ``trl_kernel_tiles`` (three float32 tiles and one of the compute dtype,
      ``min(N, 4096) × min(V, 32768)``): the gradients' float32 accumulators are TRL's, not added."""
    positions = micro_batch * completion_length
    rows = min(positions, 4096)
    return {
        "anchor_hidden_states": generation_batch * completion_length * hidden_size * bytes_per_value,
        "anchor_head_copy": vocab_size * hidden_size * bytes_per_value if head_trains else 0,
        "anchor_rows": positions * hidden_size * bytes_per_value,
        "kernel_tiles": 4 * rows * min(vocab_size, 16384) * 4,
        "trl_kernel_tiles": rows * min(vocab_size, 32768) * (3 * 4 + bytes_per_value),
    }


#: Model shapes of the memory table in the docs (hidden size, vocabulary).
MEMORY_TABLE_MODELS = {"Qwen3-0.6B": (1024, 151_936), "Qwen3-4B": (2560, 151_936)}


def memory_table(completion_length: int = 4096, generation_batch: int = 64, micro_batch: int = 8) -> str:
    """[`memory_estimate`] as a Markdown table (MiB) for the shapes of [`MEMORY_TABLE_MODELS`], bf16 weights, full
    fine-tuning and LoRA: ``python -c "from rpg_trl.vocabulary_kl import memory_table; print(memory_table())"``."""
    rows = [
        f"| model, {completion_length} tokens | training | anchor states ({generation_batch} completions) | head copy | "
        f"anchor rows ({micro_batch} completions) | kernel tiles | TRL's kernel tiles (replaced) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (hidden, vocab) in MEMORY_TABLE_MODELS.items():
        for training, trains in (("full", True), ("LoRA", False)):
            m = memory_estimate(hidden, vocab, completion_length, generation_batch, micro_batch, head_trains=trains)
            cells = [f"{m[key] / 2**20:,.0f}" for key in m]
            rows.append(f"| {name} | {training} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
