"""The frozen LM head fused with a (soft) cross-entropy: chunked, gradient computed in forward.

``head_cross_entropy(h, W, ids, p, wt, ...)`` = Σ_i wt_i · (−Σ_j p_ij · log softmax(h_i Wᵀ)[ids_ij])
for n supervised positions against a sparse target distribution (hard labels: one id with
p = 1; distillation: the target's top-k). The [n, vocab] logits never exist at once: they are
computed ``chunk`` rows at a time, and each chunk's input gradient (softmax − p) · W is taken
right there, while its logits are live (the trick of liger-kernel's fused linear
cross-entropy, written with torch ops so one path runs on CPU and CUDA). The head then costs
two matmuls per position (logits, input gradient) instead of three (logits, logits recomputed
by activation checkpointing in backward, input gradient), and the softmax runs once. The head
weight is frozen (shared with the target), so no weight gradient is formed.
"""
from __future__ import annotations

import torch


def _chunk(h, w, ids, p, wt, label, k, num_positions, want_grad):
    logits = (h @ w.t()).float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = -((logits.gather(1, ids) - lse) * p).sum(-1)          # [c] soft CE per position
    total = (loss * wt).sum()
    hits = None
    if k is not None:
        hit = (logits.argmax(-1) == label).float()
        hits = torch.zeros(num_positions, device=h.device).scatter_add_(0, k, hit)
    grad = None
    if want_grad:
        g = logits.sub_(lse).exp_()            # the softmax, in the logits' own memory
        g.scatter_add_(1, ids, -p)             # softmax − p
        grad = (g.mul_(wt[:, None]).to(w.dtype) @ w).to(h.dtype)
    return total, hits, grad


class _HeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, ids, p, wt, label, k, num_positions: int, chunk: int):
        want = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        hits = torch.zeros(num_positions, dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if want else None
        for s in range(0, h.shape[0], chunk):
            sl = slice(s, s + chunk)
            t, ht, g = _chunk(h[sl], w, ids[sl], p[sl], wt[sl], label[sl],
                              k[sl] if k is not None else None, num_positions, want)
            total = total + t
            if ht is not None:
                hits = hits + ht
            if want:
                grad[sl] = g
        ctx.save_for_backward(grad if want else h.new_empty(0))
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total.to(grad.dtype),) + (None,) * 8


def head_cross_entropy(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                       wt: torch.Tensor, label: torch.Tensor, k: torch.Tensor | None = None,
                       num_positions: int = 0, chunk: int = 2048):
    """(Σ_i wt_i · soft-CE_i, hits) over rows of ``h`` [n, H] with the frozen head ``w`` [V, H].

    ``ids``/``p`` [n, m]: the target distribution's token ids and probabilities (rows sum to
    1; an id may repeat, the probabilities add). ``label`` [n]: the hard label, for the top-1
    hits per block position ``k`` [n] (a [num_positions] float tensor, no gradient; zeros when
    ``k`` is None). Only ``h`` gets a gradient.
    """
    return _HeadCE.apply(h, w, ids, p.float(), wt.float(), label, k, num_positions, chunk)


__all__ = ["head_cross_entropy"]
