"""A step's figures one step late (dflash.train.readout) and a row's small tensors in one copy
(dflash.train.host_pack): the logic on CPU; the pipeline's use is in test_scheduler.py."""
from __future__ import annotations

import pytest
import torch

from dflash.train.host_pack import ALIGN, PackedLayout
from dflash.train.readout import Finished, LaggedRecords, StepReadout
from dflash.train.replica import StepResult


def _result(loss: float, hits: list[float] | None) -> StepResult:
    return StepResult(loss=torch.tensor(loss), labelled=3, tokens=10, sample_ids=[1],
                      hits=None if hits is None else torch.tensor(hits), counts=[1, 1])


def test_readout_gives_each_replica_s_loss_and_hits_and_the_norm():
    results = [_result(1.5, [3.0, 2.0]), None, _result(0.25, None), _result(2.0, [1.0, 0.0])]
    losses, hits, norm = StepReadout(results, torch.tensor(0.75)).values()
    assert losses == [1.5, None, 0.25, 2.0]
    assert hits == [[3.0, 2.0], None, None, [1.0, 0.0]]
    assert norm == 0.75


def test_lagged_records_book_one_step_late_in_order_and_at_once_where_asked():
    booked = []
    lag = LaggedRecords(lambda d: booked.append(d.step), sync_at=lambda s: s in (0, 3),
                        lagged=True)
    log = []
    for step in range(6):
        lag.finished(Finished(step, 0, 1e-3, [], StepReadout([], torch.tensor(0.0))))
        log.append(list(booked))
    lag.flush()
    # step 0 at once; 1 and 2 one step late; 3 at once after 2; 4 at 5's finish; 5 at the flush
    assert log == [[0], [0], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert booked == list(range(6))


def test_sync_mode_books_every_step_at_once(monkeypatch):
    monkeypatch.setenv("DFLASH_STEP_READOUT", "sync")
    booked = []
    lag = LaggedRecords(lambda d: booked.append(d.step), sync_at=lambda s: False)
    for step in range(3):
        lag.finished(Finished(step, 0, 1e-3, [], StepReadout([], torch.tensor(0.0))))
        assert booked == list(range(step + 1))
    monkeypatch.setenv("DFLASH_STEP_READOUT", "later")
    with pytest.raises(ValueError, match="DFLASH_STEP_READOUT: 'later'"):
        LaggedRecords(print, sync_at=lambda s: False)


def test_a_stopping_run_books_the_held_step_and_an_error_reading_it_is_not_raised():
    booked = []
    lag = LaggedRecords(lambda d: booked.append(d.step), sync_at=lambda s: False, lagged=True)
    lag.finished(Finished(7, 0, 1e-3, [], StepReadout([], torch.tensor(0.0))))
    lag.flush_stopping()
    assert booked == [7]

    def broken(d):
        raise RuntimeError("device lost")

    lag = LaggedRecords(broken, sync_at=lambda s: False, lagged=True)
    lag.finished(Finished(8, 0, 1e-3, [], StepReadout([], torch.tensor(0.0))))
    lag.flush_stopping()  # the error that stopped the run is the one reported


def test_packed_layout_round_trips_every_dtype_at_aligned_offsets():
    tensors = {"doc_ids": torch.tensor([0, 0, 1, -1]), "valid": torch.tensor([True, False, True]),
               "labels": torch.arange(6).reshape(2, 3), "empty": torch.zeros(0, dtype=torch.long),
               "ids": torch.tensor([7], dtype=torch.int32)}
    layout = PackedLayout(tensors)
    host = layout.pack(tensors, pin=False)
    assert host.dtype == torch.uint8 and host.numel() == layout.nbytes
    assert all(off % ALIGN == 0 for *_, off, _ in layout.items)
    views = layout.views(host)
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and torch.equal(views[name], t), name
        assert views[name].untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    # another row of the same shapes into the same buffer: the views read its values
    other = {**tensors, "doc_ids": torch.tensor([2, 2, 2, 2])}
    host.copy_(layout.pack(other, pin=False))
    assert views["doc_ids"].tolist() == [2, 2, 2, 2]
    moved = layout.to_device(other, "cpu")
    assert all(torch.equal(moved[n], other[n]) for n in other)


def test_packed_layout_refuses_a_row_of_other_shapes():
    layout = PackedLayout({"doc_ids": torch.zeros(4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"doc_ids: \(5,\) torch.int64, the layout has \(4,\)"):
        layout.pack({"doc_ids": torch.zeros(5, dtype=torch.long)}, pin=False)
