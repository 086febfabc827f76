"""The sampler: token-budget batches, packed rows, length buckets, resumable epochs.

A *batch* is a list of sample indices whose lengths sum to at most ``token_budget`` and whose
count is at most ``max_batch_size``. Training packs one batch into one row (documents back to
back, each with its own positions and document id) padded to the smallest length bucket that
holds it, so compiled code only ever sees ``num_buckets`` shapes.

Planning is deterministic for ``(seed, epoch)``: a seeded shuffle, then first-fit-decreasing
packing inside windows of the shuffled order (keeps the randomness, fills rows to ~99 %), then a
seeded shuffle of the batches. A resumed run re-plans the same epochs, so the step number is the
whole data-order state (:class:`dflash.scheduler.StepMap` maps steps to batches).
"""
from __future__ import annotations

import bisect
import random
from typing import Sequence

from .errors import DFlashError

WINDOW_BATCHES = 16  # FFD window: this many full batches' worth of samples at a time


def bucket_lengths(token_budget: int, num_buckets: int) -> list[int]:
    """Packed-row lengths ``[budget >> (n-1), ..., budget >> 1, budget]`` (ascending)."""
    if num_buckets < 1:
        raise DFlashError(f"batching.num_buckets must be >= 1, got {num_buckets}")
    out = [token_budget >> i for i in range(num_buckets)][::-1]
    if out[0] < 1:
        raise DFlashError(f"batching.num_buckets {num_buckets} is too many for token_budget "
                          f"{token_budget}")
    return out


def bucket_for(total_tokens: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``total_tokens``."""
    i = bisect.bisect_left(buckets, total_tokens)
    if i == len(buckets):
        raise DFlashError(f"{total_tokens} tokens do not fit the largest bucket {buckets[-1]}")
    return buckets[i]


def _rng(seed: int, epoch: int, what: str) -> random.Random:
    # string seeds are hashed with sha512 by random.Random: stable across processes and versions
    return random.Random(f"dflash-sampler:{what}:{seed}:{epoch}")


def plan_epoch(lengths: Sequence[int], token_budget: int, max_batch_size: int, seed: int,
               epoch: int) -> list[list[int]]:
    """Every index of ``lengths`` exactly once, in batches within the token and count limits."""
    if token_budget < 1 or max_batch_size < 1:
        raise DFlashError(f"token_budget ({token_budget}) and max_batch_size "
                          f"({max_batch_size}) must be >= 1")
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise DFlashError(f"sample {i} has {n} tokens, more than batching.token_budget "
                              f"{token_budget}; raise the budget or lower data.max_new_tokens/"
                              f"max_prompt_tokens")
        if n < 1:
            raise DFlashError(f"sample {i} is empty ({n} tokens)")
    order = list(range(len(lengths)))
    _rng(seed, epoch, "order").shuffle(order)
    mean = max(1.0, sum(lengths) / max(1, len(lengths)))
    per_batch = max(1, min(max_batch_size, int(token_budget // mean)))
    window = max(1, WINDOW_BATCHES * per_batch)

    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: -lengths[i])  # stable
        bins: list[list[int]] = []
        room: list[int] = []
        for i in chunk:  # first fit decreasing
            n = lengths[i]
            for b, r in enumerate(room):
                if r >= n and len(bins[b]) < max_batch_size:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(token_budget - n)
        batches.extend(bins)
    _rng(seed, epoch, "batches").shuffle(batches)
    return batches


def packing_stats(batches: Sequence[Sequence[int]], lengths: Sequence[int],
                  buckets: Sequence[int]) -> dict:
    """Efficiency: real tokens over padded row tokens, and over ``batches × token_budget``."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(bucket_for(sum(lengths[i] for i in b), buckets) for b in batches)
    budget = buckets[-1] * len(batches)
    hist: dict[int, int] = {}
    for b in batches:
        L = bucket_for(sum(lengths[i] for i in b), buckets)
        hist[L] = hist.get(L, 0) + 1
    return {
        "batches": len(batches),
        "samples": sum(len(b) for b in batches),
        "real_tokens": real,
        "padded_tokens": padded,
        "efficiency_padded": real / padded if padded else 0.0,
        "efficiency_budget": real / budget if budget else 0.0,
        "mean_batch_size": sum(len(b) for b in batches) / len(batches) if batches else 0.0,
        "bucket_histogram": {str(k): v for k, v in sorted(hist.items())},
    }


def pack_row(samples: Sequence[tuple], bucket_len: int, pad_id: int):
    """Concatenate ``(sample_id, input_ids, loss_mask)`` documents into one padded PackedRow."""
    import torch

    from .masks import PackedRow

    ids, docs, pos, lm, sids = [], [], [], [], []
    for d, (sid, input_ids, loss_mask) in enumerate(samples):
        x = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        m = torch.as_tensor(loss_mask).flatten().bool()
        if x.shape != m.shape:
            raise DFlashError(f"sample {sid}: input_ids ({x.numel()}) and loss_mask "
                              f"({m.numel()}) differ in length")
        ids.append(x)
        lm.append(m)
        docs.append(torch.full_like(x, d))
        pos.append(torch.arange(x.numel(), dtype=torch.long))
        sids.append(int(sid))
    total = sum(x.numel() for x in ids)
    if total > bucket_len:
        raise DFlashError(f"samples {sids} hold {total} tokens, more than the bucket "
                          f"{bucket_len}")
    pad = bucket_len - total
    ids.append(torch.full((pad,), pad_id, dtype=torch.long))
    docs.append(torch.full((pad,), -1, dtype=torch.long))
    pos.append(torch.zeros(pad, dtype=torch.long))
    lm.append(torch.zeros(pad, dtype=torch.bool))
    return PackedRow(input_ids=torch.cat(ids), doc_ids=torch.cat(docs),
                     position_ids=torch.cat(pos), loss_mask=torch.cat(lm), sample_ids=sids)
