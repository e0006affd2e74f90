# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""CPU stand-ins for the GPU parts of TRL's asynchronous trainer (`trl.experimental.async_grpo`).

TRL's [`~trl.experimental.async_grpo.AsyncGRPOTrainer`] (and so [`AsyncRPGTrainer`]) packs its batches for a
FlashAttention-3 tree-attention kernel, fetched from the Hub by the `kernels` package, which needs a GPU; its MFU
metrics look up the device's peak FLOPs with `torch.cuda.get_device_name`.

* [`cpu_tree_attention`]: the same attention (SDPA per packed row, with the tree's mask), registered under the name of
  TRL's tree attention by [`register_cpu_tree_attention`].
* [`cpu_backend`]: a context manager inside which the trainer is built and trained on a machine without CUDA.

On a packed batch it gives the log-probabilities of a plain forward, so the RPG loss of the packed stream (the
paper's Sec. 5 objectives) equals `rpg_loss` on the padded batch in value and gradient.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def cpu_tree_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index,
    tree_cu_seqlens_q,
    tree_cu_seqlens_k,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """TRL's tree attention (`trl.experimental.async_grpo.packing.tree_attention`) without the FA3 kernel.

    The packed row's tokens are laid out in segments (`tree_cu_seqlens_q`); each segment attends to the keys of its
    root-to-segment path (`tree_kv_index[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s + 1]]`) with a bottom-right aligned
    causal mask, as `flash_attn_varlen_func(..., causal=True)` does: the path's earlier segments entirely, its own
    segment up to the query. That is one boolean (tokens × tokens) mask, so the row takes a single SDPA call (K/V heads
    shared by grouped-query attention). `query`, `key`, `value`: (1, heads, tokens, head_dim); returns
    (1, tokens, heads, head_dim) and no weights.
    """
    if sliding_window is not None or softcap:
        raise NotImplementedError(
            "cpu_tree_attention implements full causal attention only; this model uses a sliding window or a logit "
            "soft-cap. Run the asynchronous trainer on a GPU with TRL's FA3 tree attention instead."
        )
    num_tokens, device = query.size(2), query.device
    segments = torch.arange(tree_cu_seqlens_q.numel() - 1, device=device)
    token_segment = torch.repeat_interleave(segments, tree_cu_seqlens_q.diff())  # segment of each packed token
    path_segment = torch.repeat_interleave(segments, tree_cu_seqlens_k.diff())  # segment of each path entry
    on_path = torch.zeros(segments.numel(), num_tokens, dtype=torch.bool, device=device)
    on_path[path_segment, tree_kv_index] = True  # segment s may see token j: j is on the path to s
    position = torch.arange(num_tokens, device=device)
    ahead = (token_segment.unsqueeze(0) == token_segment.unsqueeze(1)) & (
        position.unsqueeze(0) > position.unsqueeze(1)
    )
    mask = on_path[token_segment] & ~ahead
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.size(1) != key.size(1)
    )
    return out.transpose(1, 2), None


def register_cpu_tree_attention() -> None:
    """Register [`cpu_tree_attention`] under the name TRL's asynchronous trainer loads its model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)


_cpu_backend_depth = 0


@contextmanager
def cpu_backend():
    """Build and train TRL's asynchronous trainers (and [`AsyncRPGTrainer`]) on a machine without CUDA.

    Inside the block the trainer registers [`cpu_tree_attention`] instead of the FA3 tree attention, and does not look
    up the device's peak FLOPs (the MFU metrics are left out; throughput and timings are still logged). Both are
    restored when the outermost block exits. The trainer must be built and trained inside the block.
    """
    global _cpu_backend_depth
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    saved = async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.register_tree_attention = register_cpu_tree_attention
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    register_cpu_tree_attention()
    _cpu_backend_depth += 1
    try:
        yield
    finally:
        _cpu_backend_depth -= 1
        async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device = saved
        if _cpu_backend_depth == 0:
            packing.register_tree_attention()
