"""The race-free threaded topology: N target workers + M drafter replicas in one process.

    feeder ──work_q──▶ target worker (one per target device) ──out_q[r]──▶ drafter replica r

* The feeder enqueues work items in step order: item (step, r) is batch ``step·M + r`` of the
  epoch's deterministic plan, so every sample reaches exactly one replica exactly once per epoch
  and a resumed run sees the very same batches. With R nodes (``topology.nodes``, one Pipeline
  per node, :mod:`dflash.runtime.distributed`) rank k's replica r takes batch ``step·R·M + k·M + r``:
  every rank plans the same epoch, and together they take each batch once.
* Queues are bounded (backpressure): at most ``queue_depth`` items per replica are in flight.
* Every worker iteration runs through the one process-wide compile gate (:mod:`dflash.runtime.gate`):
  ``gate.run(sig, fn)`` takes the exclusive side for anything that may compile or trace and the
  shared side for warm work; the optimizer step runs under the shared side too, so no thread's
  eager code ever sees another thread's ``is_compiling()``.
* A thread never blocks on a queue or the barrier while it holds the gate (no deadlock).
* Replicas stay identical: after each backward, the leader averages the flat gradients of all
  replicas that had a batch (fixed order → deterministic) and writes the mean back to each; each
  replica then clips and steps its own optimizer on identical gradients. Across nodes the
  leader all-reduces [sum of its active replicas' grads, their count] and divides by the global
  count (started under the gate's shared side, waited for outside the gate: a collective waits
  on other processes, and rule 1 says never to block while holding the gate).
* Any failure sets ``stop``, aborts the barrier and wakes every wait; the main thread re-raises
  the first error naming the worker and its device. No hang.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import DFlashError
from ..models.masks import PackedRow
from ..runtime.gate import get_gate
from ..runtime.tracing import worker_thread_setup
from ..runtime.status import worker_name
from .streams import TargetStream, consume
from ..runtime.busy import DeviceBusy
from .feature_cache import CacheStopped
from .packing import StepMap
from .profile import worker_label
from .readout import Finished, LaggedRecords, StepReadout
from .stall import StallWatch, failure_message

POLL_S = 0.1


def anchor_seed(seed: int, epoch: int, batch_index: int) -> int:
    """Anchors are a pure function of (seed, epoch, batch): a resumed run samples the same."""
    return (seed * 1_000_003 + epoch * 10_007 + batch_index) % (2**31 - 1)


class WorkerFailed(DFlashError):
    exit_code = 4


@dataclass
class WorkItem:
    step: int
    replica: int
    epoch: int
    batch_index: int
    row: PackedRow | None  # None: this replica has no batch in this step (end of epoch)


@dataclass
class StepRecord:
    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    labelled: int
    sample_ids: list[int]
    t_end: float
    replica_losses: list[float | None] = field(default_factory=list)
    # top-1 accuracy of block position k = 1..B-1 over this step's labelled positions
    draft_acc: list[float | None] = field(default_factory=list)


class Stopped(Exception):
    """Internal: the run is stopping because another worker failed."""


class Pipeline:
    def __init__(self, *, target_workers: list[tuple[str, Callable]], replicas: list,
                 step_map: StepMap, make_row: Callable[[list], PackedRow], start_step: int,
                 total_steps: int, seed: int, queue_depth: int,
                 on_step: Callable[[StepRecord], None] | None = None,
                 fail_at: dict[str, int] | None = None, comm=None, feature_cache=None,
                 profiler=None, stall_s: float | None = None, sync_at: Callable | None = None):
        """``target_workers``: (device, fn(row) -> TargetOutput) per target device.
        ``feature_cache``: a :class:`dflash.train.feature_cache.FeatureCache` (epoch 0 writes
        it, later epochs read the rows it serves instead of running the target) or None.
        ``step_map`` maps steps to the deterministic per-epoch batch plans; ``make_row(batch)``
        packs one batch of sample indices into a PackedRow. ``profiler``: a
        :class:`dflash.train.profile.StepProfiler` replica 0 opens and closes between steps
        (``monitor.profile_steps``) or None. ``stall_s`` (``monitor.stall_s``): fail the run,
        with every thread's stack, when no step completes for that long (None: never).
        ``sync_at(step)``: ``on_step`` reads the weights after that step (a checkpoint, τ)."""
        self.targets = target_workers
        self.replicas = replicas
        self.M = len(replicas)
        self.step_map = step_map
        self.make_row = make_row
        self.start_step, self.total_steps = start_step, total_steps
        self.seed = seed
        self.on_step = on_step
        self.fail_at = fail_at or {}  # test hook: {"worker name": step} raises there
        self.comm = comm  # dflash.runtime.distributed.Dist across nodes; None: this process only
        self.cache = feature_cache
        self.profiler = profiler
        self.stall = StallWatch(stall_s)
        # the books one step late (.readout); across nodes at once: no rank reorders collectives
        self.records = LaggedRecords(self._record, lambda s: s in (start_step, total_steps - 1)
                                     or bool(sync_at and sync_at(s)), lagged=None if comm is None else False)
        self.allreduce = None  # DeviceBusy of the cross-node all-reduce (leader thread)
        self.gate = get_gate()
        self.stop = threading.Event()
        self.error: tuple[str, str, BaseException, str] | None = None
        self._err_lock = threading.Lock()
        self.work_q: queue.Queue = queue.Queue(maxsize=queue_depth * self.M)
        self.out_qs = [queue.Queue(maxsize=queue_depth + len(target_workers))
                       for _ in range(self.M)]
        self.barrier = threading.Barrier(self.M)
        self._results: list[Any] = [None] * self.M
        self.first_step_s: dict[str, float] = {}
        self.busy_s: dict[str, float] = {}
        self.wait_s: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.steps_done = start_step
        self.last_record: StepRecord | None = None

    # ---- helpers -----------------------------------------------------------------------------
    def fail(self, name: str, device: str, exc: BaseException) -> None:
        """Stop the pipeline with this error (the first one wins): every worker ends promptly
        and :meth:`run` raises it, naming the worker and device (the watchdog uses it too)."""
        with self._err_lock:
            if self.error is None:
                self.error = (name, device, exc, traceback.format_exc())
        self.stop.set()
        self.barrier.abort()

    def _put(self, q: queue.Queue, item) -> None:
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                q.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def _get(self, q: queue.Queue):
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _barrier(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped from None

    def _check_fail_hook(self, name: str, step: int) -> None:
        # ">=": a target worker may never see the exact step (another target took it)
        if name in self.fail_at and step >= self.fail_at[name]:
            raise RuntimeError(f"injected failure in {name} at step {step}")

    # ---- threads -----------------------------------------------------------------------------
    def _feeder(self) -> None:
        try:
            for step in range(self.start_step, self.total_steps):
                epoch, local = self.step_map.locate(step)
                batches = self.step_map.batches(epoch)
                for r in range(self.M):
                    b = self.step_map.batch_index(local, r)
                    row = self.make_row(batches[b]) if b < len(batches) else None
                    self._put(self.work_q, WorkItem(step, r, epoch, b, row))
            for _ in self.targets:
                self._put(self.work_q, None)
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.fail("feeder", "cpu", e)

    def _target_worker(self, i: int, device: str, feature_fn: Callable) -> None:
        name = worker_name("target", i)
        try:
            worker_thread_setup()
            stream = TargetStream(device, [rep.device for rep in self.replicas])
            stream.enter()
            # device time from event pairs, as the drafters': no host sync per row, so this
            # thread queues the next row while the device (shared with a drafter) still runs
            busy, wait = DeviceBusy(device), 0.0
            while True:
                t = time.perf_counter()
                item = self._get(self.work_q)
                wait += time.perf_counter() - t
                if item is None:
                    break
                self._check_fail_hook(name, item.step)
                feats = None
                if item.row is not None:
                    b0 = busy.start()
                    with worker_label(name):
                        feats = self._features(device, feature_fn, item)
                    busy.stop(b0)
                    self.first_step_s.setdefault(name, time.perf_counter() - self.t0)
                self.busy_s[name], self.wait_s[name] = busy.seconds, wait
                t = time.perf_counter()
                self._put(self.out_qs[item.replica], (item, feats, stream.ready()))
                wait += time.perf_counter() - t
            self.busy_s[name] = busy.collect(block=True)
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001
            self.fail(name, device, e)

    def _features(self, device: str, feature_fn: Callable, item: WorkItem):
        """The row's target features: from the cache when it serves the row (epochs >= 1; the
        wait for a sample still being written holds no gate), else from the target (epoch 0
        then stores them)."""
        row, cache = item.row, self.cache
        if cache is not None and item.epoch >= 1 and cache.serves(row.sample_ids):
            try:
                cache.wait_for(row.sample_ids, self.stop)
            except CacheStopped:
                raise Stopped from None
            with self.gate.shared():
                return cache.read(row, device)
        feats = self.gate.run(("target_forward", device, row.input_ids.shape[0]),
                              lambda: feature_fn(row))
        if cache is not None and item.epoch == 0:
            with self.gate.shared():
                cache.write(row, feats)
        return feats

    def _next_item(self, r: int, step: int, pending: dict):
        while step not in pending:
            got = self._get(self.out_qs[r])  # (item, feats, the target's ready event)
            pending[got[0].step] = got
        return pending.pop(step)

    def _drafter_worker(self, r: int) -> None:
        rep = self.replicas[r]
        name = worker_name("drafter", r)
        try:
            worker_thread_setup()
            pending: dict[int, tuple] = {}
            busy = DeviceBusy(rep.device)  # device time of this replica's fwd/bwd + optim
            wait = 0.0
            for step in range(self.start_step, self.total_steps):
                if r == 0 and self.profiler is not None:
                    self.profiler.at_step(step, self)  # between steps: whole steps profiled
                t = time.perf_counter()
                item, feats, ready = self._next_item(r, step, pending)
                wait += time.perf_counter() - t
                self._check_fail_hook(name, step)
                b0 = busy.start()
                with worker_label(name):
                    if item.row is not None:
                        row = item.row
                        consume(feats, ready, rep.device)  # the target's own stream, if any
                        # outside the gate, as host work: the replica's objective owns the blocks
                        blocks = rep.anchors(row, anchor_seed(self.seed, item.epoch,
                                                              item.batch_index))
                        res = self.gate.run(rep.signature(row.input_ids.shape[0]),
                                            lambda: rep.forward_backward(row, feats, blocks))
                        del feats
                    else:
                        with self.gate.shared():
                            rep.zero_grad()
                        res = None
                busy.stop(b0)
                self._results[r] = res
                t = time.perf_counter()
                self._barrier()  # every replica's backward is queued
                wait += time.perf_counter() - t
                if r == 0:
                    # snapshot before the next barrier: after it, other replicas move on to the
                    # next step and overwrite their result slots
                    snapshot = list(self._results)
                    if self.comm is None:
                        with self.gate.shared():
                            self._average_grads(snapshot)
                    else:
                        self._average_grads_across(snapshot)
                t = time.perf_counter()
                self._barrier()  # mean gradients are in place on every replica
                wait += time.perf_counter() - t
                b0 = busy.start()
                with worker_label(name), self.gate.shared():
                    norm = rep.clip_and_step()
                    readout = StepReadout(snapshot, norm) if r == 0 else None
                busy.stop(b0)
                self.busy_s[name], self.wait_s[name] = busy.seconds, wait
                if r == 0:
                    self.records.finished(Finished(step, item.epoch, rep.lr(), snapshot, readout))
                # first step = its work done (its record is read at once: it synced replica 0)
                self.first_step_s.setdefault(name, time.perf_counter() - self.t0)
            if r == 0:
                self.records.flush()
                if self.profiler is not None:
                    self.profiler.at_step(self.total_steps, self)
            self.busy_s[name] = busy.collect(block=True)
        except BaseException as e:  # noqa: BLE001
            if not isinstance(e, Stopped):
                self.fail(name, rep.device, e)
            if r == 0:
                self.records.flush_stopping()

    def _local_sum(self, results: list) -> tuple[torch.Tensor | None, int]:
        """The sum of this node's active replicas' flat gradients on the lead device (fixed
        order: the same bits on every run) and how many replicas had a batch."""
        lead = self.replicas[0].device
        total = None
        active = [i for i, res in enumerate(results) if res is not None]
        for i in active:
            g = self.replicas[i].flat_grad().to(lead)
            total = g if total is None else total + g
        return total, len(active)

    def _set_mean(self, mean: torch.Tensor) -> None:
        for rep in self.replicas:
            rep.set_flat_grad(mean)

    def _average_grads(self, results: list) -> None:
        if len(self.replicas) == 1:
            return  # one replica: its gradient is the mean (and a captured step holds it)
        total, n = self._local_sum(results)
        if n:
            self._set_mean(total / n)

    def _average_grads_across(self, results: list) -> None:
        """The mean over every active replica of every node: local sum, one all-reduce of
        [sum, count], divide. Launched and finished under the shared side, waited for outside
        the gate (a cross-process wait must not stall this process's writers)."""
        lead = self.replicas[0].device
        if self.allreduce is None:
            self.allreduce = DeviceBusy(lead)
        with self.gate.shared():
            total, n = self._local_sum(results)
            if total is None:  # no batch here this step: still join the collective
                total = torch.zeros_like(self.replicas[0].flat_grad()).to(lead)
            buf = torch.cat([total, total.new_tensor([float(n)])])
            t0 = self.allreduce.start()
            work = self.comm.all_reduce_start(buf)
        work.wait()
        with self.gate.shared():
            self.allreduce.stop(t0)
            self._set_mean(buf[:-1] / buf[-1].clamp(min=1.0))

    def _record(self, done: Finished) -> None:
        """The step's books (``on_step``) from its figures (:mod:`.readout`: one step late)."""
        step, epoch, lr, results = done.step, done.epoch, done.lr, done.results
        res = [r for r in results if r is not None]
        losses, per_hits, grad_norm = done.readout.values()
        hits = counts = None
        for r, h in zip(results, per_hits):
            if h is None:
                continue
            hits = h if hits is None else [a + b for a, b in zip(hits, h)]
            counts = r.counts if counts is None else [a + b for a, b in zip(counts, r.counts)]
        tokens, labelled = sum(r.tokens for r in res), sum(r.labelled for r in res)
        sample_ids = [s for r in res for s in r.sample_ids]
        if self.comm is not None:
            # the whole step, every node's replicas in rank order; gathering is also where the
            # ranks agree on the step before rank 0 writes anything (metrics, a checkpoint)
            parts = self.comm.all_gather({"step": step, "losses": losses, "hits": hits,
                                          "counts": counts, "tokens": tokens,
                                          "labelled": labelled, "ids": sample_ids})
            steps = [p["step"] for p in parts]
            if len(set(steps)) != 1:
                raise RuntimeError(f"ranks disagree on the step: {steps}")
            losses = [x for p in parts for x in p["losses"]]
            tokens = sum(p["tokens"] for p in parts)
            labelled = sum(p["labelled"] for p in parts)
            sample_ids = [i for p in parts for i in p["ids"]]
            with_hits = [p for p in parts if p["hits"] is not None]
            if with_hits:
                hits = [sum(x) for x in zip(*(p["hits"] for p in with_hits))]
                counts = [sum(x) for x in zip(*(p["counts"] for p in with_hits))]
        draft_acc = ([round(h / c, 4) if c else None for h, c in zip(hits[1:], counts[1:])]
                     if hits is not None else [])
        seen = [x for x in losses if x is not None]
        rec = StepRecord(
            step=step, epoch=epoch,
            loss=sum(seen) / len(seen) if seen else float("nan"),
            lr=lr, grad_norm=grad_norm, tokens=tokens, labelled=labelled,
            sample_ids=sample_ids, t_end=time.perf_counter(),
            replica_losses=losses, draft_acc=draft_acc)
        self.steps_done = step + 1
        self.last_record = rec
        if self.on_step is not None:
            self.on_step(rec)

    # ---- run ---------------------------------------------------------------------------------
    def queue_depths(self) -> dict[str, int]:
        return {"work": self.work_q.qsize(), **{f"out{r}": q.qsize()
                                                 for r, q in enumerate(self.out_qs)}}

    def run(self, on_tick: Callable[["Pipeline"], None] | None = None,
            tick_s: float = 5.0) -> None:
        threads = [threading.Thread(target=self._feeder, name="feeder", daemon=True)]
        threads += [threading.Thread(target=self._target_worker, args=(i, dev, fn),
                                     name=worker_name("target", i), daemon=True)
                    for i, (dev, fn) in enumerate(self.targets)]
        threads += [threading.Thread(target=self._drafter_worker, args=(r,),
                                     name=worker_name("drafter", r), daemon=True)
                    for r in range(self.M)]
        self.t0 = time.perf_counter()
        for t in threads:
            t.start()
        next_tick = time.perf_counter() + tick_s
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=POLL_S)
                    if self.stop.is_set():
                        break
                if self.stop.is_set():
                    break
                stalled = self.stall.check(self.steps_done, self.total_steps, threads,
                                           self.first_step_s)
                if stalled is not None:
                    self.fail("watchdog", "-", stalled)
                    break
                if on_tick is not None and time.perf_counter() >= next_tick:
                    on_tick(self)
                    next_tick = time.perf_counter() + tick_s
        except KeyboardInterrupt as e:
            self.fail("main", "cpu", e)
        # wake everyone, then wait a bounded time for the threads to leave
        if self.stop.is_set():
            deadline = time.perf_counter() + 10
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.perf_counter()))
        if self.error is not None:
            exc = self.error[2]
            raise WorkerFailed(failure_message(*self.error, threads)) from exc
