"""``monitor.profile_steps``: N steady-state steps of the real training run under torch.profiler,
summarised beside the train manifest (``results/<spec>/train/profile.json``).

One process-wide profiler (``profile_all_threads``: the workers are Python threads, which a
plain profiler would not see), started and stopped by drafter replica 0 between two steps
(:meth:`StepProfiler.at_step`), so the window holds whole steps of every worker. The profiler
only observes: it takes no gate and changes no compiled code (it is not tracing), and on CUDA
it sees the kernels inside the captured graph replays (the drafter's step, the target's row)
through CUPTI. Each worker labels its work ``dflash.worker/<name>`` (:func:`worker_label`);
:mod:`dflash.train.profile_summary` turns the window's events into the summary. The raw trace is
not kept: the summary is small, a trace is not.

Owns: the profile window. Imports torch, ``dflash.artifacts.manifest`` and the summary.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..artifacts.manifest import atomic_write_text
from .profile_summary import LABEL, Ev, events_of, is_label, summarise

__all__ = ["LABEL", "OFFSET_STEPS", "Ev", "StepProfiler", "events_of", "is_label", "summarise",
           "window_for", "worker_label"]

# steps past the run's first step before the window may open: the first steps still fill the
# queues and the caching allocator (the warm start has compiled everything already); also
# monitor.profile_start's default (the global step the window opens at)
OFFSET_STEPS = 3


def worker_label(name: str):
    """The label a worker's step work runs under (cheap while no profiler runs)."""
    return record_function(LABEL + name)


def window_for(start_step: int, total_steps: int, n: int,
               at: int = OFFSET_STEPS) -> tuple[int, int]:
    """[first, end) of the profiled steps: from global step ``at`` (``monitor.profile_start``:
    e.g. inside a cached epoch) but never before ``OFFSET_STEPS`` past where this process
    started (a resumed run fills its queues too), or the run's last ``n`` steps when it is too
    short for that."""
    first = min(max(at, start_step + OFFSET_STEPS), max(start_step, total_steps - n))
    return first, min(total_steps, first + n)


class StepProfiler:
    """Started by replica 0 before step ``first``, stopped before step ``end``
    (:meth:`at_step`); :meth:`summary` then reads what it recorded."""

    def __init__(self, steps: int, start_step: int, total_steps: int, devices: list[str],
                 at: int = OFFSET_STEPS):
        self.first, self.end = window_for(start_step, total_steps, steps, at)
        self.epochs: list[int] = []  # the epochs of the window's first and last step
        self.cuda = sorted({d for d in devices if d.startswith("cuda")})
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.activities = ["cpu"] + (["cuda"] if self.cuda else [])
        self._acts = acts
        self.prof = None  # made on the thread that starts it (kineto registers it there)
        self.running = self.done = False
        self.before: dict = {}
        self.after: dict = {}
        self._t0 = 0.0
        self.wall_s = 0.0  # the window's wall time, the profiler's start to its stop

    def _snapshot(self, pipe) -> dict:
        cache = getattr(pipe, "cache", None)
        return {"busy": dict(pipe.busy_s), "wait": dict(pipe.wait_s),
                "memory": {d: torch.cuda.memory_stats(d) for d in self.cuda},
                "cache_rows_read": cache.stats["rows_read"] if cache is not None else None}

    def at_step(self, step: int, pipe) -> None:
        """Replica 0, between steps: open the window before ``first``, close it before
        ``end`` (the devices drained first, so every kernel of the window is recorded)."""
        if step == self.first and not self.running and not self.done:
            self.before = self._snapshot(pipe)
            self.epochs = [pipe.step_map.locate(s)[0] for s in (self.first, self.end - 1)]
            # the shared side: never while another thread holds the exclusive one (a capture
            # or a compile must not see the profiler switch on mid-way)
            with pipe.gate.shared():
                self.prof = profile(activities=self._acts, experimental_config=torch._C.
                                    _profiler._ExperimentalConfig(profile_all_threads=True))
                self._t0 = time.perf_counter()  # before start: no event precedes it
                self.prof.start()
            self.running = True
        elif step >= self.end and self.running:
            self.stop(pipe)

    def stop(self, pipe) -> None:
        if not self.running:
            return
        with pipe.gate.shared():
            for d in self.cuda:
                torch.cuda.synchronize(d)
            self.prof.stop()
            self.wall_s = time.perf_counter() - self._t0  # after stop: none follows it
        self.running, self.done = False, True
        self.after = self._snapshot(pipe)

    def summary(self) -> dict:
        """The window as figures (:func:`summarise`); ``{"skipped": ...}`` if it never ran."""
        if not self.done:
            return {"skipped": "the run ended before the profile window closed",
                    "first_step": self.first, "steps": 0}
        s = summarise(events_of(self.prof.profiler.kineto_results.events()),
                      self.end - self.first, self.first, self.activities, self.before,
                      self.after, self.wall_s)
        # where the window sat: its steps' epochs, and how many of the rows its target side
        # handed over (counted when read, so a few steps ahead) came from the feature cache
        read = [x.get("cache_rows_read") for x in (self.before, self.after)]
        s.update(last_step=self.end - 1, epochs=self.epochs,
                 feature_cache_rows_read=None if None in read else read[1] - read[0])
        return s

    def write(self, path: Path) -> dict:
        s = self.summary()
        atomic_write_text(path, json.dumps(s, indent=1) + "\n")
        return s
