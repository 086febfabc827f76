"""The sweep report: one table and one plot over a sweep's arms, from their bench and train stages.

``dflash sweep-report sweeps/<name>.yaml --results results`` (Snakemake's ``sweep_report`` rule,
part of ``bench_<sweep>``) writes ``results/<name>.sweep/report.{json,md}`` and ``sweep.png``:
per arm what it overrides, τ per eval set (and MT-Bench's coding category), target tokens/s,
final loss, train minutes and GPU-minutes (train wall time × the GPUs its spec holds; the data
stage's seconds on its one target GPU apart), τ − 1 per GPU-minute and the frontier
(:func:`frontier`: the arms no cheaper arm beats on MT-Bench τ; bench/frontier.py uses the same
rule on the committed H200 runs), and how many distinct env, warm-up and data stages the arms
used (shared by content, dflash.artifacts.sharing: a γ sweep shows data 1).
It reads the arms' reports like the bench stage writes its own: JSON, a jinja2 template from
``dflash/templates``, matplotlib.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from ..errors import DFlashError
from .report import fmt
from ..artifacts.manifest import atomic_path, atomic_write_json, atomic_write_text, read_manifest
from ..spec.sweeps import Sweep, load_sweep, sweep_dir

TEMPLATE = "sweep.md.j2"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _checksum(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("checksum")
    except (OSError, ValueError):
        return None


def arm_row(arm, results: Path) -> dict:
    """One arm's figures from results/<arm>/{bench/report.json, train/manifest.json}."""
    res = results / arm.name
    rpath = res / "bench" / "report.json"
    try:
        rep = json.loads(rpath.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{rpath}: the bench report of arm {arm.arm!r} is missing or not JSON "
                          f"({e}); run snakemake bench_{arm.name}") from None
    train = read_manifest(res / "train" / "manifest.json", "train")
    data = read_manifest(res / "data" / "manifest.json", "data")
    sets = (rep.get("acceptance") or {}).get("sets") or {}
    gpus = (rep.get("hardware") or {}).get("gpu_count") or 0
    minutes = (train.get("wall_s") or 0.0) / 60
    # the data stage generates on the spec's first target device: one GPU (none on CPU), the
    # whole stage even where arms share it (what reproducing this arm alone costs)
    data_gpu_min = round((data.get("seconds") or 0.0) / 60 * min(gpus, 1), 3)
    total = round(minutes * gpus + data_gpu_min, 3)
    mt = sets.get("mtbench") or {}
    return {
        "arm": arm.arm, "spec": arm.name, "seed": arm.seed, "overrides": _flat(arm.overrides),
        "tau": {k: v.get("tau") for k, v in sets.items()},
        "tau_mtbench_coding": (mt.get("tau_by_category") or {}).get("coding"),
        "tokens_per_s": rep.get("tokens_per_s"), "final_loss": rep.get("final_loss"),
        "train_minutes": round(minutes, 3), "gpus": gpus, "gpu_minutes": round(minutes * gpus, 3),
        "data_gpu_minutes": data_gpu_min, "gpu_minutes_total": total,
        "gain_per_gpu_minute": round((mt["tau"] - 1) / total, 4)
        if mt.get("tau") is not None and total > 0 else None,
        "steps": (train.get("steps") or {}).get("run"),
        "upstream": {st: _checksum(res / st / "manifest.json")
                     for st in ("env", "warmup", "data")},
    }


def frontier(points: list[tuple[str, float | None, float | None]]) -> list[str]:
    """Names of the (name, GPU-minutes, τ) points no other beats: none costing at most as much
    has a higher τ (equal minutes: the higher τ first), in order of minutes; a point without
    minutes or τ is on no frontier."""
    known = sorted((p for p in points if p[1] is not None and p[2] is not None),
                   key=lambda p: (p[1], -p[2]))
    out, best = [], float("-inf")
    for name, _, tau in known:
        if tau > best:
            out.append(name)
            best = tau
    return out


