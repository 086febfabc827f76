"""Every committed H200 MFU over both denominators, with the drafter's FLOPs recounted.

The committed bench reports divide by the bf16 matmul peak measured in the same session (an
8192³ matmul, ~782–799 TFLOP/s); figures elsewhere are usually against the datasheet's dense
peak (H200: 989 TFLOP/s). And those reports counted the drafter's frozen lm_head 3× its forward
(as if it had a weight gradient); the code now counts it 2× (forward + input gradient:
dflash.train.flops.drafter_flops_per_step). This script recounts the drafter FLOPs of each
report's steady-state window from the committed metrics and the warmup manifest's drafter
config (old rule = new rule + one more lm_head forward) and writes both denominators:

    python -m bench.mfu_denominators --out bench/results/h200/mfu_denominators.json

Only committed files are read; nothing is measured.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash.models.drafter import DFlashConfig
from dflash.train.flops import datasheet_peak, drafter_useful_flops

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "bench" / "results" / "h200"
# (run, report, warmup manifest, train manifest, metrics), as committed
RUNS = {
    "qwen3-8b-2gpu-balanced": ("qwen3-8b-2gpu-balanced/replayed_bench/report.json",
                               "qwen3-8b-2gpu-balanced/qwen3-8b-2gpu-balanced__warmup__manifest.json",
                               "qwen3-8b-2gpu-balanced/qwen3-8b-2gpu-balanced__train__manifest.json",
                               "qwen3-8b-2gpu-balanced/qwen3-8b-2gpu-balanced__train__metrics.jsonl"),
    "qwen3-8b-2gpu": ("qwen3-8b-2gpu/qwen3-8b-2gpu__bench__report.json",
                      "qwen3-8b-2gpu/qwen3-8b-2gpu__warmup__manifest.json",
                      "qwen3-8b-2gpu/qwen3-8b-2gpu__train__manifest.json",
                      "qwen3-8b-2gpu/qwen3-8b-2gpu__train__metrics.jsonl"),
    "qwen3-8b-1gpu": ("qwen3-8b-1gpu/bench__report.json", "qwen3-8b-1gpu/warmup__manifest.json",
                      "qwen3-8b-1gpu/train__manifest.json", "qwen3-8b-1gpu/train__metrics.jsonl"),
}


def recount(report: dict, dcfg, window: list[dict], gpu: str) -> dict:
    """One run's MFUs: as committed, with the lm_head recounted, over both peaks."""
    new = sum(drafter_useful_flops(dcfg, m["tokens"], m["labelled"]) for m in window)
    lm_fwd = sum(2 * m["labelled"] * dcfg.hidden_size * dcfg.vocab_size for m in window)
    old = new + lm_fwd                        # the committed reports' rule: lm_head 3× forward
    measured = report["peak"]["flops_per_s"]
    ds = datasheet_peak(gpu, report["peak"]["dtype"])
    scale = measured / ds["flops_per_s"]
    out = {"measured_peak_flops_per_s": measured, "measured_peak": f"{report['peak']['n']}³ "
           f"{report['peak']['dtype']} matmul, same session", "datasheet_peak_flops_per_s":
           ds["flops_per_s"], "datasheet": ds["source"], "window_steps": len(window),
           "lm_head_share_of_committed_drafter_flops": lm_fwd * 3 / old,
           "drafter_flops_recounted_over_committed": new / old}
    for key in ("target_mfu", "drafter_mfu", "drafter_mfu_while_busy"):
        v = report.get(key)
        if v is None:
            continue
        recounted = v if key == "target_mfu" else v * new / old
        out[key] = {"committed_over_measured_peak": v, "over_measured_peak": recounted,
                    "over_datasheet_peak": recounted * scale}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    res = {}
    for name, (rep, warm, train, metrics) in RUNS.items():
        report = json.loads((H200 / rep).read_text())
        cfg = json.loads((H200 / warm).read_text())["drafter_config"]
        dcfg = DFlashConfig(**cfg)
        steps = json.loads((H200 / train).read_text())["steady_state"]["steps"]
        rows = [json.loads(x) for x in (H200 / metrics).read_text().splitlines() if x.strip()]
        gpu = (report.get("hardware") or {}).get("gpus") or [{"name": "NVIDIA H200"}]
        res[name] = {"report": f"bench/results/h200/{rep}",
                     **recount(report, dcfg, rows[len(rows) - steps:], gpu[0]["name"])}
        r = res[name]
        print(f"{name}: target MFU {r['target_mfu']['over_measured_peak']:.3f} measured / "
              f"{r['target_mfu']['over_datasheet_peak']:.3f} datasheet; drafter "
              f"{r['drafter_mfu']['committed_over_measured_peak']:.3f} committed -> "
              f"{r['drafter_mfu']['over_measured_peak']:.3f} measured / "
              f"{r['drafter_mfu']['over_datasheet_peak']:.3f} datasheet")
    a.out.write_text(json.dumps({"command": "python -m bench.mfu_denominators --out " + str(a.out),
                                 "runs": res}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
