"""Speculative decoding one prompt at a time, on :class:`dflash.decode.speculative.Decoder` (the ONE
decoding mechanism), plus the references it is checked against.

One step: the anchor is the last accepted token (not yet run through the target); the drafter
sees the target features of every verified position before it and fills ``B-1`` mask tokens in
one pass; the target verifies ``[anchor, d_1..d_{B-1}]`` in ONE forward (with its KV cache).
Draft d_k is accepted while it equals the target's greedy choice after ``[.., anchor, d_1..d_{k-1}]``;
the target's choice at the first miss (or after the last draft) is the bonus token. Every emitted
token is therefore the target's own greedy token: the output equals :func:`target_greedy`.

τ = tokens produced per verification forward (the prefill forward, which produces the first
token for both methods, is not counted; τ is NaN when no verification ran). The last block is
truncated at ``max_new_tokens`` / eos, so its produced count may be below accepted+1.

:func:`target_greedy` (HF's own forward, one token at a time, dynamic cache) and
:func:`draft_block` + :class:`DrafterCache` (one block the reference way) are the independent
references the tests hold the decoder and the batched all-position drafts
(:func:`dflash.eval.tau.draft_every_position`) to.

``eos`` may be one id or several (chat models often stop on more than one).
"""
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from ..models.drafter import DFlashConfig, DFlashDrafter
from ..models.target import kv_cache
from .decoded import Decoded
from .speculative import Decoder

# one prompt's decode: tokens, verify forwards, τ, accept counts, per step accepted / emitted
SpecResult = Decoded


def _embed(embed, ids: torch.Tensor) -> torch.Tensor:
    """``embed`` may be the target's embedding module or its weight tensor."""
    return F.embedding(ids, embed) if isinstance(embed, torch.Tensor) else embed(ids)


def _stop_set(eos: int | Iterable[int] | None) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([int(eos)]) if isinstance(eos, int) else frozenset(int(e) for e in eos)


@torch.no_grad()
def target_greedy(target, prompt_ids: torch.Tensor, max_new_tokens: int,
                  eos_id: int | Iterable[int] | None = None) -> list[int]:
    """Plain greedy decoding, one token per target forward, with the KV cache."""
    ids = prompt_ids.reshape(1, -1)
    stops = _stop_set(eos_id)
    kw, cache = kv_cache(target)
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    tokens: list[int] = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if tok in stops or len(tokens) >= max_new_tokens:
            return tokens
        out = target(input_ids=torch.tensor([[tok]], device=ids.device), use_cache=True,
                     logits_to_keep=1, **{kw: cache})


class DrafterCache:
    """The drafter's KV cache: per layer, the context K/V of every verified position.

    A position's K/V depend only on its target features and its position
    (:meth:`DFlashDrafter.context`), so they are computed once when the target verifies the
    position and appended; the reference ``dflash_generate`` keeps the same cache (it appends the
    block's K/V too and crops them off again).
    """

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0

    @torch.no_grad()
    def extend(self, features: torch.Tensor) -> None:
        """Append the K/V of ``features`` [1, T, n*H], the next T verified positions."""
        T = features.shape[1]
        pos = torch.arange(self.length, self.length + T, device=features.device)[None]
        new = self.drafter.context(features, pos)
        self.kv = new if self.kv is None else [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
            for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += T


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, cfg: DFlashConfig, embed, lm_head_weight,
                anchor: int, anchor_pos: int, features: torch.Tensor | None = None,
                cache: DrafterCache | None = None) -> torch.Tensor:
    """Greedy draft of the B-1 tokens after ``anchor`` (at position ``anchor_pos``).

    The context is every verified position < anchor_pos: either ``features`` [1, anchor_pos, n*H]
    (recomputed K/V) or ``cache`` (a :class:`DrafterCache` holding exactly those positions).
    The drafter's dtype decides: embeddings and features are cast to it, whatever the target's.
    """
    B = cfg.block_size
    dev = (features if features is not None else cache.kv[0][0]).device
    block = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[0, 0] = anchor
    emb = _embed(embed, block)
    pos_blk = torch.arange(anchor_pos, anchor_pos + B, device=dev)[None]
    # one block at inference: it may see all context and all of itself -> no mask
    if cache is not None:
        assert cache.length == anchor_pos, (cache.length, anchor_pos)
        h = drafter(emb, None, pos_blk, None, mask=None, attention="sdpa", ctx_kv=cache.kv)
    else:
        pos_ctx = torch.arange(anchor_pos, device=dev)[None]
        h = drafter(emb, features, pos_blk, pos_ctx, mask=None, attention="sdpa")
    logits = h[0, 1:] @ lm_head_weight.t().to(h.dtype)
    return logits.argmax(-1)


DraftFn = Callable[[int, int], Sequence[int]]


@torch.no_grad()
def speculative_generate(target, drafter: DFlashDrafter | None, cfg: DFlashConfig, embed,
                         lm_head_weight: torch.Tensor | None, prompt_ids: torch.Tensor,
                         max_new_tokens: int, eos_id: int | Iterable[int] | None = None,
                         draft_fn: DraftFn | None = None, **decoder_kw) -> SpecResult:
    """Speculative greedy decoding of one prompt; lossless w.r.t. :func:`target_greedy`.

    ``draft_fn(anchor, anchor_pos) -> B-1 tokens`` replaces the drafter (tests use it to inject
    perfect or corrupted drafts). ``embed`` may be the embedding module or its weight."""
    ids = prompt_ids.reshape(-1).tolist()
    stops = sorted(_stop_set(eos_id)) or [-1]
    hook = None if draft_fn is None else (lambda _i, a, p: draft_fn(a, p))
    if isinstance(embed, torch.nn.Module):
        embed = embed.weight
    dec = Decoder(target, drafter if draft_fn is None else None, batch=1,
                  max_len=len(ids) + max_new_tokens, max_new_tokens=max_new_tokens,
                  eos_ids=stops, embed=embed, lm_head=lm_head_weight, draft_hook=hook,
                  block_size=cfg.block_size, **decoder_kw)
    return dec.decode([ids])[0]


__all__ = ["SpecResult", "DrafterCache", "target_greedy", "draft_block", "speculative_generate"]
