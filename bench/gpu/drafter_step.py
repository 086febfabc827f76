"""A drafter replica's training step alone, at a spec's shapes: seconds per step, MFU while busy
and the capacity in target tokens/s one drafter GPU can absorb (issue #17: the drafter side of
the per-worker rates, for runs whose pipeline is target-bound so the drafter's rate never shows).

The replica, its compile (through the gate) and its step are the training ones
(dflash.train.workers / dflash.train.warm); the row is a full synthetic row of the bucket, and the anchor
count per bucket is static, so the step's work equals a real step's.

    python -m bench.gpu.drafter_step --spec specs/expanded-2gpu.yaml --anchors 1024 \
        --device cuda:1 --out drafter_step.json
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dflash.models.drafter import DFlashConfig
from dflash.models.dtypes import dtype_of
from dflash.runtime.gate import get_gate
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec.load import load_spec
from dflash.train.flops import drafter_useful_flops, measure_peak_flops
from dflash.train.warm import synthetic_output, synthetic_row, warm_replica
from dflash.train.workers import buckets, initial_state, make_replicas


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure(spec, anchors: int, device: str, steps: int, peak: float | None,
            prepare=None, after=None) -> dict:
    """``prepare(rep)``, when given, adjusts the replica before its warm-up (an A/B's arm);
    ``after(step)``, when given, runs after the timing with the step and adds its dict."""

    spec = spec.replace(batching={"max_anchors": anchors},
                        topology={"targets": [device], "drafters": [device],
                                  "allow_shared_devices": True})
    cfg = DFlashConfig.of_spec(spec)
    L = buckets(spec)[-1]
    feat_width = len(cfg.target_layer_ids) * cfg.hidden_size
    rep = make_replicas(spec, cfg, initial_state(cfg, spec.seed), total_steps=1000)[0]
    if prepare is not None:
        prepare(rep)
    gate = get_gate()

    def work() -> dict:
        t0 = time.perf_counter()
        warm_replica(rep, L, feat_width, dtype_of(spec.target.dtype), optimizer_step=True)
        compile_s = time.perf_counter() - t0
        row = synthetic_row(L, cfg.vocab_size, seed=3, docs=8)
        feats = synthetic_output(rep, row, feat_width, dtype_of(spec.target.dtype))
        blocks = rep.anchors(row, 5)

        def step():
            res = gate.run(rep.signature(L), lambda: rep.forward_backward(row, feats, blocks))
            with gate.shared():
                rep.clip_and_step()
            return res

        first = step()
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        s = (time.perf_counter() - t) / steps
        # the bench stage's rule, on the counts the training step itself reports (what the
        # train stage logs as metrics "tokens" / "labelled"): padded slots are not useful
        flops = drafter_useful_flops(cfg, first.tokens, first.labelled)
        extra = after(step) if after is not None else {}
        return {**extra, "anchors": anchors, "num_slots": rep.num_slots(L), "bucket": L,
                "compile_s": round(compile_s, 1), "steps": steps, "s_per_step": round(s, 4),
                "tokens": first.tokens, "labelled": first.labelled,
                "tokens_per_s_capacity": round(first.tokens / s, 1), "flops_per_step": flops,
                "mfu_while_busy": round(flops / s / peak, 4) if peak else None}

    with ThreadPoolExecutor(1, initializer=worker_thread_setup) as pool:
        return pool.submit(work).result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--anchors", default="", help="comma list; default: the spec's max_anchors")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    spec = load_spec(a.spec)
    peak = measure_peak_flops(a.device, dtype_of(spec.drafter.dtype))
    anchors = [int(x) for x in a.anchors.split(",") if x] or [spec.batching.max_anchors]
    runs = []
    for n in anchors:
        r = measure(spec, n, a.device, a.steps, peak["flops_per_s"])
        print(f"[drafter_step] {spec.name} anchors {n}: {r['s_per_step']:.3f} s/step, "
              f"capacity {r['tokens_per_s_capacity']:.0f} tok/s, MFU {r['mfu_while_busy']}",
              flush=True)
        runs.append(r)
    out = {"spec": spec.name, "device": (torch.cuda.get_device_name(a.device)
                                         if a.device.startswith("cuda") else "cpu"), "peak": peak,
           "torch": torch.__version__, "runs": runs}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
