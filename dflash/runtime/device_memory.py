"""The GPU memory a stage held, for its manifest (``peak_device_memory``): per CUDA device it
used, the caching allocator's reserved peak. ``dflash validate`` prints the estimates that the
GPU-sharing rule reads (:func:`dflash.train.budget.stage_memory`,
:func:`dflash.runtime.resources.units`); a run's manifests show how far they are from what
happened. The CUDA context and the libraries' workspaces are outside the allocator (some
hundreds of MB a process); a CPU device records nothing.
"""
from __future__ import annotations

from typing import Iterable

import torch


def peak_device_memory(devices: Iterable[str]) -> dict[str, int]:
    """{cuda device: peak reserved bytes} for the CUDA devices among ``devices``."""
    cuda = sorted({d for d in devices if str(d).startswith("cuda")})
    if not cuda or not torch.cuda.is_available():
        return {}
    return {d: int(torch.cuda.max_memory_reserved(d)) for d in cuda}
