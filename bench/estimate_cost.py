"""What the GPU-memory estimates cost Snakemake before the warm-up and data stage start
(``rules/common.smk``'s ``device_share``: :func:`dflash.train.budget.stage_memory`, once a spec),
on a fresh machine: an empty ``DFLASH_CACHE`` (no converted SmolLM2: its config comes from the
GGUF's metadata). One process, each spec's estimate in turn (the import is the Snakemake log's
``[resources]`` line's other figure).

    python -m bench.estimate_cost specs/smollm2-quality.yaml specs/smollm2-code.yaml \
        --out bench/results/cpu/estimate_cost/after.json
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.entry import command_line, run, write_result
from dflash.spec.load import load_spec
from dflash.train.budget import stage_memory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    out = {"command": command_line("bench.estimate_cost", argv), "estimates": []}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["DFLASH_CACHE"] = cache  # read at each use: a fresh machine's empty cache
        for path in a.specs:
            spec = load_spec(path)
            t = time.perf_counter()
            stage_memory(spec)
            out["estimates"].append({"spec": spec.name,
                                     "seconds": round(time.perf_counter() - t, 3)})
    print("estimates: " + ", ".join(f"{e['spec']} {e['seconds']:.2f} s"
                                    for e in out["estimates"]))
    if a.out:
        write_result(a.out, out)
    return 0


if __name__ == "__main__":
    run(main)
