"""A device's busy seconds, as the scheduler's workers measure them (:class:`DeviceBusy`): CUDA
timing-event pairs read once they have completed (no host-device sync), or the host clock on
CPU. ``dflash.runtime.status`` turns the seconds into busy fractions.
"""
from __future__ import annotations

import time

import torch


def sync(device) -> None:
    """Wait for the work queued on a CUDA ``device`` (a no-op elsewhere): before reading the host
    clock around a region, so the seconds are the device's, not the queueing's."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class DeviceBusy:
    """Seconds of work a thread queued on its CUDA device, from timing-event pairs read once
    they have completed: no host-device sync (drafter steps run asynchronously). On CPU the
    work is synchronous and the host clock is the measure."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device.startswith("cuda")
        self.pending: list = []
        self.seconds = 0.0

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def stop(self, start) -> None:
        if not self.cuda:
            self.seconds += time.perf_counter() - start
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self.pending.append((start, ev))
        self.collect(block=False)

    def collect(self, block: bool) -> float:
        keep = []
        for a, b in self.pending:
            if block:
                b.synchronize()
            if b.query():
                self.seconds += a.elapsed_time(b) / 1000.0
            else:
                keep.append((a, b))
        self.pending = keep
        return self.seconds
