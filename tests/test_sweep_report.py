"""dflash sweep-report on hand-made arm results (fast; the DAG's own run is tests/test_sweep_dag.py):
data and train GPU-minutes apart, τ − 1 per GPU-minute, MT-Bench coding, the frontier."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from dflash.eval.sweep_report import frontier, write
from dflash.artifacts.manifest import write_manifest

REPO = Path(__file__).resolve().parents[1]
# arm -> (train wall s, data s, τ mtbench, τ coding, τ humaneval)
ARMS = {"ref": (120.0, 60.0, 1.6, 1.9, 1.5), "cheap": (60.0, 60.0, 1.5, 1.7, 1.4),
        "slow": (600.0, 60.0, 1.55, 1.8, 1.45)}


def _arm(res: Path, spec: str, wall: float, data_s: float, mt: float, cod: float, he: float):
    for st in ("bench", "train", "data"):
        (res / spec / st).mkdir(parents=True)
    write_manifest(res / spec / "train" / "manifest.json", "train", {}, wall_s=wall,
                   steps={"run": 10})
    write_manifest(res / spec / "data" / "manifest.json", "data", {}, seconds=data_s)
    sets = {"mtbench": {"tau": mt, "tau_by_category": {"coding": cod, "writing": 1.2}},
            "humaneval": {"tau": he}}
    (res / spec / "bench" / "report.json").write_text(json.dumps(
        {"acceptance": {"sets": sets}, "hardware": {"gpu_count": 1}, "tokens_per_s": 1e5,
         "final_loss": 2.0}))


def test_rows_frontier_and_markdown(tmp_path):
    (tmp_path / "specs").mkdir()
    shutil.copy(REPO / "specs" / "tiny.yaml", tmp_path / "specs" / "tiny.yaml")
    sw = tmp_path / "sweeps" / "tl.yaml"
    sw.parent.mkdir()
    sw.write_text(yaml.safe_dump({"base": "tiny", "arms": {
        "ref": {}, "cheap": {"optim": {"lr": 1e-3}}, "slow": {"optim": {"lr": 2e-3}}}}))
    for arm, figs in ARMS.items():
        _arm(tmp_path / "results", f"tl-{arm}", *figs)
    rep = write(sw, tmp_path / "results")
    rows = {r["arm"]: r for r in rep["arms"]}
    ref = rows["ref"]
    assert (ref["gpu_minutes"], ref["data_gpu_minutes"], ref["gpu_minutes_total"]) == (2.0, 1.0,
                                                                                       3.0)
    assert ref["gain_per_gpu_minute"] == 0.2 and ref["tau_mtbench_coding"] == 1.9
    # cheap (2 min, 1.5) and ref (3 min, 1.6) are on it; slow (11 min, 1.55) is beaten by ref
    assert rep["frontier"] == ["cheap", "ref"] and not rows["slow"]["on_frontier"]
    md = (tmp_path / "results" / "tl.sweep" / "report.md").read_text()
    assert "| ref | (base) | 0 | 1.5 | 1.6 | 1.9 | 100,000 | 2 | 2 | 2 | 1 | 0.2 | yes |" in md
    assert "| slow |" in md and md.split("| slow |")[1].splitlines()[0].endswith(" |  |")
    assert (tmp_path / "results" / "tl.sweep" / "sweep.png").stat().st_size > 1000


def test_frontier_ignores_points_without_minutes_or_tau():
    pts = [("a", 1.0, 1.5), ("b", 1.0, 1.6), ("c", None, 9.0), ("d", 2.0, None), ("e", 3.0, 1.7)]
    assert frontier(pts) == ["b", "e"]
