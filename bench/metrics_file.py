"""A train stage's ``metrics.jsonl`` as committed: plain or gzipped (the rounds gzip theirs, so
that the repo every device call carries leaves room for the wheels), one reader for every
script that reads one.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from dflash.errors import DFlashError


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
