"""Milliseconds a train step from the `[train] step N/T · Xs elapsed` progress lines of a log,
for a run whose metrics.jsonl did not come back (round 13: the machine was lost while the arm's
train folder was set aside). The progress line is printed every ~5 s, so the figures are
window means: ``--from`` / ``--to`` pick the first and last line inside a step range (an epoch:
steps_per_epoch from the train manifest or the metrics' ``epoch`` field).

    python -m bench.steps_from_log LOG --range 155:1285 --range 1285:3921 --out F.json
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from bench.entry import run, write_result

LINE = re.compile(r"\[train\] step (\d+)/(\d+) · (?:(\d+)h)?(?:(\d+)m)?(\d+)s elapsed")


def progress(text: str) -> list[tuple[int, int]]:
    """(step, seconds elapsed) of every progress line, in order, repeats dropped."""
    out: list[tuple[int, int]] = []
    for m in LINE.finditer(text):
        step = int(m.group(1))
        secs = int(m.group(3) or 0) * 3600 + int(m.group(4) or 0) * 60 + int(m.group(5))
        if not out or step > out[-1][0]:
            out.append((step, secs))
    return out


def window(points: list[tuple[int, int]], lo: int, hi: int) -> dict:
    """ms a step between the first and the last progress line with lo <= step <= hi."""
    inside = [p for p in points if lo <= p[0] <= hi]
    if len(inside) < 2:
        raise SystemExit(f"steps {lo}:{hi}: fewer than two progress lines inside")
    (s0, t0), (s1, t1) = inside[0], inside[-1]
    return {"range": [lo, hi], "first_line": [s0, t0], "last_line": [s1, t1],
            "steps": s1 - s0, "ms_per_step": round(1000 * (t1 - t0) / (s1 - s0), 2),
            "note": "seconds are whole (the log's resolution): ±1 s over the window"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--range", action="append", required=True, help="LO:HI steps")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    points = progress(a.log.read_text())
    res = {"log": str(a.log), "lines": len(points),
           "windows": [window(points, *map(int, r.split(":"))) for r in a.range]}
    write_result(a.out, res)
    for w in res["windows"]:
        print(f"steps {w['first_line'][0]}..{w['last_line'][0]}: {w['ms_per_step']} ms a step")
    return 0


if __name__ == "__main__":
    run(main)
