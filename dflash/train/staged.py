"""A training step's record read one step late: its device values (grad norm, losses, hits)
copied to pinned host memory behind a CUDA event, so the scheduler reads them without draining
the device (:meth:`dflash.train.scheduler.Pipeline._record_lagged` says why)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Staged:
    """One step's record with its device values (grad norm, then per replica the loss and the
    hits) copied to the host behind an event: :meth:`values` waits for that copy only, not
    for the work queued after it. A captured step's outputs live in static buffers the next
    replay overwrites, so the copy is queued right after the step, before the next one."""
    step: int
    epoch: int
    lr: float
    results: list
    host: torch.Tensor
    event: Any = None

    @classmethod
    def of(cls, step: int, epoch: int, norm, lr: float, results: list) -> "Staged":
        dev = norm.device if torch.is_tensor(norm) else torch.device("cpu")
        parts = [torch.as_tensor(norm, dtype=torch.float32, device=dev).reshape(1)]
        for r in results:
            if r is not None:
                parts.append(r.loss.detach().reshape(1).float().to(dev, non_blocking=True))
                if r.hits is not None:
                    parts.append(r.hits.float().to(dev, non_blocking=True))
        vals = torch.cat(parts)
        if dev.type != "cuda":
            return cls(step, epoch, lr, results, vals)
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
        host.copy_(vals, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        return cls(step, epoch, lr, results, host, event)

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def unpack(self) -> tuple[float, list, list | None, list | None]:
        """(grad norm, per-replica losses (None: no row), summed hits and counts per block
        position (None: no replica had hits))."""
        vals = self.values()
        norm, losses, hits, counts = vals.pop(0), [], None, None
        for r in self.results:
            if r is None:
                losses.append(None)
                continue
            losses.append(vals.pop(0))
            if r.hits is None:
                continue
            h, vals = vals[:len(r.counts)], vals[len(r.counts):]
            hits = h if hits is None else [a + b for a, b in zip(hits, h)]
            counts = r.counts if counts is None else [a + b for a, b in zip(counts, r.counts)]
        return norm, losses, hits, counts
