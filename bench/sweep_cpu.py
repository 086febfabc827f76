"""CPU benchmark: a sweep end to end, as the README's "Sweeps" example runs it on a 2-core box.

    python -m bench.sweep_cpu --sweep sweeps/tiny-lr.yaml --out bench/results/cpu/sweep_tiny_lr.json

In a temporary copy of the workflow (dflash.runtime.harness, as the tests do) with the sweep's
base spec and the sweep file: ``snakemake --cores 2 bench_<sweep>`` once, timed. Writes the job
counts Snakemake printed (the env, warm-up and data stages once for arms that differ in training
fields only), each stage's wall seconds from benchmarks/ (the shared stages once, under
benchmarks/.shared/), the sweep report's rows and the wall time of the whole command.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from dflash.runtime.harness import REPO, copy_workflow, snakemake
from dflash.spec.sweeps import load_sweep


def _job_stats(out: str) -> dict[str, int]:
    rows = out.split("Job stats:\n", 1)[1].split("\ntotal", 1)[0].splitlines()[2:]
    return {r.split()[0]: int(r.split()[1]) for r in rows if len(r.split()) == 2}


def _stage_seconds(wf: Path) -> dict[str, float]:
    out = {}
    for tsv in sorted((wf / "benchmarks").rglob("*.tsv")):
        key = str(tsv.relative_to(wf / "benchmarks"))
        if tsv.parent.name != ".shared" and tsv.stat().st_nlink > 1:
            continue  # a spec's link to a shared stage's benchmark: counted once, under .shared
        out[key] = float(tsv.read_text().splitlines()[1].split("\t")[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", default="sweeps/tiny-lr.yaml")
    ap.add_argument("--out", default="bench/results/cpu/sweep_tiny_lr.json")
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args()
    sweep = load_sweep(REPO / a.sweep)
    with tempfile.TemporaryDirectory(prefix="dflash-sweep-") as tmp:
        wf = copy_workflow(Path(tmp), [sweep.base])
        (wf / "sweeps").mkdir()
        (wf / "sweeps" / sweep.path.name).write_text(sweep.path.read_text())
        t0 = time.time()
        r = snakemake(wf, f"bench_{sweep.name}", timeout=a.timeout)
        wall = time.time() - t0
        out = r.stdout + r.stderr
        if r.returncode != 0:
            print(out[-4000:])
            return 1
        report = json.loads((wf / "results" / f"{sweep.name}.sweep" / "report.json").read_text())
        result = {
            "command": f"python -m bench.sweep_cpu --sweep {a.sweep} --out {a.out}",
            "snakemake": f"snakemake --cores 2 bench_{sweep.name}",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
            "wall_s": round(wall, 1), "jobs": _job_stats(out),
            "stage_seconds": _stage_seconds(wf), "report": report,
        }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_s", "jobs", "stage_seconds")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
