"""The bounded target-feature cache across epochs (``features.cache: host | disk``).

What it owns: the storage of what the target worker hands the drafter, per *sample* (not per
packed row: every epoch re-plans the packing) and the one rule for when a row is
served from it.

* Epoch 0 writes: after the target computed a row, the real tokens' features go to the host
  (a non-blocking device-to-host copy; a writer thread moves them into the store and only then
  sets the sample's ``filled`` flag, the commit). Each sample is stored as computed in its
  epoch-0 row.
* Epochs >= 1 read: a row whose samples are all filled, or pending from an epoch-0 row this run
  still computes (:meth:`FeatureCache.expect`; waited for), is gathered from the store instead
  of running the target. The rule depends on the plan only, never on timing, so a run is as
  deterministic with the cache as without it. Padding positions read back as zeros: the
  drafter's mask never lets a block see padding, so they do not change its loss.
* Storage: ``device`` keeps them in the memory of the target's own device (one target worker):
  a write is one ``index_copy_`` and a read one ``index_select`` there, queued on the stream
  the worker's other work uses, so no host staging, no copy across PCIe and no writer thread
  (round 11: the host cache's read and copy made a cached step 28.9 ms for 20.9 ms of kernels,
  bench/results/h200/round11-2026-12-02/; a SmolLM2 cache, 61.7 GB, fits an H200 beside
  training's ~1 GB); lost on a kill, like ``host``.
  ``host`` keeps tensors in process memory (lost on a kill: a resumed run recomputes
  what the killed one had stored, so it is exactly-once but its features of those rows come
  from their new packing); ``disk`` keeps raw memory-mapped files (no pickle) under
  ``results/<spec>/train/feature_cache/``, created atomically (a temporary folder renamed after
  its ``meta.json``) and reopened by a resumed run when the fingerprint matches (a kill -9
  loses no committed sample: the page cache keeps what was written). A completed run deletes it.
* dtype: ``target`` (bit-exact), ``bfloat16``, or ``float8_e4m3`` with one float32 scale per
  token and feature layer (scale = amax / 448; |error| <= max(|x| / 16, scale / 1024)).
* Budget (:mod:`dflash.train.cache_budget`): tokens x feature layers x hidden x bytes (+ scales),
  checked against free device memory, host memory or disk before heavy work; a cache that does not fit is
  refused with the figures. Caching a share f of the samples would serve a row only when all of
  its ~n samples are stored (~f^n of the rows), so a partial cache saves next to nothing: we refuse rather than pretend.

What the target hands the drafter, a :class:`~dflash.models.target_output.TargetOutput`, is
stored whole: one *plane* per per-token field (:func:`dflash.train.cache_budget.planes_for`): the features, and with a
distilling objective the soft labels' token ids and log-probs (scattered to their row positions
on write; on read their positions come from the row itself, as the target worker computes them).
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from ..artifacts.manifest import atomic_write_json, fingerprint
from ..runtime.gate import get_gate
from ..spec.types import cache_mode
from .cache_budget import FP8, Plane, cache_device, cache_dir, planes_for
from .feature_planes import (as_planes, dequantize, from_planes, gather_rows, raw_bytes,
                             span_index, stored_arrays)
from .staging import StagingRing

MAX_PENDING_WRITES = 4  # rows staged on the host and not yet in the store (bounds pinned memory)
# staging slots at first (one row's planes each; staging.py grows a ring rather than wait): writes,
# one per pending row; reads, two, so one row's gather overlaps the previous row's copy to the GPU
STAGING_SLOTS = {"write": MAX_PENDING_WRITES, "read": 2}
WAIT_S = 600.0  # a served row's pending sample that stays unwritten this long is a bug: raise


class CacheStopped(Exception):
    """A wait for a sample ended because the run is stopping."""


# ---------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------
class _Arrays:
    """Per plane a ``[T, width]`` array (+ ``[T, groups]`` scales) and one flag per sample; in
    memory (host) or as raw memory-mapped files (disk: no pickle, reopened after a kill)."""

    def __init__(self, planes: list[Plane], tokens: int, samples: int, folder: Path | None,
                 ident: dict, device: torch.device | None = None):
        self.folder = folder
        shapes = {}
        for p in planes:
            shapes[p.name] = ((tokens, p.width), p.store)
            if p.store == FP8:
                shapes[p.name + ".scale"] = ((tokens, p.groups), torch.float32)
        shapes["filled"] = ((samples,), torch.uint8)
        if folder is None:  # the flags stay on the host: the serving rule reads them there
            self.t = {k: torch.zeros(s, dtype=d) if k == "filled" else
                      torch.empty(s, dtype=d, device=device) for k, (s, d) in shapes.items()}
            self.mmaps: list = []
            return
        self.mmaps = []
        self.t = self._open(folder, shapes, ident)

    def _open(self, folder: Path, shapes: dict, ident: dict) -> dict:
        meta = folder / "meta.json"
        want = fingerprint(ident)
        if folder.exists():
            try:
                ok = json.loads(meta.read_text()).get("fingerprint") == want
            except (OSError, ValueError):
                ok = False
            if not ok:  # another run's cache, or a torn creation
                shutil.rmtree(folder)
        if not folder.exists():
            tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for k, (s, d) in shapes.items():
                with open(tmp / f"{k}.bin", "wb") as f:  # sparse: no bytes written yet
                    f.truncate(_nbytes(s, d))
            atomic_write_json(tmp / "meta.json", {"fingerprint": want, "ident": ident})
            os.replace(tmp, folder)
        out = {}
        for k, (s, d) in shapes.items():
            mm = np.memmap(folder / f"{k}.bin", dtype=np.uint8, mode="r+",
                           shape=(_nbytes(s, d),))
            self.mmaps.append(mm)
            out[k] = torch.from_numpy(mm).view(d).view(s)
        return out

    def flush(self) -> None:
        for mm in self.mmaps:
            mm.flush()


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class FeatureCache:
    """The cache of one run (see the module docstring). Thread-safe: target workers write
    distinct samples; readers wait for pending ones."""

    def __init__(self, planes: list[Plane], sample_ids: Sequence[int], lengths: Sequence[int],
                 folder: Path | None = None, ident: dict | None = None, gate=None,
                 tensor_values: bool = False, device: str | None = None):
        """``device``: the store lives there (``features.cache: device``; the one target
        worker's device, which every write and read must come from), else on the host or, with
        ``folder``, on disk."""
        self.planes = {p.name: p for p in planes}
        self.device = None if device is None else torch.device(device)
        self.index = {int(s): i for i, s in enumerate(sample_ids)}
        self.lengths = [int(n) for n in lengths]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        ident = {"planes": [(p.name, p.width, str(p.store), p.groups) for p in planes],
                 "lengths_fp": fingerprint(self.lengths), **(ident or {})}
        self.a = _Arrays(planes, self.offsets[-1], len(self.lengths), folder, ident,
                         self.device)
        self.folder = folder
        # what read() returns: a TargetOutput (the pipeline's value) or the bare features tensor
        self.tensor_values = tensor_values
        self.gate = gate
        self._pending: set[int] = set()
        self._cond = threading.Condition()
        self._writes: list[Future] = []
        self._wlock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-cache")
        self._rings: dict[str, StagingRing] = {}  # "read" / "write" host staging (staging.py)
        self.stats = {"rows_written": 0, "rows_read": 0, "samples_written": 0}

    # ---- the serving rule ------------------------------------------------------------------
    def filled(self, sid: int) -> bool:
        return bool(self.a.t["filled"][self.index[int(sid)]])

    def expect(self, indices: Iterable[int]) -> None:
        """Dataset indices of the samples this run's epoch 0 will still write (see
        :func:`epoch0_samples`): a reader of a later epoch waits for them."""
        with self._cond:
            self._pending |= {int(i) for i in indices if not self.a.t["filled"][int(i)]}

    def serves(self, sids: Sequence[int]) -> bool:
        """The row is read from the cache: each sample is stored or pending (plan-determined)."""
        with self._cond:
            return all(self.filled(s) or self.index[int(s)] in self._pending for s in sids)

    def wait_for(self, sids: Sequence[int], stop: threading.Event | None = None,
                 poll_s: float = 0.1) -> None:
        """Block (holding no gate) until every sample of a served row is stored."""
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not all(self.filled(s) for s in sids):
                if time.monotonic() > deadline:
                    missing = [int(s) for s in sids if not self.filled(s)]
                    raise RuntimeError(f"feature cache: samples {missing[:8]} were expected "
                                       f"from epoch 0 but not written within {WAIT_S:.0f} s")
                if stop is not None and stop.is_set():
                    raise CacheStopped
                self._check_writes()  # a failed write would never commit: raise it here
                self._cond.wait(poll_s)

    # ---- write (epoch 0) -------------------------------------------------------------------
    def write(self, row, value) -> None:
        """Stage the row's new samples to the host; the writer thread stores and commits them."""
        todo, start = [], 0
        for s in row.sample_ids:
            i, n = self.index[int(s)], self.lengths[self.index[int(s)]]
            if not self.a.t["filled"][i]:
                todo.append((i, start, n))
            start += n
        if not todo:
            return
        planes = as_planes(value, row.input_ids.shape[0])
        if self.device is not None:
            self._write_in_place(todo, planes)
            return
        dev = planes["features"].device
        cuda = dev.type == "cuda"
        self._bound_writes()
        ring = self._ring("write", cuda)
        slot = ring.acquire()
        try:
            host = {}
            for name, t in planes.items():
                t = t[:start]
                p = self.planes[name]
                for k, v in stored_arrays(name, t, p.store, p.groups).items():
                    # the one copy off the device (CPU: off the caller's tensor, which it may reuse)
                    host[k] = ring.buffer(slot, k, start, v.shape[1], v.dtype)
                    raw_bytes(host[k]).copy_(raw_bytes(v), non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
            fut = self._pool.submit(self._store, todo, host, event, slot)
        except BaseException:
            ring.release(slot, dev if cuda else None)
            raise
        with self._wlock:
            self._writes.append(fut)

    def _store(self, todo, host: dict, event, slot: int) -> None:
        try:
            if event is not None:
                event.synchronize()
            # staging -> store, the second and last copy: one contiguous copy per sample (an
            # index_copy_ of the whole row measured ~3x slower on one thread, 2-core box)
            with self._shared():
                for i, start, n in todo:
                    off = self.offsets[i]
                    for k, v in host.items():
                        raw_bytes(self.a.t[k][off:off + n]).copy_(raw_bytes(v[start:start + n]))
        finally:
            self._rings["write"].release(slot)  # read back synchronously: no copy in flight
        self._commit(todo)

    def _write_in_place(self, todo: list, planes: dict) -> None:
        """A device store: each plane's new samples in one ``index_copy_`` on the caller's
        stream, committed at once (a read of the same device queues after it)."""
        dst = self._on_store(span_index([(self.offsets[i], n) for i, _, n in todo]))
        src = self._on_store(span_index([(start, n) for _, start, n in todo]))
        for name, t in planes.items():
            p = self.planes[name]
            t = t.to(self.device).index_select(0, src)
            for k, v in stored_arrays(name, t, p.store, p.groups).items():
                raw_bytes(self.a.t[k]).index_copy_(0, dst, raw_bytes(v))
        self._commit(todo)

    def _on_store(self, idx: torch.Tensor) -> torch.Tensor:
        """A host index on the store's device: pinned and non-blocking on CUDA, so the caller
        never waits for the work queued before it (a pageable copy would sync)."""
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _commit(self, todo: list) -> None:
        with self._cond:
            for i, _, _ in todo:
                self.a.t["filled"][i] = 1  # the commit: after the data
                self._pending.discard(i)
            self.stats["rows_written"] += 1
            self.stats["samples_written"] += len(todo)
            self._cond.notify_all()

    def _bound_writes(self) -> None:
        self._check_writes()
        while True:
            with self._wlock:
                if len(self._writes) < MAX_PENDING_WRITES:
                    return
                oldest = self._writes.pop(0)
            oldest.result()

    def _check_writes(self) -> None:
        with self._wlock:
            done = [f for f in self._writes if f.done()]
            self._writes = [f for f in self._writes if not f.done()]
        for f in done:
            f.result()  # a writer error surfaces in a worker thread

    def flush(self) -> None:
        """Every staged row stored and (disk) written back: call before a checkpoint."""
        while True:
            with self._wlock:
                if not self._writes:
                    break
                f = self._writes.pop(0)
            f.result()
        self.a.flush()

    # ---- read (epochs >= 1) ----------------------------------------------------------------
    def read(self, row, device: str):
        """The row's value from the store: real tokens from their samples, zeros on padding.

        Per stored array one gather (``index_select``, parallel over intra-op threads) into a
        reused staging buffer, then one non-blocking copy to ``device``; on CPU that copy is a
        clone, so the value never aliases a buffer the next read refills."""
        L = row.input_ids.shape[0]
        if self.device is not None:
            return self._read_in_place(row, L, device)
        cuda = torch.device(device).type == "cuda"
        idx = self.row_index(row.sample_ids)
        ring = self._ring("read", cuda)
        slot = ring.acquire()
        staged = {}
        try:
            for k, src in self.a.t.items():
                if k == "filled":
                    continue
                buf = gather_rows(src, idx, ring.buffer(slot, k, L, src.shape[1], src.dtype))
                staged[k] = buf.to(device, non_blocking=True) if cuda else buf.clone()
        finally:
            ring.release(slot, device if cuda else None)
        return self._value(staged, row)

    def _read_in_place(self, row, L: int, device: str):
        """A device store: per stored array one ``index_select`` into a new ``[L, width]``
        tensor, zeros on padding, on the caller's stream; ``device`` must be the store's."""
        if torch.device(device) != self.device:
            raise RuntimeError(f"feature cache: a device store on {self.device} read for "
                               f"{device} (features.cache device serves its own device only)")
        idx = self._on_store(self.row_index(row.sample_ids))
        staged = {k: gather_rows(src, idx, torch.empty((L, src.shape[1]), dtype=src.dtype,
                                                       device=self.device))
                  for k, src in self.a.t.items() if k != "filled"}
        return self._value(staged, row)

    def _value(self, staged: dict, row):
        """The stored arrays of a row as what the target hands the drafter."""
        out = {}
        for name, p in self.planes.items():
            if p.store == FP8:
                out[name] = dequantize(staged[name], staged[name + ".scale"], p.groups, p.dtype)
            else:
                out[name] = staged[name].to(p.dtype)
        self.stats["rows_read"] += 1
        return from_planes(out, row, self.tensor_values)

    def row_index(self, sids: Sequence[int]) -> torch.Tensor:
        """int64 store positions of the row's real tokens, in row order."""
        return span_index([(self.offsets[i], self.lengths[i])
                           for i in (self.index[int(s)] for s in sids)])

    def _ring(self, kind: str, pin: bool) -> StagingRing:
        """The read or write ring, made at first use (pinned when its copies involve CUDA)."""
        with self._wlock:
            if kind not in self._rings:
                self._rings[kind] = StagingRing(STAGING_SLOTS[kind], pin)
            return self._rings[kind]

    # ---- end -------------------------------------------------------------------------------
    def close(self, remove: bool) -> None:
        """Finish the writes; ``remove``: delete the disk cache (a completed run)."""
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
        self.a.mmaps.clear()
        self.a.t.clear()
        if remove and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _shared(self):
        return self.gate.shared() if self.gate is not None else nullcontext()


def epoch0_samples(step_map, start_step: int, total_steps: int) -> list[int]:
    """Dataset indices of the epoch-0 batches this run still computes (steps >= start_step)."""
    batches, out = step_map.batches(0), []
    for step in range(start_step, min(total_steps, step_map.steps_in(0))):
        for r in range(step_map.M):
            b = step_map.batch_index(step, r)
            if b < len(batches):
                out.extend(batches[b])
    return out


# ---------------------------------------------------------------------------------------------
# one run's cache (the train stage)
# ---------------------------------------------------------------------------------------------
def open_for_run(spec, ds, train_dir: Path, cfg, step_map, start_step: int, total_steps: int,
                 ident: dict) -> FeatureCache | None:
    """The run's cache, with what its epoch 0 still writes marked pending; a disk cache of the
    same run (``ident``) is reopened as a killed run left it."""
    mode = cache_mode(spec)
    if mode == "off":
        return None
    planes = planes_for(spec, len(cfg.target_layer_ids), cfg.hidden_size)
    folder = cache_dir(train_dir) if mode == "disk" else None
    cache = FeatureCache(planes, ds.sample_ids, ds.lengths, folder=folder, ident=ident,
                         gate=get_gate(), device=cache_device(spec) if mode == "device" else None)
    cache.expect(epoch0_samples(step_map, start_step, total_steps))
    have = int(cache.a.t["filled"].sum())
    if have:
        print(f"[train] feature cache: {have:,} of {len(ds.lengths):,} samples already stored "
              f"in {folder}", flush=True)
    return cache
