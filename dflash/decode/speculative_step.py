"""The speculative decoder's own step pieces (:mod:`dflash.decode.speculative`), beside the layer
pieces it shares with the data engine (:mod:`dflash.models.layers`): the greedy head with its
top-2 margin, the drafter's RoPE in the shared pieces' calling convention, and the drafter's
context K/V of verified positions; :class:`DraftPair`, the drafter's side of the target +
drafter pair the decoder drives (its static KV cache and RoPE rows, the embedding and lm_head it
shares with the target, its fused GEMM weights); and :class:`StepGlue`, the step's glue between the layers
(prologues, the drafter's context write, acceptance) as methods over the decoder's buffers.

Owns those; the decoder compiles each as one region and captures them in its step. Imports
``models.drafter``, ``models.layers``, :mod:`dflash.decode.static` (``kv_cache``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.drafter import apply_rope, rope_cos_sin
from ..models.layers import fused_weights, write_kv
from .static import kv_cache


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


class DraftPair:
    """The drafter's side of the target + drafter pair the speculative decoder drives:
    ``layers``, its static KV cache ``k`` / ``v`` (per layer ``[rows, kv heads, S, head dim]``),
    ``cos`` / ``sin`` [S, D] (the drafter's RoPE), ``embed`` / ``lm_w`` (the weights shared with
    the target, default the target's own, in the drafter's dtype), ``feature_ids`` (the target
    layers feeding it), ``mask_id``; with ``fused`` the concatenated GEMM weights per layer
    (:func:`fused_weights`) and the context K/V projections (``ctx_w``), else None each."""

    def __init__(self, drafter, target, *, rows: int, S: int, pos_ar: torch.Tensor,
                 fused: bool, embed: torch.Tensor | None = None,
                 lm_head: torch.Tensor | None = None):
        c, dev, dt = drafter.cfg, pos_ar.device, drafter.dtype
        self.drafter, self.dtype = drafter, dt
        self.feature_ids = set(c.target_layer_ids)
        self.layers = list(drafter.layers)
        self.fused = [fused_weights(lay) if fused else None for lay in self.layers]
        self.ctx_w = context_kv_weights(drafter) if fused else None
        self.k = kv_cache(rows, c.num_key_value_heads, S, c.head_dim, len(self.layers), dt, dev)
        self.v = [torch.zeros_like(t) for t in self.k]
        cos, sin = rope_cos_sin(pos_ar[None], c.head_dim, c.rope_theta, dt)
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        emb = embed if embed is not None else target.get_input_embeddings().weight
        head = lm_head if lm_head is not None else target.lm_head.weight
        self.embed = emb.to(device=dev, dtype=dt)
        self.lm_w = head.to(device=dev, dtype=dt)
        self.mask_id = int(c.mask_token_id)


class StepGlue:
    """The speculative step's glue between the layers, as methods over the decoder's static
    buffers (:class:`dflash.decode.speculative.Decoder` is one; the compile scopes compile
    these bound methods as regions): the target's and the drafter's prologues, the drafter's
    context K/V write, the test hook's drafts, and acceptance."""

    def _target_in(self, ids, qpos):
        """The target's prologue: embeddings, RoPE rows and causal cache mask [N, 1, L, S]."""
        x = self.target.model.embed_tokens(ids)
        mask = (self.pos_ar[None, None, :] <= qpos[:, :, None])[:, None]
        return x, self.cos[qpos], self.sin[qpos], mask

    def _verify_in(self, drafts):
        """The verify's inputs: ids ``[anchor, drafts]``, their positions, the prologue."""
        qpos = self.pos[:, None] + self.k_ar                                  # [N, K]
        ids = self.tok[:, None] if drafts is None else torch.cat([self.tok[:, None], drafts], 1)
        return (qpos, *self._target_in(ids, qpos))

    def _context(self, feats, qpos, fn=None) -> None:
        """The drafter's context K/V of these verified positions into its cache."""
        rows = self.slot_ar[:, None]
        cos, sin = self.d_cos[qpos][:, None], self.d_sin[qpos][:, None]
        kv = (fn or self._ctx)(self.drafter, torch.cat(feats, dim=-1).to(self.d_dtype), cos, sin,
                               self.d_ctx_w)
        for (k, v), kc, vc in zip(kv, self.dk_cache, self.dv_cache):
            write_kv(kc, vc, rows, qpos, k, v)

    def _draft_in(self):
        """The drafter's prologue: block ``[anchor, mask × (Kd-1)]`` embedded at positions
        ``pos .. pos+Kd-1``, its RoPE rows, the mask over the cache up to the block's end."""
        qpos = self.pos[:, None] + self.d_ar                                  # [N, Kd]
        block = torch.where(self.d_ar == 0, self.tok[:, None], self.mask_id)
        x = F.embedding(block, self.d_embed)
        mask = (self.pos_ar[None, :] <= qpos[:, -1:])[:, None, None].expand(
            self.N, 1, self.Kd, self.S)
        return qpos, x, self.d_cos[qpos], self.d_sin[qpos], mask

    def _hook_drafts(self):
        """Drafts from the test hook, one sequence at a time (eager only)."""
        rows = [list(self.hook(self._wave + i, int(t), int(p)))[:self.K - 1] if a else
                [0] * (self.K - 1) for i, (t, p, a) in
                enumerate(zip(self.tok.tolist(), self.pos.tolist(), self.active.tolist()))]
        return torch.tensor(rows, dtype=torch.long, device=self.device).reshape(self.N, -1)

    def _accept_all(self, drafts, greedy, margin) -> None:
        """The accepted prefix ``n`` of the drafts (the longest equal to the target's greedy
        tokens), what is emitted, and :meth:`_accept`."""
        if drafts is None:
            return self._accept(greedy, greedy, margin, torch.zeros_like(self.pos))
        n_acc = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)           # [N]
        proposed = torch.cat([drafts, greedy[:, -1:]], dim=1)
        emitted = torch.where(self.k_ar < n_acc[:, None], proposed, greedy)
        self._accept(emitted, greedy, margin, n_acc)

    def _accept(self, emitted, greedy, margin, n_acc) -> None:
        """Per sequence: emit the accepted drafts + bonus (up to eos / max_new), log, advance."""
        K, act, ar = self.K, self.active, self.k_ar[None]
        valid = (ar <= n_acc[:, None]) & act[:, None]
        self.checked += valid.sum()
        self.mismatches += (valid & (emitted != greedy)).sum()
        eos = (emitted[:, :, None] == self.eos).any(-1) & valid
        first_eos = torch.where(eos, ar, K).amin(1)
        count = torch.minimum(torch.minimum(n_acc + 1, first_eos + 1), self.max_new - self.gen)
        count = torch.where(act, count, torch.zeros_like(count))
        write = ar < count[:, None]
        at = self.gen[:, None] + ar
        rows = self.slot_ar[:, None]
        self.out[rows, at] = torch.where(write, emitted, self.out[rows, at])
        self.margin[rows, at] = torch.where(write, margin, self.margin[rows, at])
        s = self.steps.clamp(max=self.max_new)
        self.acc_log[self.slot_ar, s] = torch.where(act, n_acc, self.acc_log[self.slot_ar, s])
        self.len_log[self.slot_ar, s] = torch.where(act, count, self.len_log[self.slot_ar, s])
        finished = act & ((first_eos < count) | (self.gen + count >= self.max_new))
        bonus = greedy.gather(1, n_acc[:, None])[:, 0]
        self.steps += act.long()
        self.gen += count
        # a finished row keeps its position: it is stepped on until the next check (and while
        # other rows run), and past its last block its verify would index beyond the caches
        # (round 16: a device-side assert at batch 16); nothing reads a finished row's pos
        self.pos += torch.where(act & ~finished, n_acc + 1, torch.zeros_like(n_acc))
        self.tok.copy_(torch.where(act, bonus, self.tok))
        self.active &= ~finished
