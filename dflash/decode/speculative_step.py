"""The speculative decoder's own step pieces (:mod:`dflash.decode.speculative`), beside the layer
pieces it shares with the data engine (:mod:`dflash.models.layers`): the greedy head with its
top-2 margin, the drafter's RoPE in the shared pieces' calling convention, and the drafter's
context K/V of verified positions.

Owns those functions only; the decoder compiles each as one region and captures them in its
step. Imports ``models.drafter``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.drafter import apply_rope


def drafter_rope(q, k, cos, sin):
    """The drafter's RoPE (:func:`dflash.models.drafter.apply_rope`) in the shared pieces'
    calling convention: cos/sin [B, L, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def greedy_head(norm, lm_w, x):
    """final norm + lm_head -> greedy token and top-2 margin per position (logits never leave
    the device). ``topk``, not a second masked max: torch 2.11's inductor fails to fuse
    argmax + amax + masked amax (an assertion in its scheduler; bench/results/h200/
    COMMANDS.md, decode step probe run 2)."""
    logits = F.linear(norm(x), lm_w)
    top = logits.topk(2, dim=-1).values.float()
    return logits.argmax(-1), top[..., 0] - top[..., 1]


def context_kv(drafter, feats, cos, sin, w_kv=None):
    """The drafter's context K/V of verified positions, every layer: fc + hidden_norm + each
    layer's k/v projection, k_norm and RoPE, compiled as one region (eager it is ~100 small
    kernels per step: by estimate a quarter to a third of what the speculative step costs
    over a one-token step on the H200). ``w_kv`` (:func:`context_kv_weights`): every layer's
    k and v projections as ONE GEMM (they all read the same normed context)."""
    ctx = drafter.hidden_norm(drafter.fc(feats))
    if w_kv is None:
        return [layer.self_attn.context_kv(ctx, (cos, sin)) for layer in drafter.layers]
    B, L = ctx.shape[:2]
    out = []
    for layer, kv in zip(drafter.layers, F.linear(ctx, w_kv).chunk(len(drafter.layers), -1)):
        attn = layer.self_attn
        k, v = kv.view(B, L, 2 * attn.nkv, attn.hd).split(attn.nkv, dim=2)
        k = attn.k_norm(k).transpose(1, 2)
        out.append((apply_rope(k, cos, sin), v.transpose(1, 2)))
    return out


def context_kv_weights(drafter):
    """Every layer's ``[k_proj; v_proj]`` weights stacked (a copy) for :func:`context_kv`."""
    return torch.cat([torch.cat([lay.self_attn.k_proj.weight, lay.self_attn.v_proj.weight])
                      for lay in drafter.layers])


def argmax_head(norm, lm_w, x):
    """final norm + lm_head -> greedy token per position (the drafter's head: no margin)."""
    return F.linear(norm(x), lm_w).argmax(-1)
