"""What the feature cache stores of a row, and back (:mod:`dflash.train.feature_cache` is the
store): the value a target worker hands over as per-token *planes* (the features; a distilling
objective's soft labels scattered to their row positions) and the value rebuilt from planes read
for a row; float8_e4m3 storage with one scale per (token, group); int64 indices of token spans.

Imports: torch, :mod:`dflash.models.target_output`, :mod:`dflash.train.cache_budget` (FP8).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..models.target_output import SoftLabels, TargetOutput, soft_positions_on
from .cache_budget import FP8

FP8_MAX = 448.0


def as_planes(value: Any, L: int) -> dict[str, torch.Tensor]:
    """What the target handed over, as per-token planes of ``L`` rows: a ``[1, L, W]`` tensor or
    a :class:`~dflash.models.target_output.TargetOutput` (soft labels scattered to their row
    positions; the other rows of those planes are zeros and never read back)."""
    if torch.is_tensor(value):
        return {"features": value.reshape(L, -1)}
    out = {"features": value.features.reshape(L, -1)}
    soft = value.soft
    if soft is not None:
        for name, t in (("soft_ids", soft.token_ids), ("soft_logprobs", soft.logprobs)):
            dense = torch.zeros((L, t.shape[-1]), dtype=t.dtype, device=t.device)
            dense[soft.positions] = t
            out[name] = dense
    return out


def from_planes(planes: dict[str, torch.Tensor], row, tensor: bool) -> Any:
    """The value the target would hand over, from planes read for ``row``."""
    feats = planes["features"][None]
    if tensor:
        return feats
    soft = None
    if "soft_ids" in planes:
        pos = soft_positions_on(row, feats.device)
        soft = SoftLabels(pos, planes["soft_ids"][pos], planes["soft_logprobs"][pos])
    return TargetOutput(feats, soft)


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3 with one scale per (token, group): ``[T, W] -> ([T, W] fp8, [T, groups])``."""
    g = x.float().reshape(x.shape[0], groups, -1)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (g / scale[..., None]).to(FP8).reshape(x.shape)
    return q, scale


def stored_arrays(name: str, t: torch.Tensor, store: torch.dtype, groups: int) -> dict:
    """Plane ``name``'s values ``t`` as the store keeps them: ``{name: t in store}``, or with
    float8 storage ``{name: fp8 values, name + ".scale": float32 scales}``."""
    if store != FP8:
        return {name: t.to(store)}
    q, scale = quantize(t, groups)
    return {name: q, name + ".scale": scale}


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out``'s first ``len(idx)`` rows = ``src[idx]``, the rest zeros (a row's padding)."""
    n = idx.numel()
    torch.index_select(raw_bytes(src), 0, idx, out=raw_bytes(out[:n]))
    raw_bytes(out[n:]).zero_()
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, groups: int, dtype) -> torch.Tensor:
    g = q.float().reshape(q.shape[0], groups, -1) * scale[..., None]
    return g.reshape(q.shape).to(dtype)


def span_index(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """int64 ``[o, o + n)`` of each ``(o, n)`` span, concatenated (host)."""
    return torch.cat([torch.arange(o, o + n, dtype=torch.int64) for o, n in spans]
                     or [torch.zeros(0, dtype=torch.int64)])


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 as bytes: copies and fills of float8 tensors are not implemented everywhere."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
