"""Row fill and batch randomness of the epoch planner against the one it replaced and references.

Rows cost the target the same time however full they are, so fill (real tokens / padded row
tokens, ``efficiency_padded``) is the share of the target's work that is useful. Batches should
still be random draws of the data: ``length_grouping`` (between-row share of the length variance
above that of random rows; ~0 random, large when long samples share rows) and ``lag1_corr``
(correlation of consecutive batches' mean length; ~1 for an unshuffled sorted order), see
``dflash.train.packing.batch_randomness``.

Planners compared, each over several epochs:
  stream_close    dflash.train.packing.plan_epoch (today): the shuffled order as it comes, each row
                  closed with the best-fitting 1-2 of the next LOOKAHEAD samples
  window_ffd16    the previous planner: first-fit decreasing inside windows of 16 batches
  next_fit        reference for randomness: the shuffled order cut into rows as it comes
  sorted_ffd      reference for grouping: first-fit decreasing over the whole epoch, rows in
                  that (length-sorted) order
  sorted_ffd_shuf the same rows shuffled (hides from lag1_corr, not from length_grouping)

Length sets: the spec's synthetic samples regenerated exactly by the data stage's own functions
(no devices, no model) and, with ``--parquet``, a dataset.parquet the data stage wrote:

    PYTHONPATH=. python -m bench.packing_fill specs/qwen3-8b-2gpu.yaml specs/expanded-2gpu.yaml \\
        --parquet tiny=specs/tiny.yaml=/tmp/fresh/results/tiny/data/dataset.parquet \\
        --out bench/results/cpu/packing_fill.json
"""
from __future__ import annotations

import argparse
import json
import time

import pyarrow.parquet as pq

from dflash.data.sources import synthetic_responses, synthetic_samples
from dflash.spec.load import load_spec
from dflash.train import packing


def window_ffd(lengths, token_budget, max_batch_size, seed, epoch, window_batches=16,
               shuffle_batches=True):
    """The planner before this change (dflash/train/packing.py at 8d4e5df), verbatim but for the
    window parameter: first-fit decreasing inside windows of the shuffled order."""
    order = list(range(len(lengths)))
    packing._rng(seed, epoch, "order").shuffle(order)
    mean = max(1.0, sum(lengths) / max(1, len(lengths)))
    per_batch = max(1, min(max_batch_size, int(token_budget // mean)))
    window = max(1, window_batches * per_batch)
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: -lengths[i])
        bins, room = [], []
        for i in chunk:
            n = lengths[i]
            for b, r in enumerate(room):
                if r >= n and len(bins[b]) < max_batch_size:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(token_budget - n)
        batches.extend(bins)
    if shuffle_batches:
        packing._rng(seed, epoch, "batches").shuffle(batches)
    return batches


def next_fit(lengths, token_budget, max_batch_size, seed, epoch):
    order = list(range(len(lengths)))
    packing._rng(seed, epoch, "order").shuffle(order)
    batches, cur, room = [], [], token_budget
    for i in order:
        if cur and (lengths[i] > room or len(cur) == max_batch_size):
            batches.append(cur)
            cur, room = [], token_budget
        cur.append(i)
        room -= lengths[i]
    batches.append(cur)
    return batches


PLANNERS = {
    "stream_close": packing.plan_epoch,
    "window_ffd16": window_ffd,
    "next_fit": next_fit,
    "sorted_ffd": lambda *a: window_ffd(*a, window_batches=1 << 40, shuffle_batches=False),
    "sorted_ffd_shuf": lambda *a: window_ffd(*a, window_batches=1 << 40),
}


def synthetic_lengths(spec) -> list[int]:
    samples, _, _ = synthetic_samples(spec)
    responses, _ = synthetic_responses(spec, samples)
    return [len(s.prompt_ids) + len(r) for s, r in zip(samples, responses)]


def parquet_lengths(path: str) -> list[int]:
    return [len(x) for x in pq.read_table(path, columns=["input_ids"])["input_ids"].to_pylist()]


def measure(name: str, spec, lengths: list[int], epochs: int) -> dict:
    b = spec.batching
    buckets = packing.bucket_lengths(b.token_budget, b.num_buckets)
    out = {"set": name, "spec": spec.name, "samples": len(lengths), "tokens": sum(lengths),
           "length_min": min(lengths), "length_max": max(lengths),
           "length_mean": round(sum(lengths) / len(lengths), 1),
           "token_budget": b.token_budget, "max_batch_size": b.max_batch_size,
           "buckets": buckets, "min_rows": -(-sum(lengths) // b.token_budget), "planners": {}}
    print(f"\n{name}: {len(lengths)} samples, {sum(lengths)} tokens, lengths "
          f"{min(lengths)}..{max(lengths)}, budget {b.token_budget}, max_batch_size "
          f"{b.max_batch_size}, buckets {buckets}, >= {out['min_rows']} rows")
    print(f"  {'planner':<16} {'rows':>6} {'fill':>7} {'worst':>7} {'grouping':>9} "
          f"{'lag1':>6} {'ms':>6}")
    for pname, plan in PLANNERS.items():
        per = []
        for epoch in range(epochs):
            t = time.perf_counter()
            batches = plan(lengths, b.token_budget, b.max_batch_size, spec.seed, epoch)
            ms = (time.perf_counter() - t) * 1e3
            assert sorted(i for x in batches for i in x) == list(range(len(lengths))), pname
            st = packing.packing_stats(batches, lengths, buckets)
            per.append({"epoch": epoch, "rows": st["batches"], "ms": round(ms, 1),
                        **{k: round(st[k], 4) for k in
                           ("efficiency_padded", "efficiency_budget", "length_grouping",
                            "lag1_corr", "mean_batch_size")}})
        mean = {k: round(sum(p[k] for p in per) / epochs, 4)
                for k in ("rows", "efficiency_padded", "length_grouping", "lag1_corr", "ms")}
        mean["worst_epoch_efficiency_padded"] = min(p["efficiency_padded"] for p in per)
        out["planners"][pname] = {"mean": mean, "epochs": per}
        print(f"  {pname:<16} {mean['rows']:>6.1f} {mean['efficiency_padded']:>7.4f} "
              f"{mean['worst_epoch_efficiency_padded']:>7.4f} {mean['length_grouping']:>9.4f} "
              f"{mean['lag1_corr']:>6.3f} {mean['ms']:>6.1f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("specs", nargs="+", help="specs with data.source synthetic")
    p.add_argument("--parquet", action="append", default=[],
                   help="NAME=SPEC=PATH: a data stage's dataset.parquet, planned with SPEC's "
                        "batching")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sets = []
    for path in a.specs:
        spec = load_spec(path)
        sets.append(measure(f"{spec.name} (synthetic)", spec, synthetic_lengths(spec), a.epochs))
    for item in a.parquet:
        name, spec_path, path = item.split("=", 2)
        spec = load_spec(spec_path)
        sets.append(measure(f"{name} (data stage)", spec, parquet_lengths(path), a.epochs))
    res = {"epochs": a.epochs, "lookahead": packing.LOOKAHEAD, "close_room": packing.CLOSE_ROOM,
           "sets": sets}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