def build(sweep: Sweep, results: Path) -> dict:
    rows = [arm_row(a, results) for a in sweep.arms]
    on = frontier([(r["arm"], r["gpu_minutes_total"] or None, r["tau"].get("mtbench"))
                   for r in rows])
    for r in rows:
        r["on_frontier"] = r["arm"] in on
    eval_sets = sorted({k for r in rows for k in r["tau"]})
    distinct = {st: len({r["upstream"][st] for r in rows}) for st in ("env", "warmup", "data")}
    for r in rows:
        del r["upstream"]  # checksums are bookkeeping; the counts say what was shared
    return {"sweep": sweep.name, "file": str(sweep.path), "base": str(sweep.base),
            "description": sweep.description, "arms": rows, "eval_sets": eval_sets,
            "stage_runs": distinct,
            "gpu_minutes_train_total": round(sum(r["gpu_minutes"] for r in rows), 3),
            "frontier": on}


def plot(report: dict, path: Path) -> None:
    """τ per eval set (grouped bars), final loss and tokens/s per arm; τ against GPU-minutes
    (data + train) with the MT-Bench frontier."""
    # matplotlib here only: it costs ~0.3 s and the backend is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sets = report["arms"], report["eval_sets"]
    names = [r["arm"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(max(12, 1.2 * len(rows) * 4), 3.6))
    ax = axes[0]
    width = 0.8 / max(1, len(sets))
    for i, s in enumerate(sets):
        ax.bar([x + i * width for x in range(len(rows))],
               [r["tau"].get(s) or 0 for r in rows], width, label=s)
    if sets:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no τ (bench.eval_prompts 0\nor a random target)", ha="center",
                va="center", transform=ax.transAxes, fontsize=8)
    ax.set_title("τ per eval set")
    for ax, key, title in ((axes[1], "final_loss", "final loss"),
                           (axes[2], "tokens_per_s", "target tokens / s")):
        ax.bar(range(len(rows)), [r[key] or 0 for r in rows])
        ax.set_title(title)
    for ax in axes[:3]:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    _frontier_panel(axes[3], report)
    fig.suptitle(f"sweep {report['sweep']}", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _frontier_panel(ax, report: dict) -> None:
    rows = [r for r in report["arms"] if r["gpu_minutes_total"]]
    for s in report["eval_sets"]:
        pts = [(r["gpu_minutes_total"], r["tau"][s]) for r in rows if r["tau"].get(s)]
        if pts:
            ax.scatter(*zip(*pts), s=14, label=s)
    front = [r for r in sorted(rows, key=lambda r: r["gpu_minutes_total"])
             if r["on_frontier"]]
    if front:
        ax.plot([r["gpu_minutes_total"] for r in front], [r["tau"]["mtbench"] for r in front],
                "k--", label="frontier (mtbench)")
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "no GPU-minutes (CPU) or no MT-Bench τ", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
    ax.set(title="τ vs GPU-minutes (data + train)", xlabel="GPU-minutes")


def render_md(report: dict) -> str:
    env = Environment(loader=FileSystemLoader(Path(__file__).parents[1] / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE).render(r=report, fmt=fmt)


def write(sweep_file: str | Path, results: str | Path = "results") -> dict:
    sweep = load_sweep(sweep_file)
    out = sweep_dir(results, sweep.name)
    report = build(sweep, Path(results))
    plot(report, out / "sweep.png")
    atomic_write_json(out / "report.json", report)
    md = render_md(report)
    atomic_write_text(out / "report.md", md)
    print(md, flush=True)
    return report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dflash sweep-report", description=__doc__.split("\n")[0])
    ap.add_argument("sweep", help="sweeps/<name>.yaml")
    ap.add_argument("--results", default="results", help="results root (default: results)")
    a = ap.parse_args(argv)
    write(a.sweep, a.results)
    return 0
