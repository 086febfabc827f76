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

Two ways to run a chunk (``compile.head_loss``, resolved by :func:`head_backend`):

* eager torch ops (:func:`_chunk`): every fp32 pass over the [chunk, vocab] logits (cast,
  logsumexp, gather, argmax, exp, scatter, weight, cast back) is its own memory-bound kernel;
* one ``torch.compile`` graph per (device, dtype, chunk) (:func:`compiled_chunk`, the
  process's one compiled :func:`_chunk_fused`): logits stay in the matmul's dtype and inductor
  fuses the fp32 math into a couple of passes. Every call has the same [chunk, H] shape (the
  last chunk is padded with zero-weight rows; the objective sizes the chunk per bucket with
  :func:`balanced_chunk`), so the number of supervised positions, which changes every step,
  never recompiles; the drafter step's gate signature (per bucket) covers its compile.
"""
from __future__ import annotations

import functools

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


def _chunk_fused(h, w, ids, p, wt, label, k, num_positions: int, want_grad: bool):
    """:func:`_chunk` written for inductor: no in-place ops on the logits, which stay in the
    matmul's dtype (their fp32 copy is fused away), and for hard labels (one id per row)
    softmax − p is a compare against the column index instead of a scatter, so the softmax,
    the subtraction, the weight and the cast are one pointwise pass."""
    logits = h @ w.t()
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    total = ((-(x.gather(1, ids) - lse) * p).sum(-1) * wt).sum()
    hits = None
    if k is not None:
        hit = (x.argmax(-1) == label).float()
        hits = torch.zeros(num_positions, device=h.device).scatter_add(0, k, hit)
    grad = None
    if want_grad:
        soft = torch.exp(x - lse)
        if ids.shape[1] == 1:
            col = torch.arange(x.shape[1], device=x.device)
            g = soft - torch.where(col[None, :] == ids, p, 0.0)
        else:
            g = soft.scatter_add(1, ids, -p)
        grad = ((g * wt[:, None]).to(w.dtype) @ w).to(h.dtype)
    return total, hits, grad


@functools.cache
def compiled_chunk(backend: str):
    """The process's one compiled :func:`_chunk_fused` for ``backend`` (static shapes: a graph
    per device, dtype and chunk shape; compiled inside the drafter step's ``gate.run``)."""
    return torch.compile(_chunk_fused, backend=backend, dynamic=False)


def balanced_chunk(most_rows: int, chunk: int) -> int:
    """The compiled chunk for a bucket whose steps have at most ``most_rows`` supervised
    positions: the fewest chunks of at most ``chunk`` rows, made equal, so a full row pads
    less than one row per chunk (22,912 of at most 23,040 at SmolLM2's shape: 12 × 1,920, not
    12 × 2,048 = 24,576). Static per bucket: one graph per bucket."""
    most_rows = max(1, most_rows)
    return -(-most_rows // -(-most_rows // chunk))


def head_backend(mode, backend: str, device: str) -> str | None:
    """``compile.head_loss`` resolved for one drafter device: the torch.compile backend of the
    per-chunk head loss, or None (eager torch ops). ``auto``: on for CUDA with
    ``compile.backend`` inductor (the fusions are the point), off elsewhere; ``on``:
    ``compile.backend`` on any device (none when it is eager)."""
    mode = {True: "on", False: "off"}.get(mode, mode)  # YAML reads a bare on/off as a bool
    if mode == "off" or backend == "eager":
        return None
    if mode == "auto" and not (device.startswith("cuda") and backend == "inductor"):
        return None
    return backend


def _pad_rows(x: torch.Tensor, n: int, value=0) -> torch.Tensor:
    """``x`` with rows appended up to ``n`` rows, filled with ``value``."""
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), value)])


class _HeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, ids, p, wt, label, k, num_positions: int, chunk: int,
                backend: str | None):
        want = ctx.needs_input_grad[0]
        n, h = h.shape[0], h.detach()  # padded or not, the graph sees one requires_grad
        run = _chunk
        if backend is not None:
            # one shape for every call: pad to whole chunks with rows of weight 0, p 0 and
            # label −1 (never a top-1), which add nothing to the loss, hits or gradient
            run, m = compiled_chunk(backend), -(-n // chunk) * chunk
            h, ids, p, wt = (_pad_rows(t, m) for t in (h, ids, p, wt))
            label = _pad_rows(label, m, -1)
            k = _pad_rows(k, m) if k is not None else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        hits = torch.zeros(num_positions, dtype=torch.float32, device=h.device)
        grads = []
        for s in range(0, h.shape[0], chunk):
            sl = slice(s, s + chunk)
            t, ht, g = run(h[sl], w, ids[sl], p[sl], wt[sl], label[sl],
                           k[sl] if k is not None else None, num_positions, want)
            total = total + t
            if ht is not None:
                hits = hits + ht
            if want:
                grads.append(g)
        grad = torch.cat(grads)[:n] if want else None
        ctx.save_for_backward(grad if want else h.new_empty(0))
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total.to(grad.dtype),) + (None,) * 9


def head_cross_entropy(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                       wt: torch.Tensor, label: torch.Tensor, k: torch.Tensor | None = None,
                       num_positions: int = 0, chunk: int = 2048, backend: str | None = None):
    """(Σ_i wt_i · soft-CE_i, hits) over rows of ``h`` [n, H] with the frozen head ``w`` [V, H].

    ``ids``/``p`` [n, m]: the target distribution's token ids and probabilities (rows sum to
    1; an id may repeat, the probabilities add). ``label`` [n]: the hard label, for the top-1
    hits per block position ``k`` [n] (a [num_positions] float tensor, no gradient; zeros when
    ``k`` is None). Only ``h`` gets a gradient. ``backend``: run each chunk as the compiled
    graph of that torch.compile backend (:func:`compiled_chunk`); None: eager torch ops.
    """
    return _HeadCE.apply(h, w, ids, p.float(), wt.float(), label, k, num_positions, chunk,
                         backend)


__all__ = ["head_cross_entropy", "head_backend", "compiled_chunk", "balanced_chunk"]
