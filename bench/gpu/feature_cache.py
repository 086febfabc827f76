"""The feature cache's A/B on a target-bound shape: tokens/s of epochs >= 1 (rows read from the
cache) vs epoch 0 (the target's forward + the cache's write), on the target side, for bf16 and
float8_e4m3 storage. Goal (issue #24): epochs >= 1 at >= 2x epoch 0.

    PYTHONPATH=$PWD python -m bench.gpu.feature_cache --out bench/results/h200   # Qwen3-8B shape
    PYTHONPATH=$PWD python -m bench.gpu.feature_cache --smoke --out /tmp/fc      # CPU, tiny

Writes ``feature_cache_8b.json`` (or ``feature_cache_smoke.json``); the measurement itself is
:func:`bench.gpu.target_side.cache_ab` (the package's FeatureCache, a real target forward).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench.gpu.target_side import TINY, cache_ab, config_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/h200"))
    ap.add_argument("--smoke", action="store_true", help="a tiny target on CPU")
    ap.add_argument("--rows", type=int, default=6)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.smoke or not torch.cuda.is_available():
        cache_ab("cpu", config_dir(TINY), 512, a.rows, out, "feature_cache_smoke")
    else:
        cache_ab("cuda:0", "qwen3-8b", 16384, a.rows, out, "feature_cache_8b")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
