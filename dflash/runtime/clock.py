"""A piece of work's wall seconds per named phase: the stages' manifests record them as
``seconds_by_phase`` and the bench's τ part as ``bench_seconds.tau_parts``.

Imports: the standard library only.
"""
from __future__ import annotations

import time


class PhaseClock:
    """Wall seconds per phase (``<phase>_s``): each :meth:`end` closes the phase that ran since
    the clock started or the last phase ended, so the phases are contiguous and sum to the wall
    (each rounded to a millisecond)."""

    def __init__(self):
        self._t = self._start = time.perf_counter()
        self.seconds: dict[str, float | None] = {}

    def elapsed(self) -> float:
        """Seconds since the clock started (the stage's whole wall, its phases and any after)."""
        return time.perf_counter() - self._start

    def end(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[f"{phase}_s"] = round(now - self._t, 3)
        self._t = now

    def skip(self, phase: str) -> None:
        """A phase that did not run this time: recorded as None, its (near-zero) time left to
        the next phase."""
        self.seconds[f"{phase}_s"] = None

    def summary(self) -> str:
        """One log line's worth: ``prompts 80.1s, generation 118.0s, ...``."""
        return ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in self.seconds.items()
                         if v is not None)
