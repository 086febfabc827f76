"""bench/frontier.py: τ against GPU-minutes (data and train apart), the frontier, the block in
docs/benchmarks.md, from the committed H200 files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import frontier as fr

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def test_committed_block_and_json_are_current():
    assert fr.main(["--check", str(DOC)]) == 0


def test_a_hand_edited_json_is_stale(tmp_path):
    js = json.loads(fr.OUT_JSON.read_text())
    js["points"][0]["tau"]["mtbench"] += 0.01
    bad = tmp_path / "frontier.json"
    bad.write_text(json.dumps(js, indent=1) + "\n")
    assert fr.main(["--json", str(bad), "--check", str(DOC)]) == 1


def test_points_carry_the_committed_figures():
    pts = {p["label"]: p for p in fr.collect()["points"]}
    r6 = pts["3 epochs, feature cache (round 6)"]
    # bench.log: "τ mtbench: 2.044 over 80 prompts"; data manifest 130.16 s; 206.39 s of steps
    assert r6["tau"] == {"mtbench": 2.044, "humaneval": 1.98, "heldout": 2.432}
    assert r6["gpu_minutes"] == {"data": 2.169, "train": 3.44, "total": 5.609}
    assert r6["gain_per_gpu_minute"] == pytest.approx(1.044 / 5.609, abs=1e-4)
    ref = pts["smollm2-recipe-1ep/ref"]  # the shared data stage counted whole for each arm
    assert ref["gpu_minutes"]["data"] == pts["smollm2-recipe-1ep/kd"]["gpu_minutes"]["data"]
    assert pts["3 epochs (run 1)"]["gpu_minutes"]["total"] is None  # no data manifest


def test_the_frontier_rule():
    def p(label, minutes, mt):
        return fr.point(label, "x", {"mtbench": mt}, minutes, 0.0)
    pts = [p("cheap", 1, 1.5), p("dominated", 2, 1.4), p("better", 3, 1.9), p("tie", 3, 1.8),
           p("flat", 5, 1.9), fr.point("unknown", "x", {"mtbench": 3.0}, 1, None)]
    assert fr.frontier(pts) == ["cheap", "better"]
    assert p("free", 0, 1.5)["gain_per_gpu_minute"] is None
    assert p("x", 2, 1.5)["gain_per_gpu_minute"] == 0.25
