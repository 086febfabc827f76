"""The bench and train stages' headline console lines of a DAG log as JSON, for a run whose
report.json was never written (a device call cut the bench stage after its τ evaluation).

    python -m bench.figures_from_log bench/results/h200/smollm2-quality-run2/snakemake_call3.log \
        --out bench/results/h200/smollm2-quality-run2/figures.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from dflash.errors import DFlashError

TAU = re.compile(r"^\[bench\] τ (\w+): ([\d.]+) over (\d+) prompts \(simulated in [\d.]+s"
                 r"(?:; real on (\d+): τ ([\d.]+), speed-up ([\d.]+), lossless (\w+))?")
DONE = re.compile(r"^\[train\] done: (\d+) steps in ([\d.]+)s, final loss ([\d.]+), recompiles "
                  r"after warmup (\d+), race errors (\d+)")


def figures(text: str) -> dict:
    out: dict = {"tau": {}}
    for line in text.splitlines():
        if m := TAU.match(line):
            s = {"tau_simulated": float(m[2]), "prompts": int(m[3])}
            if m[4]:
                s["real"] = {"prompts": int(m[4]), "tau": float(m[5]),
                             "speedup_over_target_only": float(m[6]), "lossless": m[7] == "True"}
            out["tau"][m[1]] = s  # a repeated line (Snakemake echoes the log) says the same
        elif m := DONE.match(line):
            out["train_done"] = {"steps": int(m[1]), "seconds": float(m[2]),
                                 "final_loss": float(m[3]), "recompiles_after_warmup": int(m[4]),
                                 "race_errors": int(m[5])}
    return out


CUT = "__bench__figures.json"  # <spec>__bench__figures.json: a cut bench stage's figures


def as_report(path: Path) -> dict:
    """A cut bench stage's ``<spec>__bench__figures.json`` in report.json's shape, for the
    ablation table (round 16's epochs6 arm: the call's limit cut its bench after two sets): the
    spec from the file's name, τ of each set that ran, nothing of what came after the cut."""
    try:
        sets = {s: {"tau": float(v["tau_simulated"]), "prompts": int(v["prompts"])}
                for s, v in json.loads(Path(path).read_text())["tau"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DFlashError(f"{path}: not a bench.figures_from_log file ({type(e).__name__}: "
                          f"{e})") from None
    return {"spec": Path(path).name.removesuffix(CUT), "cut": True,
            "acceptance": {"sets": sets}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    res = {"source": str(a.log), **figures(a.log.read_text())}
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
