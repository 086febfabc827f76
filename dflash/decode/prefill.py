"""The fast engine's prefill (:mod:`dflash.decode.engine`): waiting prompts into free slots.

Padded (the default with CUDA graphs): every call runs in a fixed shape, ``rows`` prompts ×
a multiple of :data:`STEP` tokens, the unused rows aimed at a spare cache row, and each length
is captured once as a CUDA graph (all in one memory pool) and replayed: run eager, a prefill's
~1200 kernel launches held the host ~100 ms per refill on an H200 while the GPU waited (30 % of
the run's time). Unpadded: the prompts as they are, eager. Either way the host's inputs reach
the device without a stream sync, so a refill queues behind the decode steps already launched.

Owns: :class:`Prefill` (the padded lengths, their static input buffers and graphs, the host ->
device packing); the math it runs is the engine's (``Engine._prefill_body``). Imports
``models.graphs``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ..models.graphs import capture

STEP = 32  # padded prefill lengths are multiples of this


class Prefill:
    """Runs ``body(ids, lens, idx, keys)`` (device tensors only, no host sync) for a group of
    prompts. ``rows``: prompts per call; ``spare_row``: the cache row unused rows write to;
    ``cache_len`` / ``max_new``: the longest prompt is ``cache_len - max_new``; ``padded``:
    fixed shapes (captured by :meth:`capture`); ``gate``: replays run under its shared side;
    ``stats``: the engine's counters (``prefill_calls``, ``prefill_seconds``)."""

    def __init__(self, body: Callable, *, rows: int, spare_row: int, cache_len: int,
                 max_new: int, padded: bool, device, gate, stats: dict):
        self.body, self.rows, self.spare = body, rows, spare_row
        self.S, self.max_new, self.padded = cache_len, max_new, padded
        self.device, self.gate, self.stats = device, gate, stats
        self.graphs: dict[int, Any] = {}
        self.bufs: dict[int, tuple] = {}

    def lengths(self) -> list[int]:
        """The padded prefill lengths: multiples of STEP up to the longest prompt."""
        top = min(-(-(self.S - self.max_new) // STEP) * STEP, self.S)  # rounded up
        return sorted({min(L, top) for L in range(STEP, top + STEP, STEP)})

    def buffers(self, P: int) -> tuple:
        """Static device inputs of the padded prefill of length ``P`` (a spare-row no-op)."""
        if P not in self.bufs:
            n, dev = self.rows, self.device
            self.bufs[P] = (torch.zeros(n, P, dtype=torch.long, device=dev),
                            torch.ones(n, dtype=torch.long, device=dev),
                            torch.full((n,), self.spare, dtype=torch.long, device=dev),
                            torch.zeros(n, dtype=torch.long, device=dev))
        return self.bufs[P]

    def capture(self) -> None:
        """One CUDA graph per padded prefill length, all in one memory pool (they never run
        at the same time and keep no tensor alive between runs). Warm-up and capture run with
        every row aimed at the spare row, so no slot's state changes."""
        pool = torch.cuda.graph_pool_handle()
        for P in self.lengths():
            bufs = self.buffers(P)
            self.body(*bufs)  # warm-up (lazy inits) outside the capture
            torch.cuda.synchronize(self.device)
            self.graphs[P] = capture(lambda: self.body(*bufs), pool)[0]
        torch.cuda.synchronize(self.device)

    def _to_device(self, t, out=None):
        """Host -> device without a stream sync (a plain copy from pageable memory waits for
        the decode steps already queued; a pinned, non-blocking one is queued behind them)."""
        if self.device.type != "cuda":
            return t if out is None else out.copy_(t)
        t = t.pin_memory()
        return t.to(self.device, non_blocking=True) if out is None else \
            out.copy_(t, non_blocking=True)

    def run(self, slots: list[int], prompts: list[Sequence[int]], keys: list[int]) -> None:
        """Run ``prompts`` into ``slots`` and pick each first token: as they are (eager), or
        padded to ``rows`` rows × a multiple of 32 tokens (captured graph on CUDA)."""
        t0 = time.time()
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        if self.padded:
            P = next(L for L in self.lengths() if L >= longest)
            rows, fill = self.rows, self.spare  # unused rows: length 1, the spare row
        else:
            P, rows, fill = longest, n, 0
        ids = torch.zeros(rows, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        host = (ids, torch.tensor([len(p) for p in prompts] + [1] * (rows - n)),
                torch.tensor(list(slots) + [fill] * (rows - n)),
                torch.tensor(list(keys) + [0] * (rows - n), dtype=torch.long))
        with self.gate.shared():
            if self.padded:
                bufs = self.buffers(P)
                for h, b in zip(host, bufs):
                    self._to_device(h, out=b)
                if P in self.graphs:
                    self.graphs[P].replay()
                else:
                    self.body(*bufs)
            else:
                self.body(*(self._to_device(h) for h in host))
        self.stats["prefill_calls"] += 1
        self.stats["prefill_seconds"] += time.time() - t0
