"""What the light paths cost to start: `import dflash.cli`, the Snakefile's parse (`snakemake -n`
on the default spec) and `dflash validate specs/tiny.yaml --no-devices`, median wall seconds of
``--runs`` runs each, for this checkout and (``--base DIR``) another checkout of the repository
run with the same interpreter (its package first on PYTHONPATH), interleaved so both see the same
machine load.

    .venv/bin/python -m bench.import_cost --base /tmp/base --out bench/results/cpu/import_cost.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = Path(sys.executable)
COMMANDS = {
    "import_dflash_cli": [str(PY), "-c", "import dflash.cli"],
    "snakemake_dry_run": [str(PY.with_name("snakemake")), "-n", "--cores", "1"],
    "dflash_validate": [str(PY), "-m", "dflash", "validate", "specs/tiny.yaml", "--no-devices"],
}


def _time(cmd: list[str], root: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    t = time.perf_counter()
    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="another checkout to compare with")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    roots = {"this": REPO} | ({"base": a.base.resolve()} if a.base else {})
    res: dict = {"command": " ".join(sys.argv), "runs": a.runs, "seconds_median": {}}
    for name, cmd in COMMANDS.items():
        for root in roots.values():
            _time(cmd, root)  # warm the file cache
        times = {k: [] for k in roots}
        for _ in range(a.runs):
            for k, root in roots.items():
                times[k].append(_time(cmd, root))
        res["seconds_median"][name] = {k: round(statistics.median(v), 3) for k, v in times.items()}
        print(name, res["seconds_median"][name], flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
