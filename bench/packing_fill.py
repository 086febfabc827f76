"""Packing fill of a synthetic-data spec's epochs for several first-fit-decreasing windows.

Rows cost the target the same time however full they are, so fill (real tokens / row tokens)
is the share of the target's work that is useful. Regenerates the spec's synthetic sample
lengths exactly (no devices, no model), plans epochs with ``dflash.packing.plan_epoch`` and
prints/writes rows and fill per window:

    PYTHONPATH=. python bench/packing_fill.py specs/qwen3-8b-2gpu.yaml --out bench/results/cpu/packing_fill.json
"""
from __future__ import annotations

import argparse
import json

from dflash import packing
from dflash.stages.data import synthetic_responses, synthetic_samples
from dflash.spec import load_spec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("--windows", type=int, nargs="+", default=[16, 64, 1_000_000])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    spec = load_spec(a.spec)
    samples, _, _ = synthetic_samples(spec)
    responses, _ = synthetic_responses(spec, samples)
    lengths = [len(s.prompt_ids) + len(r) for s, r in zip(samples, responses)]
    b = spec.batching
    default = packing.WINDOW_BATCHES
    rows = []
    try:
        for w in a.windows:
            packing.WINDOW_BATCHES = w
            for epoch in range(a.epochs):
                plan = packing.plan_epoch(lengths, b.token_budget, b.max_batch_size,
                                          spec.seed, epoch)
                fill = sum(lengths) / (b.token_budget * len(plan))
                rows.append({"window_batches": w, "epoch": epoch, "rows": len(plan),
                             "fill": round(fill, 4)})
                print(f"window {w:>7} epoch {epoch}: {len(plan)} rows, fill {fill:.4f}")
    finally:
        packing.WINDOW_BATCHES = default
    res = {"spec": a.spec, "samples": len(lengths), "tokens": sum(lengths),
           "token_budget": b.token_budget, "default_window_batches": default, "plans": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
