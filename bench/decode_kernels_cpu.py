"""Kernels per decoder step by compile scope, counted on CPU with inductor (the GPU has no
stand-in here): a random SmolLM2-135M-shaped target of 2 and of 3 layers (float32) and a
1-layer drafter; per scope the launches of one target-only and one speculative step
(bench/gpu/step_profile.py's CPU proxy: inductor's kernels + top-level non-view ATen ops), and
from the two depths the launches per target layer and outside the layers. Writes JSON.

    PYTHONPATH=$PWD python -m bench.decode_kernels_cpu --out bench/results/cpu/decode_kernels.json

On CUDA a GEMM, SDPA or topk may launch one to a few kernels where the proxy counts one, so the
figures compare scopes; decode_speed.py's ``kernels`` (the CUDA profiler's count) is the real one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

from bench.gpu.decode_speed import random_models
from bench.gpu.step_profile import step_profile
from dflash.decode.compile_choices import COMPILE_SCOPES
from dflash.decode.speculative import Decoder


def count(depth: int, scope: str, with_drafter: bool) -> dict:
    target, drafter, eos, _ = random_models("cpu", 1, 16, depth, torch.float32)
    t0 = time.time()
    dec = Decoder(target, drafter if with_drafter else None, batch=1, max_len=256,
                  max_new_tokens=32, eos_ids=eos, compile="inductor", compile_scope=scope)
    dec.prepare()
    prof = step_profile(dec)
    return {"kernels": prof.get("kernels"), "graphs": dec.stats["graphs_compiled"],
            "prepare_s": round(time.time() - t0, 1),
            "by_name": {k: c for k, c, _ in prof.get("top_kernels", [])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scopes", default=",".join(COMPILE_SCOPES))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's kernels in the profile
    out = {"command": " ".join(sys.argv), "torch": torch.__version__, "scopes": {}}
    for scope in a.scopes.split(","):
        row = {}
        for mode, spec in (("target_only", False), ("speculative", True)):
            c2, c3 = count(2, scope, spec), count(3, scope, spec)
            per_layer = c3["kernels"] - c2["kernels"]
            row[mode] = {"depth2": c2, "depth3": c3, "per_target_layer": per_layer,
                         "outside_target_layers": c2["kernels"] - 2 * per_layer,
                         "at_30_target_layers": c2["kernels"] + 28 * per_layer}
        out["scopes"][scope] = row
        print(scope, {m: (r["per_target_layer"], r["outside_target_layers"],
                          r["at_30_target_layers"]) for m, r in row.items()}, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
