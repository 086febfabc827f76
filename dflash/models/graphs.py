"""CUDA-graph capture, the one way the package does it: :func:`capture` (a callable's kernels as
one graph, in thread-local capture mode, so other threads' eager work does not abort it) and
:func:`capture_or_warn` (a capture whose failure is recorded and printed, after which the caller
runs the same work uncaptured), and :func:`replay_or_run` (n steps through the graph, or
through the uncaptured step when there is none). Used by the generation engine, the speculative decoder and the
target's captured feature forward.

Owns the capture and replay calls only; what is captured, its static buffers and when it replays belong to
the callers (each under the compile gate's exclusive side).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], Any], pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(the graph of ``fn()``'s kernels, what ``fn`` returned: the graph's static output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def capture_or_warn(run: Callable[[], T], stats: dict, tag: str) -> T | None:
    """``run()`` (which captures), timed into ``stats["capture_seconds"]``; if it raises, the
    error goes to ``stats["graph_error"]`` and stderr, loudly, and the result is None (the
    caller then runs uncaptured: slower, never wrong)."""
    t0 = time.time()
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - loud, recorded: the steps then run uncaptured
        stats["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"[{tag}] WARNING: CUDA-graph capture failed, running uncaptured (slower): "
              f"{stats['graph_error']}", file=sys.stderr, flush=True)
        return None
    finally:
        stats["capture_seconds"] = round(time.time() - t0, 3)


def replay_or_run(graph: torch.cuda.CUDAGraph | None, step: Callable[[], Any], n: int) -> None:
    """``n`` steps: the captured graph's replays, or ``step()`` eagerly where capture failed or
    never ran (CPU). The caller holds the compile gate's shared side around it."""
    for _ in range(n):
        if graph is not None:
            graph.replay()
        else:
            step()
