"""The static pieces both front doors share (the data stage's :class:`dflash.decode.engine.Engine`
and the speculative :class:`dflash.decode.speculative.Decoder`): a CUDA graph reads and writes
fixed addresses, so the caches are allocated once at their full size, and the step that uses
them is compiled, warmed up and captured once, then replayed.

* :class:`TargetCache`: the target's static KV cache (one K and one V tensor per layer, ``rows``
  sequences × ``S`` positions) and the model's own RoPE rows for those positions.
* :class:`CapturedStep`: one step run ``n`` times: compiled and warmed up (the caller's
  ``warm_up``), captured into a CUDA graph under the compile gate's exclusive side, replayed
  under its shared side; eager where there is no graph (CPU, or a capture that failed: loud,
  recorded, slower, never wrong).

Owns those two, :func:`kv_cache` and :func:`round_up`. Imports ``models.graphs`` and
``runtime.gate`` only: the data stage's engine imports this module, so nothing of the drafter
belongs here (an edit there would rerun the data stage; the drafter's side of the pair,
:class:`dflash.decode.speculative_step.DraftPair`, is the decoder's own).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..models.graphs import capture, capture_or_warn, replay_or_run
from ..runtime.gate import get_gate


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def kv_cache(rows: int, heads: int, S: int, D: int, n: int, dtype, device) -> list[torch.Tensor]:
    """``n`` zeroed ``[rows, heads, S, D]`` tensors (one per layer)."""
    # one tensor per layer: views of one big tensor would differ only in storage offset, which
    # compiled code may specialise on
    return [torch.zeros(rows, heads, S, D, device=device, dtype=dtype) for _ in range(n)]


class TargetCache:
    """The target's static KV cache, ``k`` / ``v``: per layer ``[rows, kv heads, S, head dim]``
    in the model's dtype, zeroed; ``cos`` / ``sin`` [S, D] (the model's own rotary embedding)
    and ``pos_ar`` (0..S-1) for positions."""

    def __init__(self, model, *, rows: int, S: int):
        cfg, layers = model.config, list(model.model.layers)
        p = next(model.parameters())
        kvh = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        D = int(layers[0].self_attn.head_dim)
        self.k = kv_cache(rows, kvh, S, D, len(layers), p.dtype, p.device)
        self.v = kv_cache(rows, kvh, S, D, len(layers), p.dtype, p.device)
        self.pos_ar = torch.arange(S, device=p.device)
        probe = torch.zeros(1, 1, dtype=p.dtype, device=p.device)
        cos, sin = model.model.rotary_emb(probe, self.pos_ar[None])  # [1, S, D]
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()


class CapturedStep:
    """``step()`` (device tensors only, no host sync) prepared once and run ``n`` times.
    ``enabled``: whether there is anything to prepare (compile or capture; else :meth:`prepare`
    only marks it ready); ``cuda_graph``: capture after the warm-up; ``stats``: the front door's
    counters (``compile_seconds``, ``capture_seconds``, ``graph_error``); ``tag``: its name in
    warnings."""

    def __init__(self, step: Callable[[], Any], *, device, enabled: bool, cuda_graph: bool,
                 stats: dict, tag: str, gate=None):
        self.step, self.device, self.enabled = step, device, enabled
        self.cuda_graph, self.stats, self.tag = cuda_graph, stats, tag
        self.gate = gate or get_gate()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ready = False

    def prepare(self, warm_up: Callable[[], None], why: str,
                also_capture: Callable[[], None] | None = None) -> bool:
        """Once, under the gate's exclusive side (``why``: what it says while held) and
        inference mode: ``warm_up()`` (compile the step's pieces, run the step until warm),
        timed as ``compile_seconds``; then the step's capture and ``also_capture()`` (the
        engine's prefill graphs) as one attempt. False when that attempt failed (recorded in
        ``stats["graph_error"]``; a step graph captured before the failure is kept)."""
        if self.ready or not self.enabled:
            self.ready = True
            return True
        ok = True
        with self.gate.exclusive(why):
            t0 = time.time()
            with torch.inference_mode():
                warm_up()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.stats["compile_seconds"] = round(time.time() - t0, 3)
                if self.cuda_graph:
                    ok = capture_or_warn(lambda: self._capture(also_capture), self.stats,
                                         self.tag) is not None
        self.ready = True
        return ok

    def _capture(self, also_capture) -> bool:
        self.graph = capture(self.step)[0]
        torch.cuda.synchronize(self.device)
        if also_capture is not None:
            also_capture()
        return True

    def replay(self, n: int) -> None:
        """``n`` steps (the graph's replays, or the step eagerly) under the gate's shared side."""
        with self.gate.shared():
            replay_or_run(self.graph, self.step, n)


__all__ = ["round_up", "kv_cache", "TargetCache", "CapturedStep"]
