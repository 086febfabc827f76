"""The feature cache's read of one quality-shaped row, old against new, in one run (issue #34
item 3: when the drafter gets faster, the cached epochs' read must not become the bottleneck).

* ``old``: the read as it was before the gather (kept here as the reference): a fresh buffer
  per row (pinned when CUDA is there), the ~30 samples copied one ``copy_`` at a time on one
  thread, the tail zeroed, then the copy to the device.
* ``new``: :meth:`dflash.train.feature_cache.FeatureCache.read`: one ``index_select`` into a
  reused staging slot (intra-op parallel), then one non-blocking copy (CPU: a clone).

Each is timed whole (``*_read_ms``) and by its host side alone (``*_gather_ms``: where the row
lands in host memory, before the copy to the device).

Shape: smollm2-quality's row, 8,192 tokens x 2,880 bf16 features (5 layers x 576), samples of
~270 tokens (~30 a row), from a host store of ``--store-gb`` (2 GB: rows far apart in memory, as
in a real epoch). Each arm reads the same rows, at each intra-op thread count up to the cores
(``torch.set_num_threads``), with the device synchronised after every read. The two arms' rows
are checked equal byte for byte.

    PYTHONPATH=$PWD python -m bench.cache_read                        # -> bench/results/cpu/cache_read.json
    PYTHONPATH=$PWD python -m bench.cache_read --out /tmp/X.json      # the GPU box: pinned + H2D (< 30 s)
"""
from __future__ import annotations

import argparse
import os
import random
import time
from types import SimpleNamespace

import torch

from bench.entry import host_facts, run, write_result
from dflash.train import feature_cache as fc
from dflash.train.cache_budget import Plane

ROW, WIDTH, LAYERS = 8192, 2880, 5
SAMPLE_TOKENS = (150, 390)  # ~270 on average: ~30 samples fill a row


def old_gather(cache: fc.FeatureCache, row, pin: bool) -> torch.Tensor:
    """The host side of the read before the gather (one plane, bf16): a fresh buffer, one
    ``copy_`` per sample."""
    src = cache.a.t["features"]
    buf = torch.empty((row.input_ids.shape[0], src.shape[1]), dtype=src.dtype, pin_memory=pin)
    start = 0
    for s in row.sample_ids:
        i = cache.index[int(s)]
        n = cache.lengths[i]
        buf[start:start + n].copy_(src[cache.offsets[i]:cache.offsets[i] + n])
        start += n
    buf[start:].zero_()
    return buf


def old_read(cache: fc.FeatureCache, row, device: str) -> torch.Tensor:
    """The whole read before the gather: on CPU the buffer itself (``.to`` is a no-op)."""
    return old_gather(cache, row, device.startswith("cuda")).to(device, non_blocking=True)[None]


def new_gather(cache: fc.FeatureCache, row, staging: torch.Tensor) -> torch.Tensor:
    """The host side of today's read, as FeatureCache.read runs it: the row's store index, one
    ``index_select`` into a reused buffer, the tail zeroed."""
    idx = cache.row_index(row.sample_ids)
    torch.index_select(cache.a.t["features"], 0, idx, out=staging[:idx.numel()])
    staging[idx.numel():].zero_()
    return staging


def sample_lengths(store_gb: float, seed: int) -> list[int]:
    """Sample lengths (SAMPLE_TOKENS) until their bf16 features fill ~``store_gb``."""
    rnd = random.Random(seed)
    tokens, lengths = int(store_gb * 1e9 / (WIDTH * 2)), []
    while sum(lengths) < tokens:
        lengths.append(rnd.randint(*SAMPLE_TOKENS))
    return lengths


def build(store_gb: float, seed: int) -> fc.FeatureCache:
    """A filled host store of ~``store_gb`` (random finite bf16: no NaN, so rows compare)."""
    lengths = sample_lengths(store_gb, seed)
    plane = Plane("features", WIDTH, torch.bfloat16, torch.bfloat16, groups=LAYERS)
    cache = fc.FeatureCache([plane], list(range(len(lengths))), lengths, tensor_values=True)
    # |bits| < 16000: exponent field below all-ones, every value finite
    cache.a.t["features"].view(torch.int16).random_(-16000, 16000)
    cache.a.t["filled"].fill_(1)
    return cache


