"""How long a training step stalls at a checkpoint: written in the step (``checkpoint.save``,
before) against handed to the background writer (``checkpoint.Writer``: the step pays for the
snapshot only), for a spec's real drafter and AdamW state (fp32 masters and moments, after one
optimizer step), on this machine's disk.

Round 19's 6-epoch H200 run stalled ~1.0-1.3 s at each of its 22 checkpoints (its
metrics.jsonl's step times at every 500th step). On CUDA the snapshot also copies the state
off the device; on the CPU it is a host copy.

    python -m bench.checkpoint_stall --spec specs/smollm2-quality.yaml \
        --out bench/results/cpu/checkpoint_stall/cpu.json

``--metrics FILE --every N`` reads the stalls off a committed run instead: each checkpoint
step's time (metrics.jsonl's ``t``, a step to the next) less the run's median step time.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.entry import command_line, run, write_result
from bench.metrics_file import read_metrics
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.spec.load import load_spec
from dflash.train import checkpoint as ckpt

RUN = {"train": "bench", "shape": "bench", "dataset_sha256": "bench", "code": "bench"}


def replica(spec, device: str):
    """The spec's drafter with AdamW state, as a training replica holds it (fp32 masters)."""
    model = DFlashDrafter(DFlashConfig.of_spec(spec)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(model=model, opt=opt, params=list(model.parameters()), sched=sched)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stalls_of_run(metrics: list[dict], every: int) -> dict:
    """A run's stall at each checkpoint (written after steps every-1, 2·every-1, ...): that
    step's time to the next less the median step time (a resumed run's restarted ``t`` skipped)."""
    dt = {a["step"]: b["t"] - a["t"] for a, b in zip(metrics, metrics[1:]) if b["t"] >= a["t"]}
    median = statistics.median(dt.values())
    at = [s for s in sorted(dt) if (s + 1) % every == 0]
    excess = [round(dt[s] - median, 4) for s in at]
    return {"every": every, "median_step_s": round(median, 5), "checkpoints": len(at),
            "stall_s": excess, "stall_median_s": round(statistics.median(excess), 4),
            "stall_total_s": round(sum(excess), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/smollm2-quality.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--metrics", type=Path, help="a committed run's metrics.jsonl[.gz]")
    ap.add_argument("--every", type=int, default=500, help="its checkpoint.every_steps")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.metrics:
        out = {"command": command_line("bench.checkpoint_stall", argv), "metrics": str(a.metrics),
            **stalls_of_run(read_metrics(a.metrics), a.every)}
        print(f"{out['checkpoints']} checkpoints: median stall {out['stall_median_s']:.3f} s, "
              f"{out['stall_total_s']:.1f} s in all (median step {out['median_step_s']:.4f} s)")
        if a.out:
            write_result(a.out, out)
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = load_spec(a.spec)
    rep = replica(spec, device)
    params = sum(p.numel() for p in rep.params)
    rows = {"in_step_s": [], "beside_s": [], "write_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        writer = ckpt.Writer()
        for i in range(a.repeats):  # the two in turn, each first every other time
            for way in (("in_step", "beside") if i % 2 == 0 else ("beside", "in_step")):
                sync(device)
                t = time.perf_counter()
                if way == "in_step":
                    path = ckpt.save(Path(tmp, "sync"), 2 * i + 2, rep, {"tokens": i}, keep=2,
                                     run_fingerprint=RUN)
                    rows["in_step_s"].append(time.perf_counter() - t)
                else:
                    writer.save(Path(tmp, "async"), 2 * i + 2, rep, {"tokens": i}, keep=2,
                                run_fingerprint=RUN)
                    rows["beside_s"].append(time.perf_counter() - t)
                    writer.finish()
                    rows["write_s"].append(time.perf_counter() - t)
        writer.close()
        size = sum(f.stat().st_size for f in path.iterdir())
    out = {"command": command_line("bench.checkpoint_stall", argv), "device": device,
        "spec": spec.name, "drafter_params": params, "checkpoint_bytes": size,
        "repeats": a.repeats, **{k: [round(x, 4) for x in v] for k, v in rows.items()},
        "median": {k: round(statistics.median(v), 4) for k, v in rows.items()}}
    m = out["median"]
    print(f"{spec.name}: drafter {params / 1e6:.1f}M params, checkpoint {size / 1e6:.0f} MB; "
          f"the step stalls {m['in_step_s']:.3f} s writing it, {m['beside_s']:.3f} s with the "
          f"background writer (its write {m['write_s']:.3f} s beside the next steps)")
    if a.out:
        write_result(a.out, out)
    return 0


if __name__ == "__main__":
    run(main)
