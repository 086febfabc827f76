"""A target worker's own CUDA stream on a GPU it shares with a drafter (``DFLASH_TARGET_STREAM``
``own``; default ``shared``: the device's default stream, as before).

Why: on one GPU both workers queue on the default stream, so the GPU runs one thing at a time in
queue order: a cached epoch's host -> device copy of a row's features waits for the drafter's step
queued before it, and the drafter's next step waits for the copy; in epoch 0 the target's
forward and the host cache's write do the same. On its own stream the copy engine and the SMs the
drafter leaves idle run the target's work beside the drafter's step (round 10: epoch 0 40 ms a
step, the cached epochs 29 ms; bench/results/h200/round10-2026-12-02/).

The handoff (:class:`TargetStream`, :func:`consume`): the target records an event on its stream
after a row's work and queues it with the features; before using them the drafter's stream waits
for that event and records its use of every tensor (``record_stream``), so the caching allocator
does not give the memory back to the target's stream while the drafter's kernels may still read
it. Only for a target device that is also a drafter device: across GPUs the workers already run on
different hardware, and a cross-device copy syncs the threads' current streams, not this one.

Status: round 11's H200 run under ``own`` hung at step 0 (the target filled the drafter's queue,
the drafter never finished a step; bench/results/h200/round11-2026-12-02/). The cause is not
known yet; the stall watchdog (:mod:`dflash.train.stall`) now fails such a run with every
thread's stack, which is what the next measurement needs. Keep the default, ``shared``.

Owns: the stream, the event, the consumer's wait. Imports: torch, :mod:`dflash.settings`.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from .. import settings


class TargetStream:
    """One target worker's stream: ``None`` (the default stream) unless the switch is ``own``
    and ``device`` is a CUDA device a drafter also runs on."""

    def __init__(self, device: str, drafter_devices: Iterable[str]):
        dev = torch.device(device)
        shared = dev in {torch.device(d) for d in drafter_devices}
        self.stream = (torch.cuda.Stream(dev) if dev.type == "cuda" and shared
                       and settings.target_stream() == "own" else None)

    def enter(self) -> None:
        """Make it this thread's current stream (torch's current stream is per thread), so every
        copy, replay and event of the worker's thread queues there."""
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)

    def ready(self):
        """An event after the work queued so far (None on the default stream: queue order is
        the handoff there)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def consume(feats: Any, ready, device: str) -> None:
    """On the drafter's thread, before ``feats`` is used: its current stream waits for the
    target's ``ready`` event and owns a use of every tensor of ``feats`` (no-op for None)."""
    if ready is None:
        return
    cur = torch.cuda.current_stream(torch.device(device))
    cur.wait_event(ready)
    for t in tensors_of(feats):
        t.record_stream(cur)


def tensors_of(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``x``: a tensor, a dataclass-like object's attributes, a dict's values,
    a list's or tuple's items (the target worker's features and soft labels)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_of(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_of(v)
    elif hasattr(x, "__dict__"):
        yield from tensors_of(vars(x))


__all__ = ["TargetStream", "consume", "tensors_of"]
