"""The speculative decoder's prefill (:class:`dflash.decode.speculative.Decoder`): one wave's
prompts, right-padded, into every row of the caches from position 0.

Padded (the default with CUDA graphs): the wave's longest prompt rounded up to a multiple of
:data:`dflash.decode.prefill.STEP` tokens (at most the cache), the host's inputs copied into that
length's static device buffers (pinned, non-blocking), and each length captured as a CUDA graph
the first time a wave needs it, under the compile gate's exclusive side (all lengths in one
memory pool: they never run at once and keep no tensor alive between runs), then replayed under
its shared side. Eager, the prefill is ~30 layers × ~15 kernel launches a wave: ~25 ms each on
the H200, 405 ms of a 3.6 s speculative run at batch 1 (round 8). Unpadded (CPU): the longest
prompt's length, eager. ``padded_prefill`` forces the padded path (eager on CPU: tests).

Why padding changes no token: it is the right padding a wave's shorter prompts always had.
Target cache: a row's positions ``len .. P-1`` hold K/V of padding; the row's first verify
starts at ``pos = len`` and writes positions ``pos .. pos+K-1`` before its attention reads
them (the K/V write precedes the attention in every layer), its mask hides everything past
``pos+K-1``, and ``pos`` advances by at most K a step, so each padded position is overwritten
before any query may see it (as rejected drafts' K/V are). Drafter cache: the prefill writes
context K/V at ``0 .. P-1`` (padding included); a draft writes its block at ``pos .. pos+Kd-1``
before reading it and masks past ``pos+Kd-1``, and every position below ``pos`` is a prompt
position or was rewritten by the context write of the verify that accepted it (``pos ..
pos+K-1`` each step), so padding is read by no draft either. The padded queries' own outputs
are never read: the first token comes from each row's position ``len - 1``, causal attention
keeps positions ``< len`` blind to the padding after them, and rows past the wave (``lens`` 0)
end inactive.

Owns :class:`WavePrefill` (the wave's padded length, its lazy graphs). Reuses
:class:`dflash.decode.prefill.Prefill`'s padded lengths and host -> device copy;
the math is the decoder's (``Decoder._prefill_body``, device tensors only).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..models.graphs import capture, capture_or_warn
from .prefill import Prefill


class WavePrefill(Prefill):
    """``body(ids [rows, P], lens [rows])`` for one wave of at most ``rows`` prompts, row i
    the wave's prompt i, rows past it ``lens`` 0. ``longest``: the longest prompt that fits;
    ``padded`` / ``cuda_graph``: fixed lengths, captured on CUDA; ``stats``: the decoder's
    (``prefill_graphs``, ``prefill_capture_seconds``, ``prefill_graph_error``)."""

    def __init__(self, body: Callable, *, rows: int, cache_len: int, longest: int,
                 padded: bool, cuda_graph: bool, device, gate, stats: dict):
        # Prefill's lengths() reach cache_len - max_new: the longest prompt
        super().__init__(body, rows=rows, spare_row=rows, cache_len=cache_len,
                         max_new=cache_len - longest, padded=padded, device=device, gate=gate,
                         stats=stats)
        self.cuda_graph = bool(cuda_graph) and padded and device.type == "cuda"
        self.pool = None
        self.failed: set[int] = set()
        stats["prefill_graphs"] = 0

    def buffers(self, P: int) -> tuple:
        """The wave's static inputs of padded length ``P``: ids [rows, P] and lens [rows]
        (Prefill's slot and spare-row inputs have no use in a wave: every row is its own)."""
        if P not in self.bufs:
            self.bufs[P] = (torch.zeros(self.rows, P, dtype=torch.long, device=self.device),
                            torch.zeros(self.rows, dtype=torch.long, device=self.device))
        return self.bufs[P]

    def length(self, prompts: Sequence[Sequence[int]]) -> int:
        """The wave's prefill length: its longest prompt, rounded up to a padded length."""
        longest = max(len(p) for p in prompts)
        return next(L for L in self.lengths() if L >= longest) if self.padded else longest

    def prepare(self, prompts: Sequence[Sequence[int]]) -> None:
        """The graph of this wave's padded length, if it is new: warm-up + capture under the
        gate's exclusive side (call it outside the shared side). Both run the body on the
        length's buffers between waves: the wave's own prefill then overwrites every state
        buffer and cache position they wrote. A failed capture is loud, recorded, and leaves
        that length eager."""
        P = self.length(prompts)
        if not self.cuda_graph or P in self.graphs or P in self.failed:
            return
        bufs, st = self.buffers(P), {}
        with self.gate.exclusive(f"decoder: capture the padded prefill of {P} tokens"), \
                torch.inference_mode():
            self.body(*bufs)  # warm-up (lazy inits) outside the capture
            torch.cuda.synchronize(self.device)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            graph = capture_or_warn(lambda: capture(lambda: self.body(*bufs), self.pool)[0],
                                    st, "decoder prefill")
            torch.cuda.synchronize(self.device)
        if graph is None:
            self.failed.add(P)
            self.stats["prefill_graph_error"] = st["graph_error"]
        else:
            self.graphs[P] = graph
        self.stats["prefill_graphs"] = len(self.graphs)
        self.stats["prefill_capture_seconds"] = round(
            self.stats.get("prefill_capture_seconds", 0.0) + st["capture_seconds"], 3)

    def run(self, prompts: Sequence[Sequence[int]]) -> None:  # type: ignore[override]
        """The wave's prefill under the gate's shared side: its graph's replay, or the body."""
        n, P = len(prompts), self.length(prompts)
        ids = torch.zeros(self.rows, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts] + [0] * (self.rows - n), dtype=torch.long)
        with self.gate.shared():
            if not self.padded:
                self.body(self._to_device(ids), self._to_device(lens))
                return
            bufs = self.buffers(P)
            for h, b in zip((ids, lens), bufs):
                self._to_device(h, out=b)
            if P in self.graphs:
                self.graphs[P].replay()
            else:
                self.body(*bufs)


__all__ = ["WavePrefill"]
