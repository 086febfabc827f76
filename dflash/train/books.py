"""The training run's books: which sample ids each epoch trained on (:class:`EpochLedger`),
metrics.jsonl (:class:`MetricsLog`), and :class:`StepBooks`, the one component that owns every
per-step side effect of a training run: the counters, the ledger, the τ cadence, metrics.jsonl,
status.json and the checkpoint cadence.

Owns: the per-step bookkeeping. Imports the top-level modules, ``train.checkpoint`` and
``runtime.status``; the τ monitor is handed in (it lives in ``eval/``, above this room).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from ..artifacts.manifest import atomic_write_text
from ..runtime.status import StatusReporter
from . import checkpoint as ckpt


class EpochLedger:
    """Which sample ids every epoch of the run trained on, across resumes.

    Its state travels in every checkpoint, so a resumed run proves exactly-once over the whole
    run, like an uninterrupted one. An epoch still running keeps its ids; once a later epoch
    starts, a finished one keeps only its verdict (a checkpoint stays small).
    """

    def __init__(self, all_ids, state: dict | None = None):
        self.all_ids = sorted(all_ids)
        self.epochs: dict[int, dict] = {int(e): dict(v) for e, v in (state or {}).items()}

    def add(self, epoch: int, ids: list[int]) -> None:
        for e, v in self.epochs.items():
            if e < epoch and "ids" in v:
                self.epochs[e] = self._verdict(v["ids"])
        self.epochs.setdefault(epoch, {"ids": []})["ids"].extend(ids)

    def _verdict(self, ids: list[int]) -> dict:
        # an epoch cut short by max_steps is not exactly-once, but it is not a bug either:
        # "duplicates" 0 with "complete" false says so at a glance
        distinct = len(set(ids))
        return {"samples": len(ids), "distinct": distinct, "duplicates": len(ids) - distinct,
                "complete": distinct == len(self.all_ids),
                "exactly_once": sorted(ids) == self.all_ids}

    def state(self) -> dict:
        return {str(e): {k: (list(x) if isinstance(x, list) else x) for k, x in v.items()}
                for e, v in sorted(self.epochs.items())}

    def report(self) -> dict:
        """Per epoch: samples trained on, distinct ids, and whether each id came exactly once
        (an epoch cut short by ``max_steps`` is not exactly-once)."""
        return {str(e): self._verdict(v["ids"]) if "ids" in v else dict(v)
                for e, v in sorted(self.epochs.items())}


class MetricsLog:
    """metrics.jsonl, one line per step; on resume, lines from steps not yet reached are cut."""

    def __init__(self, path: Path, start_step: int):
        self.path = path
        lines = []
        if path.exists() and start_step > 0:
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < start_step:
                        lines.append(line)
                except (ValueError, KeyError):
                    break  # a torn last line from a kill: drop it and the rest
        # atomic: a kill during this rewrite must not lose the lines of steps already done
        atomic_write_text(path, "".join(x + "\n" for x in lines))
        self.f = open(path, "a", buffering=1)

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self.f.close()


class StepBooks:
    """Every per-step side effect of a training run, in :meth:`record` (the pipeline's
    ``on_step``): counters, ledger, simulated τ every ``tau_every`` steps (``monitor``),
    metrics.jsonl, status.json and a checkpoint every ``checkpoint.every_steps``.

    Every rank keeps the same counters and ledger (every rank sees the whole step); only the
    ``writer`` (rank 0) writes metrics, status and checkpoints. ``persist`` False (the bench
    stage's timed run): no checkpoints.
    """

    def __init__(self, out: Path, *, start_step: int, counters: dict, ledger: EpochLedger,
                 status: StatusReporter, checkpoint, nodes: int, total_steps: int, replica,
                 run_fingerprint: dict, writer: bool, persist: bool,
                 monitor: Callable | None = None, tau_every: int | None = None,
                 tracker=None):
        self.out, self.counters, self.ledger, self.status = out, counters, ledger, status
        self.checkpoint, self.nodes, self.total = checkpoint, nodes, total_steps
        self.replica, self.run_fingerprint = replica, run_fingerprint
        self.writer, self.persist = writer, persist
        self.monitor, self.tau_every = monitor, tau_every
        self.tracker = tracker  # dflash.train.tracker.Tracker (monitor.tensorboard) or None
        self.metrics = MetricsLog(out / "metrics.jsonl", start_step) if writer else None
        # checkpoints are written beside the next steps (the step pays for its snapshot)
        self.checkpoints = ckpt.Writer() if writer and persist else None
        self.t0 = time.perf_counter()
        self.feature_cache = None  # flushed before every checkpoint (features.cache: disk)

    def start(self) -> None:
        """The run's clock starts (metrics' ``t``): call just before the pipeline starts."""
        self.t0 = time.perf_counter()

    def _due(self, every: int, step: int) -> bool:
        return (step + 1) % every == 0 or step + 1 == self.total

    def state_due(self, step: int) -> bool:
        """Whether :meth:`record` of ``step`` reads the replica's weights (the τ monitor, a
        checkpoint): the pipeline then reads that step's figures at once, not one step late."""
        return ((self.monitor is not None and self._due(self.tau_every, step))
                or (self.writer and self.persist and self._due(self.checkpoint.every_steps, step)))

    def record(self, rec) -> None:
        """One finished step (a :class:`dflash.train.scheduler.StepRecord`)."""
        self.counters["tokens"] += rec.tokens
        self.counters["samples"] += len(rec.sample_ids)
        self.ledger.add(rec.epoch, rec.sample_ids)
        extra = {}
        if self.monitor is not None and self._due(self.tau_every, rec.step):
            # on the first replica's thread, after its step: the others wait at the barrier
            m = self.monitor(self.replica)
            extra = {"tau_heldout": m["tau"], "tau_seconds": m["seconds"]}
        if not self.writer:
            return
        row = {"step": rec.step, "epoch": rec.epoch, "loss": rec.loss,
               "lr": rec.lr, "grad_norm": rec.grad_norm, "tokens": rec.tokens,
               "labelled": rec.labelled, "samples": len(rec.sample_ids),
               "draft_acc": rec.draft_acc, "sample_ids": rec.sample_ids,
               "t": round(rec.t_end - self.t0, 4), **extra}
        self.metrics.write(row)
        self.status.step(rec)
        if self.tracker is not None:
            self.tracker.log(row, self.status.tokens_per_s())
        if self.persist and self._due(self.checkpoint.every_steps, rec.step):
            if self.feature_cache is not None:
                self.feature_cache.flush()  # what this checkpoint's steps computed is stored
            # every rank has reached this step (the step's record was gathered from all)
            self.checkpoints.save(self.out / "checkpoints", rec.step + 1, self.replica,
                                  dict(self.counters), self.checkpoint.keep,
                                  self.run_fingerprint, self.ledger.state(), nodes=self.nodes)

    def finish(self) -> None:
        """A run that finished: its last checkpoint on disk (a failed write raises here)."""
        if self.checkpoints is not None:
            self.checkpoints.finish()

    def close(self) -> None:
        """Always, a failed run too: the write in flight completes (a resume finds it)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tracker is not None:
            self.tracker.close()
