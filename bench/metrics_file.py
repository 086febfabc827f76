"""A train stage's ``metrics.jsonl`` as committed: plain or gzipped (the rounds gzip theirs, so
that the repo every device call carries leaves room for the wheels), one reader for every
script that reads one.

Committed gzipped metrics also drop each step's ``sample_ids`` (:func:`slim`,
``python -m bench.metrics_file --slim FILE...``). The ids were three fifths of the gzipped bytes,
and no script reads them back. The run checked every epoch's samples exactly once on the device,
and the train manifest records that check (``exactly_once``). The history keeps the files whole
(the tree had 37 MB of metrics and a 51.6 MB repo at 2026-12-06, when pulp's 16.4 MB wheel no
longer fit a call beside it: bench/gpu/pack_wheels.sh).
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from bench.entry import run
from dflash.artifacts.manifest import atomic_write_bytes
from dflash.errors import DFlashError

DROPPED = ("sample_ids",)


def metrics_file(path: Path) -> Path:
    """``path``, or its gzipped copy ``<path>.gz`` where only that one is committed."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return gz if not path.is_file() and path.suffix != ".gz" and gz.is_file() else path


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl or .jsonl.gz (:func:`metrics_file`): one dict per logged step."""
    path = metrics_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise DFlashError(f"{path}: not a metrics.jsonl ({type(e).__name__}: {e})") from None


def slim(path: Path) -> tuple[int, int]:
    """Rewrite a committed ``metrics.jsonl.gz`` without the fields in DROPPED (level 9, no
    timestamp, so the same rows give the same bytes; atomically). Returns its bytes before and
    after; a file already slim comes out byte-identical."""
    path = Path(path)
    if path.suffix != ".gz":
        raise DFlashError(f"{path}: not a gzipped metrics file (the tree commits them gzipped)")
    rows = read_metrics(path)
    text = "".join(json.dumps({k: v for k, v in r.items() if k not in DROPPED}) + "\n"
                   for r in rows)
    before = path.stat().st_size
    atomic_write_bytes(path, gzip.compress(text.encode(), compresslevel=9, mtime=0))
    return before, path.stat().st_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="committed metrics.jsonl.gz without per-step sample ids")
    ap.add_argument("--slim", nargs="+", type=Path, required=True, metavar="FILE")
    a = ap.parse_args(argv)
    total = [0, 0]
    for path in a.slim:
        before, after = slim(path)
        total = [total[0] + before, total[1] + after]
        print(f"{path}: {before:,} -> {after:,} B")
    print(f"{len(a.slim)} file(s): {total[0]:,} -> {total[1]:,} B")


if __name__ == "__main__":
    run(main)
