"""Steady-state throughput of a train run from its metrics.jsonl alone (for a run cut before
its manifest was written, e.g. by a device time limit during the final checkpoint).

    python -m bench.steady_state_from_metrics METRICS.jsonl --skip 5 --out steady_state.json

``by_epoch`` gives the same figures per epoch (each epoch's first ``--skip`` steps left out):
with ``features.cache`` epochs >= 1 read the target's features instead of running the target.
``--steps N`` keeps a run's first N steps only: a run cut early against a whole one over the
same window (round 25's cut kd-epochs8 against round 24's kd, both in epoch 0).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.metrics_file import read_metrics


def steady_state(rows: list[dict], skip: int, token_budget: int | None) -> dict:
    s = rows[skip:]
    if len(s) < 2:
        raise SystemExit(f"need more than {skip + 1} steps, have {len(rows)}")
    dt = s[-1]["t"] - s[0]["t"]
    tokens = sum(r["tokens"] for r in s[1:])  # steps completed inside the window
    out = {"steps_total": len(rows), "warmup_steps_skipped": skip, "steady_steps": len(s) - 1,
           "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
           "step_time_s": round(dt / (len(s) - 1), 4),
           "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}
    if token_budget:
        out["row_fill"] = round(sum(r["tokens"] for r in rows) / (len(rows) * token_budget), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics", type=Path)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="only the run's first N steps")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = read_metrics(a.metrics)[:a.steps]
    res = steady_state(rows, a.skip, a.token_budget)
    epochs = sorted({r["epoch"] for r in rows if "epoch" in r})
    if len(epochs) > 1:
        res["by_epoch"] = {str(e): steady_state([r for r in rows if r.get("epoch") == e], a.skip,
                                                a.token_budget) for e in epochs}
    print(json.dumps(res, indent=1))
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
