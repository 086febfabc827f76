"""The spec's dtype names as torch dtypes (``target.dtype``, ``drafter.dtype``): one table."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


__all__ = ["DTYPES", "dtype_of"]
