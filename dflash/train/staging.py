"""Reusable host staging buffers for the feature cache's copies between the store and a device
(:mod:`dflash.train.feature_cache`): a row's planes pass through one *slot* of a small ring
instead of a fresh (pinned) allocation per plane per row.

A slot is a set of ``[rows, width]`` buffers keyed by plane, pinned when CUDA copies go through
them, grown to the largest row seen and then kept. It is handed to one user at a time
(:meth:`StagingRing.acquire`) and comes back with the CUDA event recorded after its last
asynchronous copy (:meth:`StagingRing.release`): its next user first waits for that event, so a
buffer is never overwritten while a non-blocking copy may still read or fill it. Slots are handed
out in FIFO order, the oldest release first, so that wait is normally already over. When every
slot is out the ring grows by one instead of waiting: the callers hold the compile gate (shared),
and waiting there on another thread's release could deadlock behind a queued exclusive
(:mod:`dflash.runtime.gate`, rule 1). Its size is therefore the peak number of rows staged at once,
which the cache bounds (``MAX_PENDING_WRITES`` for writes; one per target worker for reads).
"""
from __future__ import annotations

import threading
from collections import deque

import torch


class StagingRing:
    """At first ``slots`` reusable buffer sets (grown on demand); thread-safe (several target
    workers read and write)."""

    def __init__(self, slots: int, pin: bool):
        self.pin = pin
        self._free: deque[int] = deque(range(slots))
        self._bufs: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list = [None] * slots
        self._lock = threading.Lock()

    def acquire(self) -> int:
        """A free slot (a new one if none is), once the copy its last user enqueued completed."""
        with self._lock:
            if not self._free:
                self._free.append(len(self._bufs))
                self._bufs.append({})
                self._events.append(None)
            slot = self._free.popleft()
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            event.synchronize()
        return slot

    def buffer(self, slot: int, key: str, rows: int, width: int, dtype) -> torch.Tensor:
        """The first ``rows`` rows of the slot's ``key`` buffer (reallocated only to grow)."""
        buf = self._bufs[slot].get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != width or buf.dtype != dtype:
            have = buf.shape[0] if buf is not None and buf.shape[1] == width else 0
            buf = torch.empty((max(rows, have), width), dtype=dtype, pin_memory=self.pin)
            self._bufs[slot][key] = buf
        return buf[:rows]

    def release(self, slot: int, device: str | torch.device | None = None) -> None:
        """Give the slot back; ``device``: a CUDA device whose current stream holds copies that
        use the slot (an event recorded now guards its next user)."""
        event = None
        if device is not None and torch.device(device).type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        with self._lock:
            self._events[slot] = event
            self._free.append(slot)

    @property
    def slots(self) -> int:
        return len(self._bufs)

    def data_ptrs(self) -> set[int]:
        """Every buffer's address (tests: reads reuse the same few buffers)."""
        return {b.data_ptr() for bufs in self._bufs for b in bufs.values()}
