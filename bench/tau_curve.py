"""τ against training tokens, from the τ-while-training points of one or more runs.

    python -m bench.tau_curve bench/results/h200/smollm2-quality-run1 \
        bench/results/h200/smollm2-greedy-run2 --out bench/results/h200/tau_curve

Reads each run folder's ``metrics.jsonl`` (or ``.jsonl.gz``; ``monitor.tau_every_steps`` writes ``tau_heldout``:
simulated τ on held-out prompts) and writes ``<out>.json`` (per run: step, target tokens seen,
τ, top-1 draft accuracy at block positions 1-4) and ``<out>.png``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.metrics_file import read_metrics


def curve(run: Path) -> list[dict]:
    tokens, points = 0, []
    for m in read_metrics(run / "metrics.jsonl"):
        tokens += m["tokens"]
        if m.get("tau_heldout") is not None:
            points.append({"step": m["step"], "target_tokens": tokens,
                           "tau_heldout": round(m["tau_heldout"], 4),
                           "draft_acc_1_4": [round(a, 3) for a in (m.get("draft_acc") or [])[:4]]})
    return points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", required=True, type=Path, help="path stem for .json and .png")
    a = ap.parse_args(argv)
    res = {r.name: curve(r) for r in a.runs}
    for name, pts in res.items():
        print(name)
        for p in pts:
            print(f"  step {p['step']:>5}  {p['target_tokens'] / 1e6:7.2f}M tokens  "
                  f"τ {p['tau_heldout']:.3f}  acc@1..4 {p['draft_acc_1_4']}")
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")

    import matplotlib  # noqa: PLC0415 - the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, pts in res.items():
        ax.plot([p["target_tokens"] / 1e6 for p in pts], [p["tau_heldout"] for p in pts],
                marker="o", label=name)
    ax.set(xlabel="target tokens trained on (M)", ylabel="τ (held-out, simulated)",
           title="τ while training")
    ax.set_xscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
