"""What compiling the bench's decoders ahead saves its decoding sweep (the decoders stage,
dflash/stages/decoders.py), on one machine, in three processes with random SmolLM2-135M-shaped
models (bench.gpu.decode_speed's):

1. ``cold``: the sweep (:func:`dflash.eval.serving.sweep`) with an empty compile cache, as the
   bench stage ran it before the decoders stage existed;
2. ``ahead``: :func:`dflash.eval.serving.compile_ahead`, the decoders stage's work, into a
   second empty cache, with drafter weights of seed 0;
3. ``warm``: the same sweep from the second cache with drafter weights of seed 1 (a trained
   drafter's are not the stage's random ones).

Prints and writes each run's wall seconds (and each decoder's), the graphs dynamo compiled
and inductor's cache counters. On CPU the decoders compile with inductor's
C++ backend (the bench decodes eagerly there: the figures are the mechanism's; an H100's:
bench/results/h100/round20-2026-12-05/); on CUDA as the bench compiles them.

    python -m bench.decoders_ahead --target-layers 4 --drafter-layers 1 --batches 1,4 \
        --widths 4,8 --max-new 16 --out bench/results/cpu/decoders_ahead/cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from bench.gpu.decode_speed import random_models, random_prompts
from bench.entry import run, write_result
from dflash.eval.serving import compile_ahead, sweep

REPO = Path(__file__).resolve().parents[1]


def one(a) -> dict:
    """One run in this process: ``a.run`` is cold, ahead or warm."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter, eos, pad = random_models(dev, a.drafter_layers, a.block, a.target_layers,
                                              seed=1 if a.run == "warm" else 0)
    args = dict(batches=a.batches, min_prompts=a.min_prompts, hf_batches=(), pad_id=pad,
                widths=a.widths, log=lambda m: None,
                **({} if dev == "cuda" else {"compile": "inductor"}))
    prompts = random_prompts(max(max(a.batches), a.min_prompts))
    t = time.perf_counter()
    if a.run == "ahead":
        rows = compile_ahead(target, drafter, prompts, a.max_new, eos, **args)
        per_decoder = {f"{r['batch']}/{r['decoder']}": r["seconds"] for r in rows}
    else:  # each decoder's wall: built, compiled, captured, one warm and one timed decode
        rows = sweep(target, drafter, prompts, a.max_new, eos, **args)["batches"]
        per_decoder = {f"{r['batch']}/{k}": v for r in rows for k, v in r["wall_s"].items()}
    return {"run": a.run, "seconds": round(time.perf_counter() - t, 3),
            "decoders": len(per_decoder), "per_decoder_s": per_decoder,
            "graphs": int(counters["stats"]["unique_graphs"]),
            "cache": {k: int(v) for k, v in counters["inductor"].items()
                      if k.startswith(("fxgraph_cache", "autograd_cache"))}}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", choices=("cold", "ahead", "warm"), help="one run (internal)")
    ap.add_argument("--target-layers", type=int, default=30)
    ap.add_argument("--drafter-layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batches", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(16,))
    ap.add_argument("--widths", type=lambda s: tuple(int(x) for x in s.split(",") if x),
                    default=(4, 8))
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.run:
        print(json.dumps(one(a)))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    runs, roots = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for run, cache in (("cold", "cold"), ("ahead", "stage"), ("warm", "stage")):
            roots[run] = Path(tmp, cache)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(roots[run] / "inductor"),
                   "TRITON_CACHE_DIR": str(roots[run] / "triton"),
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "bench.decoders_ahead", *passed, "--run",
                                run], cwd=REPO, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return r.returncode
            runs[run] = {**json.loads(r.stdout.strip().splitlines()[-1]),
                         "process_s": round(time.perf_counter() - t, 3)}
            print(f"{run:5s}: {runs[run]['seconds']:.1f} s for {runs[run]['decoders']} "
                  f"decoders ({runs[run]['graphs']} graphs; cache {runs[run]['cache']}); "
                  f"process {runs[run]['process_s']:.1f} s", flush=True)
    out = {"command": "python -m bench.decoders_ahead " + " ".join(passed),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "runs": runs,
           "sweep_saved_s": round(runs["cold"]["seconds"] - runs["warm"]["seconds"], 3),
           "sweep_warm_over_cold": round(runs["warm"]["seconds"] / runs["cold"]["seconds"], 4)}
    print(f"the sweep from the stage's cache: {runs['warm']['seconds']:.1f} s against "
          f"{runs['cold']['seconds']:.1f} s cold ({out['sweep_warm_over_cold']:.2f}x)")
    if a.out:
        write_result(a.out, out)
    return 0


if __name__ == "__main__":
    run(main)
