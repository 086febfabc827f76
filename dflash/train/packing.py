"""The sampler: token-budget batches, packed rows, length buckets, resumable epochs.

A *batch* is a list of sample indices whose lengths sum to at most ``token_budget`` and whose
count is at most ``max_batch_size``. Training packs one batch into one row (documents back to
back, each with its own positions and document id) padded to the smallest length bucket that
holds it, so compiled code only ever sees ``num_buckets`` shapes.

Planning is deterministic for ``(seed, epoch)``: a seeded shuffle, then rows filled from that
order as it comes and closed with the best-fitting one or two of the next samples (keeps the
randomness, fills rows to ~99.9 %), then a seeded shuffle of the batches. A resumed run
re-plans the same epochs, so the step number is the whole data-order state
(:class:`StepMap` maps steps to batches).
"""
from __future__ import annotations

import bisect
import random
from typing import Callable, Sequence

import torch

from ..errors import DFlashError
from ..models.masks import PackedRow

LOOKAHEAD = 256  # samples a row may pull forward from later in the shuffled order to close it
CLOSE_ROOM = 1.5  # x mean sample length: room left when a row stops taking the stream in order
TAIL_TRIPLES = 48  # a window this small (the epoch's tail) may close a row with three samples


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
    rows = _stream_rows([lengths[i] for i in order], token_budget, max_batch_size)
    batches = [[order[p] for p in row] for row in rows]
    _rng(seed, epoch, "batches").shuffle(batches)
    return batches


def _stream_rows(lens: Sequence[int], budget: int, max_bs: int) -> list[list[int]]:
    """Rows of positions into ``lens`` (the shuffled order), each filled in two phases.

    1. In order: a row starts with the oldest unplaced sample and takes the next ones of the
       shuffled order while at least ``CLOSE_ROOM`` x the mean length stays free, so most of a
       row is a contiguous run of a random order: as random as unpacked batches.
    2. Closing: the rest is filled with the one or two samples of the next ``LOOKAHEAD``
       unplaced ones whose lengths fill it best (repeated while anything fits). The room left
       is ~1.5-2.5 mean lengths, so the closing pair is of average length on average: no
       length grouping, and rows come out ~99.9 % full (first-fit decreasing over windows of the
       order grouped long with long and still left ~7 % empty).

    A sample waits at most until it is the oldest one (then it opens the next row). The tail:
    as the window drains, few lengths are left to pair, so rows may close with three samples;
    the last row takes the remainder (on the synthetic sets every epoch had the fewest rows
    its tokens allow; the row before the last was >= 96 % full).
    """
    n = len(lens)
    close_room = min(budget, int(CLOSE_ROOM * sum(lens) / max(1, n)) + 1)
    taken = bytearray(n)
    win: list[tuple[int, int]] = []  # (length, position) of the next LOOKAHEAD unplaced, sorted
    nxt = head = 0
    rows: list[list[int]] = []

    def take(ks, row: list[int]) -> int:
        """Move ``win[k] for k in ks`` into the row, then top the window up (after all pops:
        an insert would shift the indices still to pop)."""
        nonlocal nxt
        taken_len = 0
        for k in sorted(ks, reverse=True):
            length, p = win.pop(k)
            taken[p] = 1
            row.append(p)
            taken_len += length
        while nxt < n and len(win) < LOOKAHEAD:
            bisect.insort(win, (lens[nxt], nxt))
            nxt += 1
        return taken_len

    take((), [])
    while win:
        row: list[int] = []
        room = budget
        while len(row) < max_bs:  # phase 1: the shuffled order as it comes
            while taken[head]:
                head += 1
            length = lens[head]
            if row and (length > room or room - length < close_room or len(row) + 2 >= max_bs):
                break
            room -= take((bisect.bisect_left(win, (length, head)),), row)
            if not win:
                break
        while win and room > 0 and len(row) < max_bs:  # phase 2: close the row
            picks = _best_fill(win, room, min(3, max_bs - len(row)))
            if not picks:
                break
            room -= take(picks, row)
        rows.append(row)
    return rows


