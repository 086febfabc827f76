"""optim.min_lr_ratio: the cosine schedule's floor (issue #35's "the learning-rate schedule's
tail"). 0, the default, is the schedule and the train fingerprint as they were before."""
import math
from pathlib import Path

import pytest
import torch
import yaml

from dflash.errors import SpecError
from dflash.spec.load import parse_spec
from dflash.train.replica import lr_lambda, make_optimizer

REPO = Path(__file__).resolve().parents[1]


def _before(total: int, warmup_ratio: float):
    """The schedule as it was before the floor existed (cosine to 0)."""
    warm = max(1, int(round(total * warmup_ratio)))
    return lambda s: (s + 1) / warm if s < warm else 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm))))


def test_the_floor_lifts_the_cosine_and_zero_is_the_old_schedule():
    old, zero, floor = _before(100, 0.1), lr_lambda(100, 0.1), lr_lambda(100, 0.1, 0.1)
    assert all(zero(s) == old(s) for s in range(120))
    assert floor(0) == old(0) == 0.1 and floor(9) == 1.0        # the warm-up is untouched
    assert floor(100) == pytest.approx(0.1) and old(100) == pytest.approx(0.0)
    mid = 10 + 45                                                 # half-way down the cosine
    assert floor(mid) == pytest.approx(0.1 + 0.9 * old(mid))
    assert all(floor(s) >= 0.1 - 1e-12 for s in range(200))


def test_the_optimizer_ends_at_the_floor():
    p = torch.nn.Parameter(torch.zeros(3))
    spec = _spec(min_lr_ratio=0.25)
    opt, sched = make_optimizer([p], spec.optim, "cpu", total_steps=20)
    for _ in range(20):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(spec.optim.lr * 0.25)


def _spec(**optim):
    raw = yaml.safe_load((REPO / "specs" / "smollm2-quality.yaml").read_text())
    raw["optim"].update(optim)
    raw.pop("base", None)
    return parse_spec(raw, "q.yaml")


def test_fingerprints_and_a_bad_floor():
    base = _spec()
    assert base.optim.min_lr_ratio == 0.0
    assert _spec(min_lr_ratio=0.0).fingerprint("train") == base.fingerprint("train")
    lifted = _spec(min_lr_ratio=0.1)
    assert lifted.fingerprint("train") != base.fingerprint("train")
    assert all(lifted.fingerprint(s) == base.fingerprint(s) for s in ("data", "warmup"))
    with pytest.raises(SpecError, match="q.yaml: field 'optim.min_lr_ratio'"):
        _spec(min_lr_ratio=1.5)
