"""The data stage's worker pool: :func:`generate_chunks` spreads chunks of prompts over several
target copies, each with its own generator (:func:`dflash.decode.generate.open_generator`), and
:class:`ChunkProgress` is its console line.

Owns the pool and its progress line. Imports :mod:`dflash.decode.generate` (the chunk type).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Iterator, Sequence

from ..decode.generate import Chunk


# ---------------------------------------------------------------------------------------------
# the worker pool: chunks over several target copies
# ---------------------------------------------------------------------------------------------
def generate_chunks(devices: Sequence[str], open_one: Callable[[str], object],
                    chunks: Iterable[Chunk],
                    on_chunk: Callable[[str, int, list[list[int]], float], None]) -> list:
    """Generate every chunk: one worker thread per device, each with its own generator
    (``open_one(device)``, opened and prepared in that thread), taking the next chunk as it
    finishes one. ``on_chunk(device, chunk id, answers, start time)`` runs in the worker's
    thread as each chunk is done (it must be thread-safe). The first error (or Ctrl-C) stops
    every worker after its current chunk and is raised; chunks already handed to ``on_chunk``
    stay done. Returns the generators, in ``devices`` order (their settings, setup times)."""
    work: queue.Queue = queue.Queue()
    for item in chunks:
        work.put(item)
    stop = threading.Event()
    gens: list = [None] * len(devices)

    def next_chunks() -> Iterator[Chunk]:
        while not stop.is_set():
            try:
                yield work.get_nowait()
            except queue.Empty:
                return

    def worker(i: int, dev: str) -> None:
        try:
            gens[i] = gen = open_one(dev)
            gen.prepare()
            for chunk, answers, tc in gen.run_chunks(next_chunks()):
                on_chunk(dev, chunk, answers, tc)
        except BaseException:
            stop.set()  # the other workers stop after their current chunk
            raise

    with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="gen") as pool:
        futures = [pool.submit(worker, i, dev) for i, dev in enumerate(devices)]
        try:
            for f in as_completed(futures):
                f.result()
        except BaseException:
            stop.set()
            raise
    return gens


class ChunkProgress:
    """A chunked generation's console line (``log``): one per chunk, at most one per 5 s unless
    ``every_chunk`` (the fast engine finishes several a second), from any worker thread; and
    the new tokens so far. ``resumed``: chunks already done before this run."""

    def __init__(self, n_chunks: int, resumed: int, log: Callable[[str], None],
                 every_chunk: bool):
        self.n, self.resumed, self.every_chunk, self.log = n_chunks, resumed, every_chunk, log
        self.chunks, self.new_tokens, self.logged = resumed, 0, 0.0
        self.lock = threading.Lock()
        self.t0 = time.time()

    def done(self, dev: str, samples: int, new: int, tc: float) -> None:
        with self.lock:
            self.chunks += 1
            self.new_tokens += new
            now = time.time()
            el = now - self.t0
            left = self.n - self.chunks
            if now - self.logged >= 5 or left == 0 or self.every_chunk:
                self.logged = now
                rate = self.new_tokens / el if el else 0.0
                eta = el / max(1, self.chunks - self.resumed) * left
                self.log(f"chunk {self.chunks}/{self.n} on {dev}: {samples} "
                    f"samples, {new} new tokens in {now - tc:.1f}s; overall "
                    f"{rate:.1f} tok/s, ETA {eta:.0f}s")
