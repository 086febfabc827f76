"""The feature cache's read of one quality-shaped row with a distilling objective's soft labels
(``loss.kind`` kd), against CE's features-only read, in one run: what the cached kd epochs pay.

Round 24's kd arm read its cached epochs at 203K target tokens/s where CE's ran at 241K on the
same H100 kind (bench/results/h100/round24-2026-12-05/README.md), for soft planes of 4 % of the
row's bytes. The arms, each on the same rows of one host store:

* ``ce``: features only (:meth:`dflash.train.feature_cache.FeatureCache.read`, as CE runs it).
* ``kd_device_positions``: features and soft labels, the soft positions found on the device
  (``nonzero`` there: the read as round 24 ran it, kept here as the reference), which makes the
  host wait for the row's copies before it can gather the next row.
* ``kd``: features and soft labels as the package reads them now: the positions found on the
  host and queued pinned (:func:`dflash.models.target_output.soft_positions_on`).

Each is timed as the target worker runs it (``*_queued_ms``: reads back to back, one sync at the
end; the staging ring bounds how far the host runs ahead) and read by read (``*_synced_ms``).
The two kd arms' values are checked equal.

    PYTHONPATH=$PWD python -m bench.soft_read --out /tmp/soft_read.json   # the GPU box (< 60 s)
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.cache_read import LAYERS, ROW, WIDTH, rows, sample_lengths
from bench.entry import command_line, host_facts, run, write_result
from dflash.models.target_output import SoftLabels, TargetOutput, soft_positions
from dflash.train import feature_cache as fc
from dflash.train.cache_budget import Plane

TOP_K = 32  # the schema's loss.kd_top_k default
RESPONSE = 0.7  # the share of a sample's tokens that are its answer (loss-masked)


def device_positions_value(planes: dict, row, tensor: bool):
    """``feature_planes.from_planes`` as round 24 ran it: the soft positions on the device."""
    feats = planes["features"][None]
    dev = feats.device
    pos = soft_positions(row.doc_ids.to(dev), row.loss_mask.to(dev))
    return TargetOutput(feats, SoftLabels(pos, planes["soft_ids"][pos],
                                          planes["soft_logprobs"][pos]))


def build(store_gb: float, soft: bool) -> fc.FeatureCache:
    """A filled host store of ~``store_gb`` of features (random finite bf16), with soft planes."""
    lengths = sample_lengths(store_gb, 0)
    planes = [Plane("features", WIDTH, torch.bfloat16, torch.bfloat16, groups=LAYERS)]
    if soft:
        planes += [Plane("soft_ids", TOP_K, torch.int32, torch.int32),
                   Plane("soft_logprobs", TOP_K, torch.float32, torch.float32)]
    cache = fc.FeatureCache(planes, list(range(len(lengths))), lengths)
    cache.a.t["features"].view(torch.int16).random_(-16000, 16000)
    if soft:
        cache.a.t["soft_ids"].random_(0, 49152)
        cache.a.t["soft_logprobs"].uniform_(-20, 0)
    cache.a.t["filled"].fill_(1)
    return cache


def with_masks(cache: fc.FeatureCache, rs: list) -> list:
    """The rows with what the soft positions read: document ids (-1 on padding) and the
    loss mask (each sample's last RESPONSE share)."""
    for r in rs:
        doc, mask, at = torch.full((ROW,), -1), torch.zeros(ROW, dtype=torch.bool), 0
        for j, s in enumerate(r.sample_ids):
            n = cache.lengths[s]
            doc[at:at + n] = j
            mask[at + n - int(n * RESPONSE):at + n] = True
            at += n
        r.doc_ids, r.loss_mask = doc, mask
    return rs


def timed(read, rs, device: str, queued: bool) -> float:
    """Mean ms per row: back to back with one sync at the end (queued), or synced per read;
    after one untimed pass over the rows (the store's pages touched, the staging ring made)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for r in rs:
        read(r)
    sync()
    t = time.perf_counter()
    for r in rs:
        read(r)
        if not queued:
            sync()
    sync()
    return (time.perf_counter() - t) / len(rs) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu/soft_read.json")
    ap.add_argument("--store-gb", type=float, default=2.0)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    t0, dev = time.perf_counter(), a.device
    ce, kd = build(a.store_gb, soft=False), build(a.store_gb, soft=True)
    rs = with_masks(kd, rows(kd, a.rows, 1))
    now = fc.from_planes

    def kd_device(r):
        fc.from_planes = device_positions_value
        try:
            return kd.read(r, dev)
        finally:
            fc.from_planes = now

    for r in rs[:3]:  # the two kd reads agree
        x, y = kd.read(r, dev), kd_device(r)
        if not (torch.equal(x.soft.positions, y.soft.positions)
                and torch.equal(x.soft.token_ids, y.soft.token_ids)):
            raise SystemExit("the host-positions read differs from the device-positions one")
    arms = {"ce": lambda r: ce.read(r, dev), "kd_device_positions": kd_device,
            "kd": lambda r: kd.read(r, dev)}
    res = {}
    for mode in ("queued", "synced"):
        for name, fn in arms.items():
            res[f"{name}_{mode}_ms"] = round(timed(fn, rs, dev, mode == "queued"), 3)
    print("  ".join(f"{k} {v}" for k, v in res.items()), flush=True)
    doc = {"what": __doc__.splitlines()[0], "command": command_line("bench.soft_read", argv),
           "device": dev, "host": host_facts(),
           "row": {"tokens": ROW, "feature_width": WIDTH, "top_k": TOP_K,
                   "samples_mean": round(sum(len(r.sample_ids) for r in rs) / len(rs), 1)},
           "rows_timed": len(rs), "ms_per_row": res,
           "kd_over_ce_queued": round(res["kd_queued_ms"] / res["ce_queued_ms"], 3),
           "device_positions_over_ce_queued": round(
               res["kd_device_positions_queued_ms"] / res["ce_queued_ms"], 3),
           "wall_s": round(time.perf_counter() - t0, 1)}
    for c in (ce, kd):
        c.close(remove=True)
    write_result(a.out, doc)
    print(f"wrote {a.out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    run(main)
