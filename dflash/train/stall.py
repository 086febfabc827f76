"""The train stage's stall watchdog (``monitor.stall_s``): a run in which no step completes for
that long fails, naming the step it is stuck at and showing where every worker thread is.

Why: a worker can hang without raising (a CUDA stream waiting on an event that never fires, a
lock taken in the wrong order, a peer that stopped answering). The threads then wait forever,
the status line repeats "step 0/N" and the user learns nothing until an outer timeout kills the
job: round 11's own-stream run (bench/results/h200/round11-2026-12-02/) waited 150 s at step 0
that way. Failing with each thread's Python stack turns that wait into a diagnosis.

The clock restarts at every completed step, so a long step (a checkpoint write, τ while
training, a profiled window) counts only against its own length. The pipeline's main thread
calls :meth:`StallWatch.check` between its joins.

Owns: the deadline and the report, and what a stopped run says (:func:`failure_message`).
Imports: the standard library only.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback

STACK_FRAMES = 12  # innermost frames shown per thread: enough to see the blocking call


class Stalled(RuntimeError):
    """No train step completed within ``monitor.stall_s``."""


class StallWatch:
    """``stall_s`` None or 0: never fires."""

    def __init__(self, stall_s: float | None, clock=time.perf_counter):
        self.stall_s, self.clock = stall_s, clock
        self._steps, self._since = None, clock()

    def check(self, steps_done: int, total_steps: int, threads: list[threading.Thread],
              first_step_s: dict) -> Stalled | None:
        """The error to fail the run with, once ``steps_done`` has not moved for ``stall_s``."""
        now = self.clock()
        if steps_done != self._steps:
            self._steps, self._since = steps_done, now
            return None
        if not self.stall_s or now - self._since < self.stall_s:
            return None
        never = [t.name for t in threads if t.name != "feeder" and t.name not in first_step_s]
        return Stalled(
            f"no train step completed in {now - self._since:.0f} s (monitor.stall_s "
            f"{self.stall_s:g}): stuck after step {steps_done} of {total_steps}; workers that "
            f"never finished a first step: {', '.join(never) or 'none'}\n"
            f"--- where each thread is ---\n{thread_stacks(threads)}")


def failure_message(name: str, device: str, exc: BaseException, tb: str,
                    threads: list[threading.Thread]) -> str:
    """What a stopped run says: the failed worker and its error, the traceback of a raised one
    (a watchdog's own error was never raised) and the threads still running after the stop."""
    alive = [t.name for t in threads if t.is_alive()]
    msg = f"worker {name} on {device} failed: {type(exc).__name__}: {exc}"
    if exc.__traceback__ is not None:
        msg += f"\n--- worker traceback ---\n{tb}"
    if alive:
        msg += f"\nstill running 10 s after the stop (blocked outside Python?): {', '.join(alive)}"
    return msg


def thread_stacks(threads: list[threading.Thread]) -> str:
    """Each live thread's innermost Python frames, by thread name."""
    frames = sys._current_frames()
    out = []
    for t in threads:
        frame = frames.get(t.ident) if t.is_alive() else None
        if frame is None:
            out.append(f"[{t.name}] not running")
            continue
        stack = traceback.format_stack(frame)[-STACK_FRAMES:]
        out.append(f"[{t.name}]\n" + "".join(stack).rstrip())
    return "\n".join(out)


__all__ = ["Stalled", "StallWatch", "failure_message", "thread_stacks"]
