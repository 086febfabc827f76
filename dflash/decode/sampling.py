"""The fast engine's per-step math (:mod:`dflash.decode.engine`): the one-token decode attention
over a slot's cache row (two variants: SDPA and two matmuls), the final norm + LM head + token
pick, and the counter-based sampling it picks with.

Sampling (``temperature > 0``) is Gumbel-max with counter-based noise: token ``t`` of a sample
with seed ``s`` is ``argmax_v(logits_v / T + G(s, t, v))``, where ``G`` is Gumbel noise made by
an integer hash of ``(s, t, v)`` (no generator state). So a sample's tokens depend only on its
own prompt, seed and the model — not on the slot it got, the other samples in the batch, their
order, the slot count, or the device — again up to the floating-point noise of the logits
themselves. The same seeds give the same samples, run after run.

Owns those functions only; the engine compiles and captures them. Imports ``models.layers``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.layers import out_mlp as _out_mlp

M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# counter-based Gumbel noise (identical on every device: integer arithmetic only)
# ---------------------------------------------------------------------------------------------
def _mul32(x, c: int):
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow (no UB, any backend)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def mix32(x):
    """A 32-bit integer hash (Chris Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_keys(seeds):
    """Per-sample 32-bit keys from 63-bit seeds (int64 tensor)."""
    return mix32(mix32(seeds & M32) ^ ((seeds >> 32) & M32))


def gumbel_noise(keys, steps, vocab_hash):
    """Gumbel(0, 1) noise [B, V] as a pure function of (key, step, vocabulary index)."""
    row = mix32(keys ^ _mul32(steps & M32, 0x9E3779B9))       # [B]
    h = mix32(row[:, None] ^ vocab_hash[None, :])              # [B, V]
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------------------------------
# the math, on the model's own modules
# ---------------------------------------------------------------------------------------------
def _decode_attn_mlp(layer, x, q, k_cache, v_cache, mask):
    """One-token attention over the slot's cache row (mask: [B,1,1,S] valid positions)."""
    B, nh, _, D = q.shape
    kvh = k_cache.shape[1]
    # GQA without copying K/V: the G query heads of one KV head form the query-length dim
    # (head h = j*G + g, the order of HF's repeat_kv).
    qg = q.reshape(B, kvh, nh // kvh, D)
    o = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask,
                                       scale=layer.self_attn.scaling)
    return _out_mlp(layer, x, o.reshape(B, 1, nh * D))


def _decode_attn_mlp_matmul(layer, x, q, k_cache, v_cache, mask):
    """:func:`_decode_attn_mlp` with the attention as two batched matmuls and a masked softmax
    (reads K and V once each; no query-tile padding for the G query rows)."""
    B, nh, _, D = q.shape
    kvh = k_cache.shape[1]
    qg = q.reshape(B, kvh, nh // kvh, D)
    s = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * layer.self_attn.scaling
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(v_cache.dtype)
    o = torch.matmul(p, v_cache)
    return _out_mlp(layer, x, o.reshape(B, 1, nh * D))


DECODE_ATTENTION = {"sdpa": _decode_attn_mlp, "matmul": _decode_attn_mlp_matmul}


def pick_token(model, x_last, temperature: float, keys, steps, vocab_hash):
    """final norm + lm_head + greedy / Gumbel-max pick -> token ids [B]."""
    logits = model.lm_head(model.model.norm(x_last)).float()
    if temperature == 0:
        return logits.argmax(-1)
    return (logits / temperature + gumbel_noise(keys, steps, vocab_hash)).argmax(-1)
