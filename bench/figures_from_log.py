"""The bench and train stages' headline console lines of a DAG log as JSON, for a run whose
report.json was never written (a device call cut the bench stage after its τ evaluation).

    python -m bench.figures_from_log bench/results/h200/smollm2-quality-run2/snakemake_call3.log \
        --out bench/results/h200/smollm2-quality-run2/figures.json
    python -m bench.figures_from_log bench/results/h200/round16-2026-12-04/lease/dag_quality.log \
        --decode --out bench/results/h200/round16-2026-12-04/quality_dag_figures.json

Several logs are one DAG run in consecutive Snakemake invocations (a plan's data and warm-up
first, then the arm's targets: round 26), read in the order given: the wall clock spans them
all, and ``--stages`` gives each stage job's own seconds (env, warmup, data, decoders, train,
bench) from Snakemake's stamps around its start and its ``Finished jobid`` line.
"""
from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path

from bench.entry import command_line, run, write_result
from dflash.errors import DFlashError

TAU = re.compile(r"^\[bench\] τ (\w+): ([\d.]+) over (\d+) prompts \(simulated in [\d.]+s"
                 r"(?:; real on (\d+): τ ([\d.]+), speed-up ([\d.]+), lossless (\w+))?")
DECODE = re.compile(r"^\[bench\] batch (\d+): target-only ([\d.]+) tok/s, speculative ([\d.]+) tok/s "
                    r"\(τ ([\d.]+), speed-up ([\d.]+)\), choice (.+?) served ([\d.]+) tok/s "
                    r"\(([\d.]+)x measured\)(?:, HF static ([\d.]+) tok/s)?, lossless (\w+)")
CLOCK = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")  # Snakemake's job stamps
START = re.compile(r"^(?:local)?rule ([\w-]+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: ([\w-]+)\)$")
STAGES = ("env", "warmup", "data", "decoders", "train", "bench")  # not link_stage, not targets
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


def decode_and_clock(text: str) -> dict:
    """The bench stage's decoding-sweep rows (a sweep that failed part way keeps the batch sizes
    it finished: round 16's batch 16) and the DAG's wall clock from Snakemake's first to its last
    job stamp (``--decode``: a whole-DAG log whose report lost its sweep)."""
    rows, stamps = {}, []
    for line in text.splitlines():
        if m := DECODE.match(line):
            rows[int(m[1])] = {"batch": int(m[1]), "target_only_tokens_per_s": float(m[2]),
                               "speculative_tokens_per_s": float(m[3]), "tau": float(m[4]),
                               "speedup": float(m[5]), "choice": m[6],
                               "served_tokens_per_s": float(m[7]), "served_speedup": float(m[8]),
                               "hf_static_tokens_per_s": float(m[9]) if m[9] else None,
                               "lossless": m[10] == "True"}
        elif m := CLOCK.match(line):
            stamps.append(datetime.strptime(m[1], "%a %b %d %H:%M:%S %Y"))
    clock = ({"first": stamps[0].isoformat(), "last": stamps[-1].isoformat(),
              "span_s": (stamps[-1] - stamps[0]).total_seconds()} if stamps else None)
    return {"decode": list(rows.values()), "dag_clock": clock}


def stage_spans(text: str) -> list[dict]:
    """Each stage job of one Snakemake invocation's log, in the order they finished: its rule,
    the stamps before its start and its end, and the seconds between (a job of a cut run, never
    finished, is left out)."""
    out, started, pending, last = [], {}, None, None
    for line in text.splitlines():
        if m := CLOCK.match(line):
            last = datetime.strptime(m[1], "%a %b %d %H:%M:%S %Y")
        elif m := START.match(line):
            pending = (m[1], last)
        elif pending and (m := JOBID.match(line)):
            started[m[1]], pending = pending, None
        elif m := FINISHED.match(line):
            rule, t0 = started.pop(m[1], (m[2], None))
            if rule in STAGES and t0 and last:
                out.append({"rule": rule, "start": t0.isoformat(), "end": last.isoformat(),
                            "seconds": (last - t0).total_seconds()})
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", type=Path, nargs="+",
                    help="one DAG run's logs, in the order its Snakemake invocations ran")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--decode", action="store_true",
                    help="also the decoding sweep's rows and the DAG's wall clock")
    ap.add_argument("--stages", action="store_true", help="also each stage job's seconds")
    a = ap.parse_args(argv)
    try:
        texts = [p.read_text() for p in a.logs]
    except OSError as e:
        raise DFlashError(f"{e.filename}: not readable ({e.strerror})") from None
    text = "\n".join(texts)
    source = str(a.logs[0]) if len(a.logs) == 1 else [str(p) for p in a.logs]
    res = {"command": command_line("bench.figures_from_log", argv), "source": source,
           **figures(text), **(decode_and_clock(text) if a.decode else {}),
           **({"stages": [s for t in texts for s in stage_spans(t)]} if a.stages else {})}
    write_result(a.out, res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    run(main)