def _best_fill(win: list[tuple[int, int]], room: int, most: int) -> tuple[int, ...]:
    """Indices into the sorted ``win`` of at most ``most`` (1-3) samples with the largest total
    length <= ``room``; ``()`` if none fits. Three only in a small window (the epoch's tail,
    where few lengths are left to pair): the search is quadratic in the window."""
    k = bisect.bisect_right(win, (room, 1 << 62)) - 1
    if k < 0:
        return ()
    best, picks = win[k][0], (bisect.bisect_left(win, (win[k][0], -1)),)
    if most >= 2 and best < room:
        best, picks = _best_pair(win, 0, k, room, best, picks)
    if most >= 3 and best < room and len(win) <= TAIL_TRIPLES:
        for a in range(k - 1):
            rest = room - win[a][0]
            if 2 * win[a][0] > rest:
                break
            s, p = _best_pair(win, a + 1, k, rest, best - win[a][0], ())
            if p:
                best, picks = s + win[a][0], (a, *p)
                if best == room:
                    break
    return picks


def _best_pair(win, i: int, j: int, room: int, best: int, picks: tuple) -> tuple[int, tuple]:
    """Two pointers over ``win[i..j]`` (sorted by length): the largest pair sum <= ``room`` if
    it beats ``best``, else ``(best, picks)`` unchanged."""
    while i < j:
        s = win[i][0] + win[j][0]
        if s > room:
            j -= 1
            continue
        if s > best:
            best, picks = s, (i, j)
            if s == room:
                break
        i += 1
    return best, picks


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
        **batch_randomness(batches, lengths),
    }


def batch_randomness(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> dict:
    """How much the plan groups samples by length, in two figures (0 for random batches).

    ``length_grouping``: the share of the sample-length variance that lies between rows
    (eta squared of length by row), minus its expectation ``(rows-1)/(samples-1)`` for rows of
    random members. Packing sorted by length puts long with long: ~0.5-0.9 on a uniform spread;
    a random order scores ~0 (a full token budget per row adds a little: rows of many samples
    have short ones). ``lag1_corr``: the correlation of consecutive batches' mean sample length
    in training order, which reveals an unshuffled sorted order (~1) but not grouping within
    shuffled batches, hence both.
    """
    flat = [lengths[i] for b in batches for i in b]
    n, k = len(flat), len(batches)
    if n < 2 or k < 2:
        return {"length_grouping": 0.0, "lag1_corr": 0.0}
    mu = sum(flat) / n
    total = sum((x - mu) ** 2 for x in flat)
    means = [sum(lengths[i] for i in b) / len(b) for b in batches]
    between = sum(len(b) * (m - mu) ** 2 for b, m in zip(batches, means))
    eta2 = between / total if total else 0.0
    a, c = means[:-1], means[1:]
    ma, mc = sum(a) / len(a), sum(c) / len(c)
    cov = sum((x - ma) * (y - mc) for x, y in zip(a, c))
    va = sum((x - ma) ** 2 for x in a)
    vc = sum((y - mc) ** 2 for y in c)
    lag1 = cov / (va * vc) ** 0.5 if va > 0 and vc > 0 else 0.0
    return {"length_grouping": eta2 - (k - 1) / (n - 1), "lag1_corr": lag1}


def pack_row(samples: Sequence[tuple], bucket_len: int, pad_id: int):
    """Concatenate ``(sample_id, input_ids, loss_mask)`` documents into one padded PackedRow."""
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


class StepMap:
    """Global step -> (epoch, step within epoch). Epochs may hold different numbers of batches
    (the packing is re-planned per epoch), so steps per epoch = ceil(batches(epoch) / M)."""

    def __init__(self, epoch_batches: Callable[[int], list], M: int, ranks: int = 1,
                 rank: int = 0):
        self.epoch_batches, self.M = epoch_batches, M
        self.ranks, self.rank = ranks, rank  # nodes, and this node's rank
        self.starts = [0]  # starts[e] = first global step of epoch e
        self._cache: dict[int, list] = {}

    def batches(self, epoch: int) -> list:
        if epoch not in self._cache:
            self._cache = {epoch: self.epoch_batches(epoch)}  # keep one epoch in memory
        return self._cache[epoch]

    def steps_in(self, epoch: int) -> int:
        return max(1, -(-len(self.batches(epoch)) // (self.M * self.ranks)))

    def batch_index(self, local_step: int, r: int) -> int:
        """The batch of the epoch plan that this rank's replica r trains at a step."""
        return (local_step * self.ranks + self.rank) * self.M + r

    def locate(self, step: int) -> tuple[int, int]:
        while self.starts[-1] <= step:
            e = len(self.starts) - 1
            self.starts.append(self.starts[-1] + self.steps_in(e))
        for e in range(len(self.starts) - 1):
            if self.starts[e] <= step < self.starts[e + 1]:
                return e, step - self.starts[e]
        raise AssertionError(step)

    def total_for_epochs(self, epochs: int) -> int:
        return sum(self.steps_in(e) for e in range(epochs))
