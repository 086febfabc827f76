"""bench.metrics_file: committed metrics read plain or gzipped, and slimmed of per-step sample
ids without changing anything a script reads."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.metrics_file import main, read_metrics, slim
from dflash.errors import DFlashError


def test_slim_drops_only_the_sample_ids_and_is_idempotent(tmp_path, capsys):
    rows = [{"step": i, "epoch": 0, "loss": 1.0 / (i + 3), "tokens": 8192, "samples": 2,
             "draft_acc": [0.5, None], "sample_ids": [2 * i, 2 * i + 1], "t": 0.1 * i}
            for i in range(50)]
    path = tmp_path / "x__train__metrics.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    before, after = slim(path)
    assert after < before
    got = read_metrics(path)
    assert got == [{k: v for k, v in r.items() if k != "sample_ids"} for r in rows]
    once = path.read_bytes()
    main(["--slim", str(path)])                        # again: the same bytes
    assert path.read_bytes() == once and "1 file(s)" in capsys.readouterr().out
    plain = tmp_path / "metrics.jsonl"
    plain.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DFlashError, match="not a gzipped metrics file"):
        slim(plain)
