"""The checkers the other tests and the train manifest trust, each shown a failing input: the
exactly-once ledger, the resume tests' id and tensor comparisons, the replica check."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash.models.drafter import DFlashConfig
from dflash.runtime import faults as fi
from dflash.spec.load import load_spec
from dflash.train.books import EpochLedger
from dflash.train.trainer import check_replicas
from dflash.train.workers import initial_state, make_replicas

REPO = Path(__file__).resolve().parents[1]


def test_ledger_exactly_once_and_its_failures():
    ids = [3, 1, 2, 0]
    ok = EpochLedger(ids)
    ok.add(0, [2, 0])
    ok.add(0, [3, 1])
    assert ok.report()["0"] == {"samples": 4, "distinct": 4, "duplicates": 0, "complete": True,
                                "exactly_once": True}
    dup = EpochLedger(ids)
    dup.add(0, [0, 1, 2, 3, 2])                      # one id twice
    assert dup.report()["0"] == {"samples": 5, "distinct": 4, "duplicates": 1,
                                 "complete": True, "exactly_once": False}
    swap = EpochLedger(ids)
    swap.add(0, [0, 1, 2, 2])                        # one id twice, another lost
    assert swap.report()["0"]["exactly_once"] is False
    assert swap.report()["0"]["complete"] is False and swap.report()["0"]["duplicates"] == 1
    short = EpochLedger(ids)
    short.add(0, [0, 1])                             # cut short by max_steps: not a duplicate
    assert short.report()["0"] == {"samples": 2, "distinct": 2, "duplicates": 0,
                                   "complete": False, "exactly_once": False}


def test_ledger_verdict_survives_a_resume():
    """A finished epoch keeps only its verdict in the checkpointed state: a duplicate before the
    checkpoint is still reported after the resume."""
    ids = [0, 1, 2]
    a = EpochLedger(ids)
    a.add(0, [0, 1, 1])
    a.add(1, [2])                                   # epoch 0 closes: ids -> verdict
    b = EpochLedger(ids, a.state())
    b.add(1, [0, 1])
    rep = b.report()
    assert rep["0"]["exactly_once"] is False and rep["0"]["duplicates"] == 1
    assert rep["1"]["exactly_once"] is True


def test_epochs_exactly_once_and_compare_ids_catch_loss_and_duplication():
    ids = [0, 1, 2, 3]
    assert fi.epochs_exactly_once({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, ids)
    assert not fi.epochs_exactly_once({0: [0, 1, 2, 3], 1: [0, 1, 2, 2]}, ids)
    assert not fi.epochs_exactly_once({0: [0, 1, 2, 3, 3]}, ids)
    ref = {0: {"epoch": 0, "sample_ids": [0, 1]}, 1: {"epoch": 0, "sample_ids": [2, 3]}}
    same = fi.compare_ids(ref, {0: [0, 1], 1: [2, 3]})
    assert same["samples_lost"] == same["samples_duplicated"] == 0 and same["steps_identical"]
    bad = fi.compare_ids(ref, {0: [0, 1], 1: [2, 1]})   # step 1 replayed a sample, lost one
    assert bad["samples_lost"] == 1 and bad["samples_duplicated"] == 1
    assert not bad["steps_identical"] and not fi.epochs_exactly_once(bad["epochs"], ids)


def test_tensors_equal_names_every_difference():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    assert fi.tensors_equal(a, {k: v.clone() for k, v in a.items()}) == (True, [])
    one_ulp = a["w"].clone()
    one_ulp[1, 2] = torch.nextafter(one_ulp[1, 2], torch.tensor(100.0))
    assert fi.tensors_equal(a, {"w": one_ulp, "b": a["b"]}) == (False, ["w"])
    assert fi.tensors_equal(a, {"w": a["w"], "b": a["b"].double()}) == (False, ["b"])
    assert fi.tensors_equal(a, {"w": a["w"], "b": a["b"][:2]}) == (False, ["b"])
    assert fi.tensors_equal(a, {"w": a["w"]}) == (False, ["b"])
    assert fi.tensors_equal(a, {**a, "extra": a["b"]}) == (False, ["extra"])


@pytest.fixture(scope="module")
def replicas():
    spec = load_spec(REPO / "tests" / "specs" / "micro.yaml")
    spec = spec.replace(compile={"backend": "eager"})
    cfg = DFlashConfig.of_spec(spec)
    return make_replicas(spec, cfg, initial_state(cfg, 0), 10)


def test_check_replicas_catches_one_diverged_weight(replicas):
    job = SimpleNamespace(replicas=replicas)
    assert len(replicas) == 2 and check_replicas(job) is True
    name, p = next(iter(replicas[1].model.named_parameters()))
    with torch.no_grad():
        keep = p.view(-1)[0].clone()
        p.view(-1)[0] = torch.nextafter(keep, keep + 1)      # one ULP on one element
    try:
        assert check_replicas(job) is False, name
    finally:
        with torch.no_grad():
            p.view(-1)[0] = keep
    assert check_replicas(job) is True
