"""A row's small tensors (its document and position ids, its blocks' anchors, ids, positions,
labels) to the device in ONE copy from pinned host memory (:class:`PackedLayout`).

Why: the step used to copy each of them on its own, eight copies a row from pageable host
memory. A pageable host-to-device copy is staged by the driver and may wait for the stream's
queued work, so the drafter thread waited for the step before it at every copy (round 11's
profile of the cached epoch: 17 cudaMemcpyAsync a step taking 19 ms of host time, the GPU idle
22 % between steps; bench/results/h200/round11-2026-12-02/lease/cached__profile.json). One
pinned buffer copies asynchronously; the device tensors are views into one byte buffer.

The pinned host buffer comes from torch's caching host allocator, which holds a block back
until the copy that reads it has completed: a fresh buffer per row is safe to drop at once.

Owns: the layout, packing and the views. Imports: torch.
"""
from __future__ import annotations

import torch

ALIGN = 64  # bytes: every view starts aligned, as compiled kernels expect of their inputs


class PackedLayout:
    """Where each named tensor of one shape set lies in one byte buffer."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.items: list[tuple[str, torch.dtype, tuple, int, int]] = []
        off = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            self.items.append((name, t.dtype, tuple(t.shape), off, nbytes))
            off += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)

    def pack(self, tensors: dict[str, torch.Tensor], pin: bool) -> torch.Tensor:
        """The host byte buffer holding ``tensors`` (pinned with ``pin``); their shapes and
        dtypes must be the layout's."""
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        for name, dtype, shape, off, nbytes in self.items:
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, the layout has "
                                 f"{shape} {dtype}")
            if nbytes:
                host[off:off + nbytes].view(dtype).copy_(t.reshape(-1))
        return host

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into ``flat`` (a byte buffer of :attr:`nbytes`)."""
        return {name: flat[off:off + nbytes].view(dtype).view(shape)
                for name, dtype, shape, off, nbytes in self.items}

    def to_device(self, tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        """``tensors`` on ``device`` as views of one buffer, through one copy (non-blocking, from
        pinned memory, on CUDA); the CPU takes the same path, so its tests run the views too."""
        cuda = torch.device(device).type == "cuda"
        host = self.pack(tensors, pin=cuda)
        return self.views(host.to(device, non_blocking=True) if cuda else host)


__all__ = ["PackedLayout", "ALIGN"]
