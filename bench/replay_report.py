"""Rebuild a bench report from a GPU run's train manifest when the bench stage itself did not
run there (e.g. a device time limit ended the DAG right after training).

The report is made by the bench stage's own code (dflash.stages.bench.run) from the run's
train manifest and metrics; only two things cannot come from this machine and are given:
the bf16 matmul peak (the MFU denominator), read from a JSON measured on the same kind of GPU
in the same session (its "peak" entry, e.g. target_anchor.py's output), and the GPU names,
read from the run's env manifest. A synthetic-data spec's dataset (for the documents'
lengths) is rebuilt here by the data stage (deterministic for the spec).

    python -m bench.replay_report --spec specs/qwen3-8b-2gpu-balanced.yaml \
        --run bench/results/h200/qwen3-8b-2gpu-balanced \
        --peak bench/results/h200/target_anchor_compiled.json \
        --out bench/results/h200/qwen3-8b-2gpu-balanced/replayed_bench
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

import dflash.stages.bench as bench
import dflash.stages.data as data_stage
from dflash.spec.load import load_spec
from dflash.stages import StageContext
from dflash.train.flops import datasheet_peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--run", type=Path, required=True,
                    help="folder with <spec>__{env,train}__manifest.json and __train__metrics")
    ap.add_argument("--peak", type=Path, required=True, help="JSON with a measured 'peak'")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    spec = load_spec(a.spec)
    name = spec.name
    env = json.loads((a.run / f"{name}__env__manifest.json").read_text())
    peak = dict(json.loads(a.peak.read_text())["peak"])
    peak["source"] = f"{a.peak} (measured on the same GPU kind in the same session)"
    gpus = (env.get("nvidia") or {}).get("gpus") or []
    # the second MFU denominator: the datasheet dense peak of the run's GPU (its env record)
    peak["datasheet"] = datasheet_peak(gpus[0] if gpus else None, peak["dtype"])
    work = Path(tempfile.mkdtemp(prefix="replay-")) / name
    (work / "train").mkdir(parents=True)
    shutil.copy(a.run / f"{name}__train__manifest.json", work / "train" / "manifest.json")
    shutil.copy(a.run / f"{name}__train__metrics.jsonl", work / "train" / "metrics.jsonl")
    ctx = StageContext(spec=spec, results=work, env_manifest=env,
                       env_fingerprint=env["fingerprints"]["env"])
    data_stage.run(ctx)
    bench.measure_peak_flops = lambda device, dtype: peak
    torch.cuda.get_device_name = lambda d: (gpus[torch.device(d).index or 0]
                                            if gpus else "unknown (replay)")
    report = bench.run(ctx)
    a.out.mkdir(parents=True, exist_ok=True)
    for f in (work / "bench").iterdir():
        shutil.copy(f, a.out / f.name)
    report["replayed"] = {"from": str(a.run), "peak": peak["source"],
                          "note": "bench stage run on CPU from the GPU run's train manifest"}
    (a.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    keys = ("tokens_per_s", "target_mfu", "drafter_mfu", "target_busy_fraction")
    print(json.dumps({k: report.get(k) for k in keys}, indent=1))
    print(f"wrote {a.out}/report.json")


if __name__ == "__main__":
    main()
