# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""One tiled pass for the policy's log-probs, entropies and each position's exact KL to an anchor.

TRL 1.16 scores a completion through its chunked log-prob kernel (`trl.kernels.ChunkedLogProbFunction`): the policy's
hidden states ``h`` (``N × H``) are projected through the LM head ``W`` (``V × H``) in tiles of positions ×
vocabulary, each tile folded into online-logsumexp statistics, never as ``N × V`` logits; the backward pass recomputes
each tile and accumulates the head's and the states' gradients in float32. [`LogProbKLFunction`] is that computation
with the anchor's tile beside the policy's: from the same tiles it returns, per position,

* the log-prob of the target token and the entropy (as TRL's kernel does), and
* the KL between the policy's next-token distribution ``p`` and the anchor's ``q`` over the whole vocabulary,
  ``KL(p‖q) = Σ_v p_v (z_v − z'_v) − log Z + log Z'`` (reverse) or ``KL(q‖p) = Σ_v q_v (z'_v − z_v) − log Z' + log Z``
  (forward), with ``z``, ``z'`` the two models' transformed logits and ``Z``, ``Z'`` their normalisers, each sum kept
  online against its running maximum.

Its gradient is exact: per logit ``1[v = y] − p`` for the log-prob, ``−p ⊙ (log p + H)`` for the entropy,
``p ⊙ (log p − log q − KL(p‖q))`` for the reverse KL and ``p − q`` for the forward KL, times each output's incoming
gradient, summed into one tile before the two gradient products. A separate divergence kernel
(`trl.kernels.chunked_divergence`) would project the policy's states through the head again, twice forward and twice
backward; folded here, the KL adds the anchor's projection only (one product forward, one in the backward pass, none
when no gradient reaches the KL); its tiles are half the width of TRL's, four of them held at once.

The tiles run as torch operations on every device (on a GPU the products are cuBLAS's; the folds are not a Triton
kernel), in the autocast dtype when autocast is on (else the states' dtype), the folds and the gradients' accumulators
in float32 (float64 for float64 products).
"""

from __future__ import annotations

import torch


#: Positions per tile (TRL's chunked kernels use the same).
TOKEN_TILE = 4096
#: Vocabulary entries per tile: smaller than TRL's 32,768, as this kernel keeps two models' tiles and their folds.
VOCABULARY_TILE = 16384


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _fold_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32, or float64 for float64 products (a float64 model's KL keeps its digits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(hidden, weight, bias, start, end, dtype, transform):
    """One tile of transformed logits in the fold's dtype (a new tensor), and tanh's value where a softcap applies (for
    the chain rule)."""
    tile = torch.mm(hidden, weight[start:end].to(dtype).t())
    if bias is not None:
        tile.add_(bias[start:end].to(dtype))
    logit_scale, softcap, inv_t = transform
    fold = _fold_dtype(dtype)
    z = tile.to(fold) if tile.dtype != fold else tile
    if softcap is None:
        return z.mul_(logit_scale * inv_t), None
    t = z.mul_(logit_scale / softcap).tanh_()
    return t * (softcap * inv_t), t


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two (n, c) tiles without an (n, c) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _addmm_fp32(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``accumulator += a @ b`` in the accumulator's dtype (float32 or float64), without rounding the product to the
    inputs' dtype first."""
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b.to(a.dtype))
        return
    try:
        torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, TypeError):  # a torch or a backend without `out_dtype` for these dtypes
        accumulator.addmm_(a.float(), b.float())


class LogProbKLFunction(torch.autograd.Function):
    """``(log_probs, entropy, kl)``, each (N,) float32 (as TRL's kernel returns; folded in float64 for float64 states), of the policy's states `hidden` (N, H) and head `weight` (V, H)
    / `bias` (V,) against the anchor's `anchor_hidden` / `anchor_weight` / `anchor_bias`, treated as constants
    (module docstring). `reverse`: ``KL(p‖q)`` if true, else ``KL(q‖p)``; `transform`: ``(logit_scale,
    final_logit_softcapping or None, 1 / temperature)``, as TRL's fused head applies them. Differentiable with respect
    to `hidden`, `weight` and `bias`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, anchor_hidden, anchor_weight, anchor_bias, reverse, transform):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(hidden)

        def column(fill):
            return torch.full((n,), fill, device=hidden.device, dtype=_fold_dtype(dtype))

        # Per position: the policy's running maximum m, Σ e^(z−m), Σ e^(z−m)·z and target logit; the anchor's running
        # maximum m' and Σ e^(z'−m'); and the KL's sum, Σ e^(z−m)·(z − z') (reverse) or Σ e^(z'−m')·(z' − z)
        # (forward), each rescaled whenever its maximum grows. (The difference is formed per word: two sums of
        # logits subtracted at the end would lose the KL's digits to their size.)
        m, s, x, target = column(-torch.inf), column(0.0), column(0.0), column(0.0)
        m_a, s_a, kl_sum = column(-torch.inf), column(0.0), column(0.0)
        for a in range(0, n, TOKEN_TILE):
            b = min(a + TOKEN_TILE, n)
            h, h_anchor, rows_target = hidden[a:b].to(dtype), anchor_hidden[a:b].to(dtype), targets[a:b]
            for start in range(0, vocab, VOCABULARY_TILE):
                end = min(start + VOCABULARY_TILE, vocab)
                z, _ = _logits(h, weight, bias, start, end, dtype, transform)
                z_anchor, _ = _logits(h_anchor, anchor_weight, anchor_bias, start, end, dtype, transform)
                local = rows_target - start
                inside = (local >= 0) & (local < end - start)
                picked = z.gather(-1, local.clamp(0, end - start - 1)[:, None]).squeeze(-1)
                target[a:b] = torch.where(inside, picked, target[a:b])
                new_m = torch.maximum(m[a:b], z.amax(-1))
                rescale = torch.exp(m[a:b] - new_m)
                e = torch.sub(z, new_m[:, None]).exp_()
                s[a:b] = s[a:b] * rescale + e.sum(-1)
                x[a:b] = x[a:b] * rescale + _row_dot(e, z)
                m[a:b] = new_m
                new_m_a = torch.maximum(m_a[a:b], z_anchor.amax(-1))
                rescale_a = torch.exp(m_a[a:b] - new_m_a)
                e_anchor = torch.sub(z_anchor, new_m_a[:, None]).exp_()
                s_a[a:b] = s_a[a:b] * rescale_a + e_anchor.sum(-1)
                m_a[a:b] = new_m_a
                difference = z_anchor.sub_(z)  # z' − z, in the anchor's tile
                if reverse:
                    kl_sum[a:b] = kl_sum[a:b] * rescale - _row_dot(e, difference)
                else:
                    kl_sum[a:b] = kl_sum[a:b] * rescale_a + _row_dot(e_anchor, difference)
        log_z, log_z_anchor = m + torch.log(s), m_a + torch.log(s_a)
        log_probs = target - log_z
        entropy = log_z - x / s
        if reverse:  # Σ p·(z − z') − log Z + log Z'
            kl = kl_sum / s - log_z + log_z_anchor
        else:  # Σ q·(z' − z) − log Z' + log Z
            kl = kl_sum / s_a - log_z_anchor + log_z
        ctx.save_for_backward(hidden, weight, bias, targets, anchor_hidden, anchor_weight, anchor_bias)
        ctx.statistics = (log_z, entropy, log_z_anchor, kl)
        ctx.reverse, ctx.transform, ctx.dtype = reverse, transform, dtype
        return log_probs.float(), entropy.float(), kl.float()

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_kl):
        hidden, weight, bias, targets, anchor_hidden, anchor_weight, anchor_bias = ctx.saved_tensors
        log_z, entropy, log_z_anchor, kl = ctx.statistics
        dtype, transform = ctx.dtype, ctx.transform
        logit_scale, softcap, inv_t = transform
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        fold = _fold_dtype(dtype)
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=fold) if wants_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=fold) if wants_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=fold) if wants_bias else None
        given = [g is not None for g in (grad_log_probs, grad_entropy, grad_kl)]
        if not any(given) or not (wants_hidden or wants_weight or wants_bias):
            return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None
        zeros = torch.zeros(n, device=hidden.device, dtype=fold)
        g_lp, g_ent, g_kl = (zeros if g is None else g.to(fold) for g in (grad_log_probs, grad_entropy, grad_kl))
        # The logits' gradient, per tile: p ⊙ (α·log p + c − γ·log q) − γ'·q + g_lp·1[v = y], with per-position
        # coefficients: reverse, α = g_kl − g_ent, γ = g_kl, γ' = 0 and c = −g_lp − g_ent·H − g_kl·KL; forward,
        # α = −g_ent, γ = 0, γ' = g_kl and c = −g_lp − g_ent·H + g_kl.
        if ctx.reverse:
            alpha, gamma = g_kl - g_ent, g_kl
            c = -g_lp - g_ent * entropy - g_kl * kl
        else:
            alpha, gamma = -g_ent, None
            c = -g_lp - g_ent * entropy + g_kl
        needs_anchor = given[2]
        chain = logit_scale * inv_t
        for a in range(0, n, TOKEN_TILE):
            b = min(a + TOKEN_TILE, n)
            h = hidden[a:b].to(dtype)
            rows = torch.arange(b - a, device=hidden.device)
            for start in range(0, vocab, VOCABULARY_TILE):
                end = min(start + VOCABULARY_TILE, vocab)
                z, t = _logits(h, weight, bias, start, end, dtype, transform)
                log_p = z.sub_(log_z[a:b, None])
                p = torch.exp(log_p)
                inner = log_p.mul_(alpha[a:b, None]).add_(c[a:b, None])
                if needs_anchor:
                    z_anchor, _ = _logits(
                        anchor_hidden[a:b].to(dtype), anchor_weight, anchor_bias, start, end, dtype, transform
                    )
                    log_q = z_anchor.sub_(log_z_anchor[a:b, None])
                    if ctx.reverse:
                        inner.sub_(log_q.mul_(gamma[a:b, None]))
                grad = p.mul_(inner)
                if needs_anchor and not ctx.reverse:
                    grad.sub_(log_q.exp_().mul_(g_kl[a:b, None]))
                if given[0]:
                    local = targets[a:b] - start
                    inside = (local >= 0) & (local < end - start)
                    grad[rows[inside], local[inside]] += g_lp[a:b][inside]
                grad.mul_(chain)
                if t is not None:
                    grad.mul_(1 - t * t)
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    _addmm_fp32(grad_hidden[a:b], grad, weight[start:end].to(dtype))
                if grad_weight is not None:
                    _addmm_fp32(grad_weight[start:end], grad.t(), h)
                if grad_bias is not None:
                    grad_bias[start:end] += grad.sum(0, dtype=fold)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )
