"""A step's figures on the host without stalling the device queue: every replica's loss and
per-position top-1 hits and the pre-clip gradient norm (:class:`StepReadout`), read one step
late (:class:`LaggedRecords`).

Why: reading them with ``.tolist()`` / ``float()`` right after queuing a step makes the drafter
thread wait for that step's last kernel; only then does it pack and queue the next row, so the
GPU idles while the host works. Round 11's profile of the cached epoch
(bench/results/h200/round11-2026-12-02/lease/cached__profile.json): 20.9 ms of kernels in a
28.9 ms step, the GPU idle 22 % between the captured step's replays, 2 stream syncs a step.
Here the figures go into pinned host memory with ONE non-blocking copy queued behind the step,
and an event; the pipeline reads them after it has queued the next step, when that event has
normally completed, so the host always has a step queued ahead of the one the GPU runs.

A step whose state somebody reads right after it (a checkpoint, the τ monitor, the last step,
the run's first step: ``sync_at``) is read at once, after the step before it: its books see the
weights of that step and no later one. ``DFLASH_STEP_READOUT=sync`` reads every step at once
(the A/B switch; one sync a step, as before).

Owns: the readout and the one-step lag. Imports: torch, :mod:`dflash.settings`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import settings


class StepReadout:
    """One step's device figures, copied to the host as they complete. ``results``: the step's
    :class:`dflash.train.replica.StepResult` per replica (None: no batch); ``norm``: the 0-d
    pre-clip grad norm on the lead replica's device."""

    def __init__(self, results: list, norm: torch.Tensor):
        dev = norm.device
        parts, self._shape = [], []
        for r in results:
            if r is None:
                self._shape.append(None)
                continue
            parts.append(r.loss.reshape(1).float().to(dev, non_blocking=True))
            n = 0 if r.hits is None else r.hits.numel()
            if n:
                parts.append(r.hits.reshape(-1).float().to(dev, non_blocking=True))
            self._shape.append(n)
        parts.append(norm.reshape(1).float())
        vec = torch.cat(parts)
        self.event = None
        if vec.is_cuda:
            self.host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.host.copy_(vec, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(dev))
        else:
            self.host = vec

    def values(self) -> tuple[list[float | None], list[list[float] | None], float]:
        """(loss per replica, hits per replica, grad norm); waits for the step if it is still
        running."""
        if self.event is not None:
            self.event.synchronize()
        vals, i = self.host.tolist(), 0
        losses, hits = [], []
        for n in self._shape:
            if n is None:
                losses.append(None)
                hits.append(None)
                continue
            losses.append(vals[i])
            hits.append(vals[i + 1:i + 1 + n] if n else None)
            i += 1 + n
        return losses, hits, vals[-1]


@dataclass
class Finished:
    """A step whose device work is queued: what its record needs, its figures still on the way."""
    step: int
    epoch: int
    lr: float
    results: list
    readout: StepReadout


class LaggedRecords:
    """Hands each finished step to ``record`` one step late, except where ``sync_at(step)``
    asks for it at once; ``lagged`` False (``DFLASH_STEP_READOUT=sync``): always at once.
    Steps reach ``record`` in order, each exactly once (:meth:`flush` at the end)."""

    def __init__(self, record: Callable[[Finished], Any], sync_at: Callable[[int], bool],
                 lagged: bool | None = None):
        self.record, self.sync_at = record, sync_at
        self.lagged = settings.step_readout() == "lagged" if lagged is None else lagged
        self._held: Finished | None = None

    def finished(self, done: Finished) -> None:
        self.flush()  # the step before: its figures were queued before this step's work
        if self.lagged and not self.sync_at(done.step):
            self._held = done
        else:
            self.record(done)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.record(held)

    def flush_stopping(self) -> None:
        """A run stopping on an error still books the step held back (it completed). An error
        reading it is secondary to the one that stopped the run, which the run reports."""
        with contextlib.suppress(Exception):
            self.flush()


__all__ = ["StepReadout", "Finished", "LaggedRecords"]
