"""bench/frontier.py: τ against GPU-minutes (data and train apart), the frontier, the block in
docs/benchmarks.md, from the committed GPU files."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import ablation_files
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
    assert r6["gpu_minutes"] == {"data": 2.169, "train": 3.44, "total": 5.609, "data_beside": 0}
    assert r6["gain_per_gpu_minute"] == pytest.approx(1.044 / 5.609, abs=1e-4)
    ref = pts["smollm2-recipe-1ep/ref"]  # the shared data stage counted whole for each arm
    assert ref["gpu_minutes"]["data"] == pts["smollm2-recipe-1ep/kd"]["gpu_minutes"]["data"]
    assert pts["3 epochs (run 1)"]["gpu_minutes"]["total"] is None  # no data manifest
    # round 14 ran two data stages at once: its arms' data minutes are flagged in the table
    assert pts["smollm2-recipe/prompts15x"]["gpu_minutes"]["data_beside"] == 1
    assert "| 5.14* |" in fr.render({"points": [pts["smollm2-recipe/prompts15x"]], "frontier": [],
                                     "figure_of_merit": "", "gpu_minutes": ""})


def test_the_frontier_rule():
    def p(label, minutes, mt):
        return fr.point(label, "x", {"mtbench": mt}, minutes, 0.0)
    pts = [p("cheap", 1, 1.5), p("dominated", 2, 1.4), p("better", 3, 1.9), p("tie", 3, 1.8),
           p("flat", 5, 1.9), fr.point("unknown", "x", {"mtbench": 3.0}, 1, None)]
    assert fr.frontier(pts) == ["cheap", "better"]
    assert p("free", 0, 1.5)["gain_per_gpu_minute"] is None
    assert p("x", 2, 1.5)["gain_per_gpu_minute"] == 0.25


def test_a_committed_spec_run_is_a_point(tmp_path, monkeypatch):
    """A spec's DAG run committed as <spec>__bench__report.json + its train metrics and data
    manifest (the code drafter's, once run) becomes a point; a report without τ (a random
    target's) and a sweep arm's (ablation.json has those) do not."""
    h200 = tmp_path / "bench" / "results" / "h200"
    run = h200 / "round7" / "smollm2-code"
    run.parent.mkdir(parents=True)
    sets = {"humaneval": {"tau": 2.5}, "mtbench": {"tau": 2.0, "tau_by_category": {}}}
    (run.parent / "smollm2-code__bench__report.json").write_text(json.dumps(
        {"spec": "smollm2-code", "acceptance": {"sets": sets}}))
    (run.parent / "smollm2-code__train__metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "t": 60.0 * i, "tokens": 10}) + "\n" for i in range(4)))
    (run.parent / "smollm2-code__data__manifest.json").write_text(json.dumps({"seconds": 90.0}))
    for spec, rep in (("qwen3-8b-2gpu", {"acceptance": {"skipped": "random"}}),
                      ("smollm2-recipe-1ep-ref", {"acceptance": {"sets": sets}})):
        (run.parent / f"{spec}__bench__report.json").write_text(json.dumps({"spec": spec, **rep}))
    # another GPU's round (round 22's H100) comes after every H200 round, under its GPU's name
    h100_run = tmp_path / "bench" / "results" / "h100" / "round2" / "lease"
    h100_run.mkdir(parents=True)
    for f in run.parent.glob("smollm2-code__*"):
        (h100_run / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(ablation_files, "GPUS", (h200, h100_run.parents[1]))
    monkeypatch.setattr(ablation_files, "REPO", tmp_path)
    p, h100 = fr.from_reports({"smollm2-code", "qwen3-8b-2gpu", "smollm2-quality"})
    assert p["label"] == "smollm2-code (round7)"
    assert h100["label"] == "smollm2-code (h100/round2)"
    assert h100["source"] == "bench/results/h100/round2/lease/smollm2-code__bench__report.json"
    assert p["tau"] == {"mtbench": 2.0, "humaneval": 2.5, "heldout": None}
    assert p["gpu_minutes"] == {"data": 1.5, "train": 3.0, "total": 4.5, "data_beside": 0}
    assert p["gain_per_gpu_minute"] == round(1.0 / 4.5, 4)


def test_report_points_come_in_their_rounds_order():
    """The docs cite points by index (frontier.json#points.N): reports sort by round number
    (round7 before round21), the H200's rounds first, then another GPU's (round 27's H100), so
    a new round's point comes after every committed one of its GPU."""
    rounds = [("/round" in p["label"], int(re.search(r"round(\d+)", p["label"])[1]))
              for p in fr.collect()["points"] if p["source"].endswith("__bench__report.json")]
    assert rounds == sorted(rounds) and {7, 8, 21} <= {r for other, r in rounds if not other}
    assert (True, 27) in rounds
