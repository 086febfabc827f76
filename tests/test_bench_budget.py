"""The bench report's GPU-minutes by stage beside τ (issue #35): data, train and the bench stage
itself, and (τ − 1) per data + train GPU-minute, in report.json and report.md's summary."""
from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from dflash.eval.report import ci, fmt
from dflash.artifacts.manifest import write_manifest
from dflash.spec.load import load_spec
from dflash.stages import StageContext
from dflash.stages.bench import gpu_minutes

REPO = Path(__file__).resolve().parents[1]


def test_gpu_minutes_by_stage(tmp_path):
    ctx = StageContext(spec=load_spec(REPO / "specs" / "tiny.yaml"), results=tmp_path)
    tau = {"tau": 2.2, "primary_set": "humaneval"}
    # no data manifest (a stage run by hand on copied files): data unknown, the rest counted
    assert gpu_minutes(ctx, {"wall_s": 600.0}, 1, 30.0, tau) == {
        "data": None, "train": 10.0, "bench": 0.5, "gain_per_gpu_minute": 0.12,
        "gain_set": "humaneval"}
    (tmp_path / "data").mkdir()
    write_manifest(tmp_path / "data" / "manifest.json", "data", {}, seconds=120.0)
    got = gpu_minutes(ctx, {"wall_s": 600.0}, 2, 30.0, tau)
    # train on both GPUs the spec holds; data and bench on the one target GPU
    assert (got["data"], got["train"], got["bench"]) == (2.0, 20.0, 0.5)
    assert got["gain_per_gpu_minute"] == round(1.2 / 22.0, 4)
    cpu = gpu_minutes(ctx, {"wall_s": 600.0}, 0, 30.0, tau)
    assert (cpu["data"], cpu["train"], cpu["bench"], cpu["gain_per_gpu_minute"]) == (0, 0, 0,
                                                                                     None)
    env = Environment(loader=FileSystemLoader(REPO / "dflash" / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    src = env.loader.get_source(env, "report.md.j2")[0]
    row = next(line for line in src.splitlines() if "GPU-minutes: data / train" in line)
    gain = next(line for line in src.splitlines() if "per data + train GPU-minute" in line)
    md = env.from_string(row + "\n" + gain).render(r={"gpu_minutes": got}, fmt=fmt, ci=ci)
    assert "| GPU-minutes: data / train / bench stage | 2 / 20 / 0.5 |" in md
    assert f"| (τ humaneval − 1) per data + train GPU-minute | {fmt(1.2 / 22.0)} |" in md
