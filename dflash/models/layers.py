"""A Llama-family decoder layer's math, written on the HF model's own modules, and the one way we
compile it (regional compilation).

Three users run the target's layers themselves instead of through HF's forward: the generation
engine (:class:`dflash.decode.engine.Engine`: static KV cache, CUDA graphs), the speculative
decoder (:class:`dflash.decode.speculative.Decoder`: the target's verify step and the drafter's
layers, captured) and the feature extractor (:class:`dflash.models.features.FeatureExtractor`:
packed rows, document mask). All call these functions
with the layer module as the first argument and compile them with :func:`compile_region`: dynamo
lifts the layer's parameters to graph inputs, so ONE compiled graph serves every layer (one
compile, not one per layer), and inductor fuses what eager mode runs as separate memory-bound
kernels: RMSNorm, rotary, SiLU·mul, the residual adds.

Architectures: ``input_layernorm → self_attn (q/k/v/o projections, optional q_norm/k_norm as in
Qwen3) → post_attention_layernorm → mlp`` with full attention (``llama``, ``qwen2``, ``qwen3``);
:func:`unsupported_reason` says why another model is not.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """Why these functions cannot run ``model``'s decoder layers (None when they can)."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or (
            getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)):
        return "sliding-window attention layers"
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic",
                                                                              "longrope"):
        return f"rope_type {rope.get('rope_type', rope.get('type'))!r} (length-dependent)"
    base = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, attr):
            return f"no model.{attr}"
    return None


def rope_of(layer) -> Callable:
    """The model's own ``apply_rotary_pos_emb`` (from the layer's modeling module)."""
    return getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb")


def fused_weights(layer) -> tuple:
    """``(w_qkv, b_qkv, w_gate_up, b_gate_up)``: the layer's q/k/v and gate/up projections each
    concatenated (a copy), so :func:`qkv` and :func:`out_mlp` run one GEMM where the modules run
    three and two: fewer kernels, and wider ones (more thread blocks for a small batch of
    tokens). The same dot products as the modules' (biases None where the modules have none)."""
    a, m = layer.self_attn, layer.mlp

    def cat(mods):
        w = torch.cat([p.weight for p in mods])
        if all(p.bias is None for p in mods):
            return w, None
        return w, torch.cat([p.bias if p.bias is not None else
                             torch.zeros_like(p.weight[:, 0]) for p in mods])

    return (*cat((a.q_proj, a.k_proj, a.v_proj)), *cat((m.gate_proj, m.up_proj)))


def qkv(layer, x, cos, sin, rope, fused=None):
    """input_layernorm + q/k/v projections (+ q/k norms) + rotary: -> q [B,nh,L,D], k/v [B,kvh,L,D].
    ``fused``: :func:`fused_weights` of the layer (one GEMM for q, k and v)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    B, L = h.shape[:2]
    D = attn.head_dim
    if fused is None:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    else:
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        q, k, v = F.linear(h, fused[0], fused[1]).split(sizes, dim=-1)
    q, k, v = q.view(B, L, -1, D), k.view(B, L, -1, D), v.view(B, L, -1, D)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    return q, k, v


def write_kv(k_cache, v_cache, rows, qpos, k, v) -> None:
    """k/v [B,kvh,L,D] into the static caches [B,kvh,S,D] at positions ``qpos`` [B,L] of
    ``rows`` [B,1], in place (inside a compiled region: one scatter kernel each, fused with the
    rotary that produces ``k``; inductor writes the mutated input buffer, no cache copy)."""
    k_cache[rows, :, qpos] = k.transpose(1, 2)
    v_cache[rows, :, qpos] = v.transpose(1, 2)


def cached_layer(layer, x, cos, sin, rope, k_cache, v_cache, rows, qpos, mask, fused=None):
    """One whole layer over a static KV cache: :func:`qkv`, the K/V write at ``qpos``
    (:func:`write_kv`, mutating the caches) and :func:`attend_cache`. Compiled as ONE region it
    is one graph for every layer of a model (the caches are inputs like the weights) and a
    few kernels fewer than the pieces apart (the writes fuse with the rotary and the mask; on
    CPU's inductor 15 launches per layer against 17). ``fused``: :func:`fused_weights`."""
    q, k, v = qkv(layer, x, cos, sin, rope, fused)
    write_kv(k_cache, v_cache, rows, qpos, k, v)
    return attend_cache(layer, x, q, k_cache, v_cache, mask, fused)


def out_mlp(layer, x, o, fused=None):
    """o_proj + residual, post_attention_layernorm + mlp + residual (o: [B, L, nh*D]);
    ``fused``: :func:`fused_weights` (one GEMM for gate and up)."""
    x = x + layer.self_attn.o_proj(o)
    h = layer.post_attention_layernorm(x)
    if fused is None:
        return x + layer.mlp(h)
    mlp = layer.mlp
    gate, up = F.linear(h, fused[2], fused[3]).chunk(2, dim=-1)
    return x + mlp.down_proj(getattr(mlp, "act_fn", F.silu)(gate) * up)


def compile_region(fn: Callable, backend, fullgraph: bool = False,
                   mode: str | None = None, static: bool = True) -> Callable:
    """The one regional compile: ``fn`` (a layer module first, for a per-layer region) is
    compiled once with static shapes (a graph per shape, shared by every layer). Call the
    result only inside the compile gate (:mod:`dflash.runtime.gate`): its first call per shape
    compiles. ``fullgraph``: a graph break is an error (a region meant as one graph); ``mode``:
    torch.compile's (e.g. "max-autotune-no-cudagraphs": Triton GEMM templates tried against
    cuBLAS per shape, epilogues fused; a longer compile). ``static=False``: torch's automatic
    dynamic shapes instead (the first shape compiles static; a dimension seen at a second size
    recompiles symbolic once, and that graph serves every later size: a sweep over batch sizes
    and verify widths compiles about once, not once per shape)."""
    kw = {"mode": mode} if mode else {}
    return torch.compile(fn, backend=backend, dynamic=False if static else None,
                         fullgraph=fullgraph, **kw)


def attend_cache(layer, x, q, k_cache, v_cache, mask, fused=None):
    """``L`` queries attending over a static KV cache row per sequence, then :func:`out_mlp`.

    q [B, nh, L, D]; k_cache/v_cache [B, kvh, S, D] (the queries' own K/V already written);
    mask [B, 1, L, S] bool (True = attend). GQA without copying K/V: the G query heads of one KV
    head and the L queries form one query-length dim of G*L rows (head h = j*G + g, the order
    of HF's repeat_kv), so SDPA reads every cached K/V once per KV head.
    """
    B, nh, L, D = q.shape
    kvh, S = k_cache.shape[1], k_cache.shape[2]
    G = nh // kvh
    qg = q.reshape(B, kvh, G * L, D)
    m = mask[:, :, None].expand(B, 1, G, L, S).reshape(B, 1, G * L, S)
    o = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=m,
                                       scale=layer.self_attn.scaling)
    o = o.reshape(B, kvh, G, L, D).permute(0, 3, 1, 2, 4).reshape(B, L, nh * D)
    return out_mlp(layer, x, o, fused)
