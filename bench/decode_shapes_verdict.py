"""Static vs dynamic shapes for the decoders (``bench.decode_shapes``), from two
``bench.gpu.decode_speed --compile-shapes`` runs on one machine: per batch size each engine's
compile seconds and ms per step, what the dynamic run saves in compiling, and the verdict.

The rule (decided before the H200 ran it): ``dynamic`` becomes the default when it compiles in
less time overall and its steps (ms per step of the timed decode, target-only and the full
block, at every batch size both runs measured) are on the whole no slower: their geometric mean
ratio at most 1 + :data:`MEAN_SLOWER_AT_MOST`, and none more than 1 + :data:`ANY_SLOWER_AT_MOST`
(one timed decode per engine: a single batch's ratio carries the run's noise). Random weights
are fine: τ ≈ 1, so both runs step the same number of times.

    python -m bench.decode_shapes_verdict bench/results/cpu/decode_shapes/static.json \\
        bench/results/cpu/decode_shapes/dynamic.json --out /tmp/verdict.json
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.ablation_files import read_json
from bench.entry import run, write_result
from dflash.errors import DFlashError

MEAN_SLOWER_AT_MOST = 0.02  # 2 % slower steps on the whole would cost the served speed-up
ANY_SLOWER_AT_MOST = 0.05   # and no one engine and batch size 5 % slower
ENGINES = ("target_only", "speculative")


def rows_by_batch(doc: dict, path: Path, shapes: str) -> dict[int, dict]:
    """batch -> {engine: (compile s, ms per step)} of one run, checked to be ``shapes``'."""
    if doc.get("compile_shapes", "static") != shapes:
        raise DFlashError(f"{path}: a run with compile_shapes {doc.get('compile_shapes')!r}, "
                          f"given as the {shapes} one")
    try:
        return {int(r["batch"]): {e: (float(r["engine"][e]["compile_seconds"]),
                                      float(r["engine"][e]["ms_per_step"])) for e in ENGINES}
                for r in doc["batches"]}
    except (KeyError, TypeError, ValueError) as e:
        raise DFlashError(f"{path}: not a bench.gpu.decode_speed result "
                          f"({type(e).__name__}: {e})") from None


def verdict(static: dict[int, dict], dynamic: dict[int, dict]) -> dict:
    """The per-batch comparison and the rule's answer over the batch sizes both measured."""
    both = sorted(set(static) & set(dynamic))
    if not both:
        raise DFlashError("the two runs measured no batch size in common")
    rows, ratios = [], {}
    for b in both:
        row = {"batch": b}
        for e in ENGINES:
            (cs, ms), (cd, md) = static[b][e], dynamic[b][e]
            if ms <= 0 or md <= 0:
                raise DFlashError(f"batch {b} {e}: no steps timed ({ms} / {md} ms)")
            ratios[f"batch {b} {e}"] = md / ms
            row[e] = {"compile_s": {"static": cs, "dynamic": cd},
                      "ms_per_step": {"static": ms, "dynamic": md}, "step_ratio": md / ms}
        rows.append(row)
    compile_s = {k: round(sum(run[b][e][0] for b in both for e in ENGINES), 3)
                 for k, run in (("static", static), ("dynamic", dynamic))}
    mean = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    worst = max(ratios, key=ratios.get)
    fails = ([] if compile_s["dynamic"] < compile_s["static"] else
             ["dynamic does not compile in less time"]) + \
        ([f"its steps {mean:.3f}x on the whole (> {1 + MEAN_SLOWER_AT_MOST:.2f}x)"]
         if mean > 1 + MEAN_SLOWER_AT_MOST else []) + \
        ([f"{worst} {ratios[worst]:.3f}x (> {1 + ANY_SLOWER_AT_MOST:.2f}x)"]
         if ratios[worst] > 1 + ANY_SLOWER_AT_MOST else [])
    return {"batches": rows, "compile_s": compile_s, "step_ratio_geomean": round(mean, 4),
            "step_ratio_worst": {"where": worst, "ratio": round(ratios[worst], 4)},
            "rule": {"mean_at_most": 1 + MEAN_SLOWER_AT_MOST, "any_at_most": 1 + ANY_SLOWER_AT_MOST},
            "default": "static" if fails else "dynamic",
            "why": "; ".join(fails) or (f"dynamic compiles in less time, steps {mean:.3f}x on "
                                        f"the whole, at worst {ratios[worst]:.3f}x")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("static", type=Path, help="decode_speed JSON of --compile-shapes static")
    ap.add_argument("dynamic", type=Path, help="decode_speed JSON of --compile-shapes dynamic")
    ap.add_argument("--out", type=Path, help="write the verdict as JSON here")
    a = ap.parse_args(argv)
    v = verdict(rows_by_batch(read_json(a.static), a.static, "static"),
                rows_by_batch(read_json(a.dynamic), a.dynamic, "dynamic"))
    for r in v["batches"]:
        print(f"batch {r['batch']:3d}: " + "; ".join(
            f"{e} compile {r[e]['compile_s']['static']:.1f} -> {r[e]['compile_s']['dynamic']:.1f}"
            f" s, ms/step {r[e]['ms_per_step']['static']:.3f} -> "
            f"{r[e]['ms_per_step']['dynamic']:.3f} ({r[e]['step_ratio']:.3f}x)" for e in ENGINES))
    print(f"compile s (these engines): static {v['compile_s']['static']}, dynamic "
          f"{v['compile_s']['dynamic']}; steps {v['step_ratio_geomean']}x on the whole; "
          f"default: {v['default']} ({v['why']})")
    if a.out:
        write_result(a.out, {"static": str(a.static), "dynamic": str(a.dynamic), **v})
    return 0


if __name__ == "__main__":
    run(main)
