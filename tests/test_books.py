"""The training run's books (dflash.train.books.StepBooks): one record per step keeps the
counters, the exactly-once ledger, metrics.jsonl and status, with τ on its cadence; a resumed
run's books cut the metrics of steps not yet reached again."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from dflash.runtime.status import StatusReporter
from dflash.train.books import EpochLedger, StepBooks
from dflash.train.scheduler import StepRecord


def _books(tmp_path, start_step=0, counters=None, state=None, monitor=None, writer=True):
    spec = SimpleNamespace(name="t")  # what StatusReporter reads of the spec
    status = StatusReporter(tmp_path / "status.json" if writer else None, spec, 4)
    return StepBooks(tmp_path, start_step=start_step,
                     counters=counters or {"tokens": 0, "samples": 0},
                     ledger=EpochLedger(range(4), state), status=status,
                     checkpoint=SimpleNamespace(every_steps=2, keep=1), nodes=1,
                     total_steps=4, replica=None, run_fingerprint={}, writer=writer,
                     persist=False, monitor=monitor, tau_every=3 if monitor else None)


def _rec(step, ids):
    return StepRecord(step=step, epoch=step // 2, loss=1.0 / (step + 1), lr=1e-3, grad_norm=0.5,
                      tokens=10 * len(ids), labelled=5, sample_ids=ids, t_end=time.perf_counter())


def test_records_counters_ledger_metrics_status_and_tau_cadence(tmp_path):
    seen = []
    books = _books(tmp_path, monitor=lambda rep: seen.append(rep) or {"tau": 2.5, "seconds": 0.1})
    books.start()
    for step, ids in enumerate([[0, 1], [2, 3], [1, 0], [3, 3]]):
        books.record(_rec(step, ids))
    books.close()
    assert books.counters == {"tokens": 80, "samples": 8}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and lines[1]["sample_ids"] == [2, 3]
    # τ every 3 steps and at the last: steps 2 and 3
    assert len(seen) == 2 and [("tau_heldout" in m) for m in lines] == [False, False, True, True]
    rep = books.ledger.report()
    assert rep["0"]["exactly_once"] and not rep["1"]["exactly_once"] and rep["1"]["duplicates"] == 1
    assert books.status.state["step"] == 4  # status.json is written on its ticks


def test_resume_cuts_metrics_and_other_ranks_write_nothing(tmp_path):
    books = _books(tmp_path)
    for step in range(3):
        books.record(_rec(step, [step]))
    books.close()
    again = _books(tmp_path, start_step=2, state=books.ledger.state())
    again.close()
    assert [json.loads(x)["step"] for x in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    other = tmp_path / "rank1"
    other.mkdir()
    quiet = _books(other, writer=False)
    quiet.record(_rec(0, [0]))
    assert quiet.counters["samples"] == 1 and not list(other.iterdir())
