"""bench.steps_from_log: ms a step from a train log's progress lines (window means)."""
from __future__ import annotations

import json

import pytest

from bench.steps_from_log import main, progress, window

LOG = """[train] step 100/900 · 10s elapsed, ETA 1m · 1 tok/s
noise
[train] step 100/900 · 10s elapsed, ETA 1m · 1 tok/s
[train] step 300/900 · 1m10s elapsed, ETA 1m · 1 tok/s
[train] step 800/900 · 1h0m0s elapsed, ETA 1s · 1 tok/s
"""


def test_progress_lines_and_window_means(tmp_path):
    pts = progress(LOG)
    assert pts == [(100, 10), (300, 70), (800, 3600)]   # the repeated line once
    assert window(pts, 0, 300)["ms_per_step"] == 300.0  # 60 s over 200 steps
    with pytest.raises(SystemExit, match="steps 301:700: fewer than two"):
        window(pts, 301, 700)
    log = tmp_path / "t.log"
    log.write_text(LOG)
    assert main([str(log), "--range", "0:900", "--out", str(tmp_path / "o.json")]) == 0
    w = json.loads((tmp_path / "o.json").read_text())["windows"][0]
    assert (w["steps"], w["ms_per_step"]) == (700, round(1000 * 3590 / 700, 2))
