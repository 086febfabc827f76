"""The target's feature forward on a packed row as one CUDA graph per row length.

Why: the compiled feature extractor still launches every kernel from Python, one compiled call
per decoder layer plus the BlockMask's construction, and the H200 machines' launches are slow
(a 30-layer one-token forward: 22-26 ms eager, 3.2 ms replayed as a graph; DESIGN.md §9). For a
small target the row's arithmetic (SmolLM2-135M, 8,192 tokens: ~1.7 TFLOP, ~2 ms) is then a
fraction of its launch time. Captured once per row length, a row costs one copy of its ids into
static buffers, one replay and one copy of the output.

What is captured: the document BlockMask's construction (compiled), the embedding, rotary and
every loaded decoder layer of :class:`dflash.models.features.FeatureExtractor` (compiled), the
concatenation of the feature layers. Only the values of the inputs change between replays
(ids, document ids, positions), never their shapes or addresses, so the captured kernels read
each new row. The first call for a length runs the extractor once (it compiles, under the
compile gate's exclusive side like any first call), then captures; a capture that fails falls
back to the compiled, uncaptured forward for that length, and says so once.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from .graphs import capture


class CapturedFeatures:
    """``fx(input_ids, doc_ids, position_ids)`` with the same features, from CUDA graphs."""

    def __init__(self, fx, device: str, log=print):
        self.fx, self.device, self.log = fx, torch.device(device), log
        self._graphs: dict[int, Any] = {}  # row length -> (graph, static inputs, output) | None
        self._lock = threading.Lock()

    def __call__(self, input_ids, doc_ids, position_ids):
        L = int(input_ids.shape[-1])
        # the capture stream and a replay belong to the current device: make it the target's
        with self._lock, torch.cuda.device(self.device):  # one replay at a time per extractor
            if L not in self._graphs:
                self._graphs[L] = self._capture(input_ids, doc_ids, position_ids)
            entry = self._graphs[L]
            if entry is None:
                return self.fx(*(t.to(self.device) for t in (input_ids, doc_ids, position_ids)))
            graph, static, out = entry
            static.copy_(_stacked(input_ids, doc_ids, position_ids), non_blocking=True)
            graph.replay()
            # the next replay overwrites ``out``: the consumer gets its own copy
            return out.clone()

    def _capture(self, input_ids, doc_ids, position_ids):
        static = _stacked(input_ids, doc_ids, position_ids).to(self.device)
        run = lambda: self.fx(static[0], static[1], static[2])  # noqa: E731
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm (and compile) off the capture, as torch asks
                run()
                run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph, out = capture(run)
            return graph, static, out
        except Exception as e:  # noqa: BLE001 - fall back, and say so
            self.log(f"[target] CUDA graph capture of the {static.shape[-1]}-token feature "
                     f"forward on {self.device} failed ({type(e).__name__}: {e}); this length "
                     f"runs the compiled forward uncaptured")
            return None


def _stacked(input_ids, doc_ids, position_ids) -> torch.Tensor:
    """[3, L] long: ids, document ids, positions in one (pinned, when on the host) tensor, so a
    row's inputs reach the device in one non-blocking copy."""
    x = torch.stack([input_ids.long(), doc_ids.long(), position_ids.long()])
    return x.pin_memory() if x.device.type == "cpu" and torch.cuda.is_available() else x
