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
Batch size 1; the drafter recomputes its K/V from all context features every step (no draft
KV cache: simple and exact, O(context) per step).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .model import DFlashConfig, DFlashDrafter, extract_features


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


def _cache_kw(target) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; accept either."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _crop(cache, length: int) -> None:
    """Crop the KV cache to ``length`` positions (a negative count removes from the end)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _first_stop(tokens: list[int], eos_id: int | None) -> int:
    """Number of tokens to keep: up to and including the first eos."""
    if eos_id is not None and eos_id in tokens:
        return tokens.index(eos_id) + 1
    return len(tokens)


@torch.no_grad()
def target_greedy(target, prompt_ids: torch.Tensor, max_new_tokens: int,
                  eos_id: int | None = None) -> list[int]:
    """Plain greedy decoding, one token per target forward, with the KV cache."""
    from transformers import DynamicCache

    ids = prompt_ids.reshape(1, -1)
    cache = DynamicCache(config=target.config)
    kw = _cache_kw(target)
    out = target(input_ids=ids, use_cache=True, **{kw: cache})
    tokens: list[int] = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if tok == eos_id or len(tokens) >= max_new_tokens:
            return tokens
        out = target(input_ids=torch.tensor([[tok]], device=ids.device), use_cache=True,
                     **{kw: cache})


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, cfg: DFlashConfig, embed, lm_head_weight,
                anchor: int, anchor_pos: int, features: torch.Tensor) -> torch.Tensor:
    """Greedy draft of the B-1 tokens after ``anchor`` (at position ``anchor_pos``).

    ``features`` [1, anchor_pos, n*H]: target features of every verified position < anchor_pos.
    """
    B = cfg.block_size
    dev = features.device
    block = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[0, 0] = anchor
    emb = _embed(embed, block)
    pos_blk = torch.arange(anchor_pos, anchor_pos + B, device=dev)[None]
    pos_ctx = torch.arange(anchor_pos, device=dev)[None]
    # one block at inference: it may see all context and all of itself -> no mask
    h = drafter(emb, features.to(emb.dtype), pos_blk, pos_ctx, mask=None)
    logits = h[0, 1:] @ lm_head_weight.t().to(h.dtype)
    return logits.argmax(-1)


DraftFn = Callable[[int, int, torch.Tensor], torch.Tensor]


@torch.no_grad()
def speculative_generate(target, drafter: DFlashDrafter | None, cfg: DFlashConfig, embed,
                         lm_head_weight: torch.Tensor | None, prompt_ids: torch.Tensor,
                         max_new_tokens: int, eos_id: int | None = None,
                         draft_fn: DraftFn | None = None) -> SpecResult:
    """Speculative greedy decoding; lossless w.r.t. :func:`target_greedy`.

    ``draft_fn(anchor, anchor_pos, features) -> LongTensor[B-1]`` replaces the drafter (tests use
    it to inject perfect or corrupted drafts); by default :func:`draft_block` with ``drafter``.
    """
    from transformers import DynamicCache

    B = cfg.block_size
    ids = prompt_ids.reshape(1, -1)
    dev = ids.device
    if draft_fn is None:
        def draft_fn(anchor, anchor_pos, features):
            return draft_block(drafter, cfg, embed, lm_head_weight, anchor, anchor_pos, features)

    cache = DynamicCache(config=target.config)
    kw = _cache_kw(target)
    out = target(input_ids=ids, use_cache=True, output_hidden_states=True, **{kw: cache})
    features = extract_features(out.hidden_states, cfg.target_layer_ids)   # [1, P, n*H]
    tokens = [int(out.logits[0, -1].argmax())]
    accept_counts = [0] * (B - 1)
    block_lengths: list[int] = []
    accepted: list[int] = []

    while tokens[-1] != eos_id and len(tokens) < max_new_tokens:
        anchor, anchor_pos = tokens[-1], features.shape[1]   # cache holds positions < anchor_pos
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
        new = new[:_first_stop(new, eos_id)]
        tokens += new
        block_lengths.append(len(new))
        accepted.append(n_acc)
        # keep K/V and features of the verified tokens (anchor + accepted drafts); the bonus
        # token is the next anchor and has not been through the target yet
        keep = n_acc + 1
        _crop(cache, anchor_pos + keep)
        step = extract_features(out.hidden_states, cfg.target_layer_ids)[:, :keep]
        features = torch.cat([features, step], dim=1)

    n_fwd = len(block_lengths)
    tau = sum(block_lengths) / n_fwd if n_fwd else float("nan")
    return SpecResult(tokens=tokens, target_forwards=n_fwd, tau=tau,
                      accept_counts=accept_counts, block_lengths=block_lengths,
                      accepted=accepted)


__all__ = ["SpecResult", "target_greedy", "draft_block", "speculative_generate"]
