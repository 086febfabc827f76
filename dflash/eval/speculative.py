"""Greedy (lossless) speculative decoding with a DFlash drafter, and the target-only baseline.

One step: the anchor is the last accepted token (not yet run through the target); the drafter
sees the target features of every verified position before it and fills ``B-1`` mask tokens in
one pass; the target verifies ``[anchor, d_1..d_{B-1}]`` in ONE forward (with its KV cache).
Draft d_k is accepted while it equals the target's greedy choice after ``[.., anchor, d_1..d_{k-1}]``;
the target's choice at the first miss (or after the last draft) is the bonus token. Every emitted
token is therefore the target's own greedy token: the output equals :func:`target_greedy`.

τ = tokens produced per verification forward (the prefill forward, which produces the first
token for both methods, is not counted; τ is NaN when no verification ran). The last block is
truncated at ``max_new_tokens`` / eos, so its produced count may be below accepted+1.
Batch size 1. The drafter keeps a KV cache of its context (:class:`DrafterCache`, as the
reference implementation does): the context K/V of a position are computed once, when the target
verifies it, and appended, so a block costs O(block) drafter work plus attention over the cache,
not a recomputation from every context feature. ``use_drafter_cache=False`` recomputes (the
tests check both give the same drafts).

``eos`` may be one id or several (chat models often stop on more than one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..models.drafter import DFlashConfig, DFlashDrafter, extract_features


@dataclass
class SpecResult:
    tokens: list[int]                 # generated tokens only (prompt excluded)
    target_forwards: int              # verification forwards (prefill excluded)
    tau: float                        # mean tokens produced per verification forward
    accept_counts: list[int]          # [B-1]: blocks whose draft position k (1..B-1) was accepted
    block_lengths: list[int] = field(default_factory=list)  # tokens produced by each forward
    accepted: list[int] = field(default_factory=list)  # drafts matched per forward (pre-truncation)


def _embed(embed, ids: torch.Tensor) -> torch.Tensor:
    """``embed`` may be the target's embedding module or its weight tensor."""
    return F.embedding(ids, embed) if isinstance(embed, torch.Tensor) else embed(ids)


def _crop(cache, length: int) -> None:
    """Crop the KV cache to ``length`` positions (a negative count removes from the end)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _stop_set(eos: int | Iterable[int] | None) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([int(eos)]) if isinstance(eos, int) else frozenset(int(e) for e in eos)


def _first_stop(tokens: list[int], stops: frozenset[int]) -> int:
    """Number of tokens to keep: up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1
    return len(tokens)


@torch.no_grad()
def target_greedy(target, prompt_ids: torch.Tensor, max_new_tokens: int,
                  eos_id: int | Iterable[int] | None = None) -> list[int]:
    """Plain greedy decoding, one token per target forward, with the KV cache."""
    from ..models.target import kv_cache

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


DraftFn = Callable[[int, int, torch.Tensor], torch.Tensor]


@torch.no_grad()
def speculative_generate(target, drafter: DFlashDrafter | None, cfg: DFlashConfig, embed,
                         lm_head_weight: torch.Tensor | None, prompt_ids: torch.Tensor,
                         max_new_tokens: int, eos_id: int | Iterable[int] | None = None,
                         draft_fn: DraftFn | None = None,
                         use_drafter_cache: bool = True) -> SpecResult:
    """Speculative greedy decoding; lossless w.r.t. :func:`target_greedy`.

    ``draft_fn(anchor, anchor_pos, features) -> LongTensor[B-1]`` replaces the drafter (tests use
    it to inject perfect or corrupted drafts); by default :func:`draft_block` with ``drafter``,
    reading its context from a :class:`DrafterCache` (``use_drafter_cache``) or recomputing it.
    """
    from ..models.target import kv_cache

    B = cfg.block_size
    ids = prompt_ids.reshape(1, -1)
    dev = ids.device
    stops = _stop_set(eos_id)
    dcache = DrafterCache(drafter) if draft_fn is None and use_drafter_cache else None
    keep_features = dcache is None
    if draft_fn is None:
        def draft_fn(anchor, anchor_pos, features):
            return draft_block(drafter, cfg, embed, lm_head_weight, anchor, anchor_pos,
                               features, dcache)

    kw, cache = kv_cache(target)
    out = target(input_ids=ids, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                 **{kw: cache})
    step = extract_features(out.hidden_states, cfg.target_layer_ids)     # [1, P, n*H]
    features = step if keep_features else None
    if dcache is not None:
        dcache.extend(step)
    n_verified = ids.shape[1]
    tokens = [int(out.logits[0, -1].argmax())]
    accept_counts = [0] * (B - 1)
    block_lengths: list[int] = []
    accepted: list[int] = []

    while tokens[-1] not in stops and len(tokens) < max_new_tokens:
        anchor, anchor_pos = tokens[-1], n_verified   # cache holds positions < anchor_pos
        assert cache.get_seq_length() == anchor_pos
        draft = draft_fn(anchor, anchor_pos, features).reshape(-1).to(dev)
        block = torch.cat([torch.tensor([anchor], device=dev), draft])[None]   # [1, B]
        out = target(input_ids=block, use_cache=True, output_hidden_states=True, **{kw: cache})
        greedy = out.logits[0].argmax(-1)                    # target's choice after each prefix
        match = (draft == greedy[:-1]).long()
        n_acc = int(match.cumprod(0).sum())                  # longest matching prefix
        for k in range(n_acc):
            accept_counts[k] += 1
        new = draft[:n_acc].tolist() + [int(greedy[n_acc])]  # accepted drafts + bonus token
        new = new[:max_new_tokens - len(tokens)]
        new = new[:_first_stop(new, stops)]
        tokens += new
        block_lengths.append(len(new))
        accepted.append(n_acc)
        # keep K/V and features of the verified tokens (anchor + accepted drafts); the bonus
        # token is the next anchor and has not been through the target yet
        keep = n_acc + 1
        _crop(cache, anchor_pos + keep)
        step = extract_features(out.hidden_states, cfg.target_layer_ids)[:, :keep]
        n_verified += keep
        if keep_features:
            features = torch.cat([features, step], dim=1)
        if dcache is not None and tokens[-1] not in stops and len(tokens) < max_new_tokens:
            dcache.extend(step)

    n_fwd = len(block_lengths)
    tau = sum(block_lengths) / n_fwd if n_fwd else float("nan")
    return SpecResult(tokens=tokens, target_forwards=n_fwd, tau=tau,
                      accept_counts=accept_counts, block_lengths=block_lengths,
                      accepted=accepted)


__all__ = ["SpecResult", "DrafterCache", "target_greedy", "draft_block", "speculative_generate"]