def rows(cache: fc.FeatureCache, n: int, seed: int) -> list:
    """``n`` rows of random samples filling up to ROW tokens (the rest padding)."""
    rnd, out = random.Random(seed), []
    ids = list(range(len(cache.lengths)))
    for _ in range(n):
        rnd.shuffle(ids)
        picked, used = [], 0
        for s in ids:
            if used + cache.lengths[s] > ROW:
                break
            picked.append(s)
            used += cache.lengths[s]
        out.append(SimpleNamespace(input_ids=torch.empty(ROW), sample_ids=picked))
    return out


def time_arm(fn, rs, device: str) -> float:
    """Mean ms per row read (device synchronised after each), after one warm read."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn(rs[0])
    sync()
    t = time.perf_counter()
    for r in rs:
        fn(r)
        sync()
    return (time.perf_counter() - t) / len(rs) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu/cache_read.json")
    ap.add_argument("--store-gb", type=float, default=2.0)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    load = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    cache = build(a.store_gb, 0)
    rs = rows(cache, a.rows, 1)
    build_s = time.perf_counter() - t0
    for r in rs[:3]:  # the two arms agree, padding zeros included
        new, old = cache.read(r, a.device), old_read(cache, r, a.device)
        if not torch.equal(new.view(torch.int16), old.view(torch.int16)):
            raise SystemExit(f"new read differs from the old one on row of {r.sample_ids[:4]}")
    cores = os.cpu_count() or 1
    threads = sorted({n for n in (1, 2, 4, 8, 16, cores) if n <= cores})
    pin = a.device.startswith("cuda")
    staging = torch.empty((ROW, WIDTH), dtype=torch.bfloat16, pin_memory=pin)
    before, by_threads = torch.get_num_threads(), []
    for n in threads:
        torch.set_num_threads(n)
        t = {"threads": n}
        for arm, fn in (("old_gather", lambda r: old_gather(cache, r, pin)),
                        ("new_gather", lambda r: new_gather(cache, r, staging)),
                        ("old_read", lambda r: old_read(cache, r, a.device)),
                        ("new_read", lambda r: cache.read(r, a.device))):
            t[arm + "_ms"] = round(time_arm(fn, rs, a.device), 3)
        t["gather_speedup"] = round(t["old_gather_ms"] / t["new_gather_ms"], 2)
        t["read_speedup"] = round(t["old_read_ms"] / t["new_read_ms"], 2)
        by_threads.append(t)
        print(f"threads {n:2d}: " + "  ".join(f"{k} {v}" for k, v in t.items() if k != "threads"),
              flush=True)
    torch.set_num_threads(before)
    real = sum(sum(cache.lengths[s] for s in r.sample_ids) for r in rs) / len(rs)
    doc = {
        "what": "feature-cache read of one smollm2-quality row: per-sample copies into a fresh "
                "buffer (old) vs one index_select into a reused staging slot (new)",
        "command": "python -m bench.cache_read" + (f" --out {a.out}" if a.out else ""),
        "device": a.device, "pinned_h2d": a.device.startswith("cuda"),
        "host": host_facts(load_avg_1min=load),  # the load at the start, before our threads
        "row": {"tokens": ROW, "width": WIDTH, "dtype": "bfloat16",
                "mb": round(ROW * WIDTH * 2 / 1e6, 1),
                "samples_mean": round(sum(len(r.sample_ids) for r in rs) / len(rs), 1),
                "real_tokens_mean": round(real)},
        "store_gb": round(cache.a.t["features"].numel() * 2 / 1e9, 2), "rows_timed": len(rs),
        "bit_equal": True, "by_threads": by_threads,
        "note": "gather = the host side alone (where the row lands in host memory); read = the "
                "whole read. On CPU the new read ends with a clone (its stand-in for the copy to "
                "the device, so the value never aliases a reused buffer) where the old one "
                "returned its fresh buffer: on CPU only the gather compares like for like.",
        "best": min(by_threads, key=lambda x: x["new_read_ms"]),
        "wall_s": round(time.perf_counter() - t0, 1), "build_s": round(build_s, 1),
    }
    cache.close(remove=True)
    write_result(a.out, doc)
    print(f"wrote {a.out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    run(main)
