"""The sampler: token-budget batches, packed rows, length buckets, resumable epochs.

A *batch* is a list of sample indices whose lengths sum to at most ``token_budget`` and whose
count is at most ``max_batch_size``. Training packs one batch into one row (documents back to
back, each with its own positions and document id) padded to the smallest length bucket that
holds it, so compiled code only ever sees ``num_buckets`` shapes.

Planning is deterministic for ``(seed, epoch)``: a seeded shuffle, then first-fit-decreasing
packing inside windows of the shuffled order (keeps the randomness, fills rows to ~99 %), then a
seeded shuffle of the batches. :class:`EpochSampler` tracks ``(epoch, offset)`` so a run resumed
from a checkpoint continues with exactly the batches it had not yet trained on.
"""
from __future__ import annotations

import bisect
import hashlib
import random
from typing import Iterator, Sequence

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


def lengths_fingerprint(lengths: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(",".join(map(str, lengths)).encode())
    return h.hexdigest()[:16]


class EpochSampler:
    """Deterministic epochs of packed batches with an exact resume position ``(epoch, offset)``.

    Iterating yields ``(epoch, offset, batch)`` forever, advancing the position *before* each
    yield, so ``state_dict()`` taken after training on a batch resumes at the next one.
    """

    def __init__(self, lengths: Sequence[int], token_budget: int, max_batch_size: int,
                 seed: int):
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise DFlashError("the sampler got an empty dataset")
        self.token_budget = int(token_budget)
        self.max_batch_size = int(max_batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.offset = 0
        self._cache: dict[int, list[list[int]]] = {}
        self.batches(0)  # validate lengths now, not mid-training

    def batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[epoch] = plan_epoch(self.lengths, self.token_budget,
                                            self.max_batch_size, self.seed, epoch)
        return self._cache[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.batches(epoch))

    def total_steps(self, epochs: int) -> int:
        """Optimizer steps in ``epochs`` full epochs (batch counts may differ a little per epoch)."""
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def next_batch(self) -> tuple[int, int, list[int]]:
        plan = self.batches(self.epoch)
        if self.offset >= len(plan):
            self.epoch, self.offset = self.epoch + 1, 0
            plan = self.batches(self.epoch)
        epoch, offset = self.epoch, self.offset
        self.offset += 1
        return epoch, offset, plan[offset]

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        while True:
            yield self.next_batch()

    def remaining_in_epoch(self) -> list[list[int]]:
        """The batches not yet yielded from the current epoch."""
        return self.batches(self.epoch)[self.offset:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "token_budget": self.token_budget, "max_batch_size": self.max_batch_size,
                "num_samples": len(self.lengths),
                "lengths_fingerprint": lengths_fingerprint(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "token_budget", "max_batch_size", "num_samples",
                    "lengths_fingerprint"):
            if state.get(key) != mine[key]:
                raise DFlashError(f"cannot resume the sampler: checkpoint field '{key}' is "
                                  f"{state.get(key)!r}, this run has {mine[key]!r} (the dataset "
                                  f"or batching spec changed since the checkpoint)")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self.batches(epoch)):
            raise DFlashError(f"cannot resume the sampler: position (epoch {epoch}, offset "
                              f"{offset}) is outside the plan")
        self.epoch, self.offset = epoch, offset
