"""τ against GPU-minutes, the figure of merit of issue #35: every committed GPU arm and DAG run
with its τ (MT-Bench 80 first turns, HumanEval 164, held-out) beside its GPU-minutes, data and
train counted apart, the frontier (the runs no other run beats at fewer minutes) and the plot:

    python -m bench.frontier                              # print the table
    python -m bench.frontier --write docs/benchmarks.md   # + frontier.json and frontier.png
    python -m bench.frontier --check docs/benchmarks.md   # exit 1 if the md or the JSON is stale

Points: the #26 recipe arms and the full-budget runs of ``ablation.json`` (bench/ablation_table.py
made it from the arms' own files: its GPU-minutes are the training steps' seconds × the arm's
share of the GPU), and the DAG runs of :data:`DAGS` whose report.json the device call cut (τ from
their bench.log's console lines, ``bench.figures_from_log``; train seconds from their
metrics.jsonl), and every other spec's DAG run committed as ``<spec>__bench__report.json`` with
its ``<spec>__train__metrics.jsonl[.gz]`` and ``<spec>__data__manifest.json`` beside it
(:func:`from_reports`: e.g. specs/smollm2-code.yaml's, once run; a run alone on its GPU, share 1;
a report without τ, a random-weight target's, is no point). Data GPU-minutes: the data stage's
own seconds (its manifest; the whole stage even where arms shared it: what reproducing the arm
alone costs; marked ``*`` where another data stage ran on the GPU at the same time, whose
seconds overstate it); None where no file recorded them.

Figure of merit: ``gain_per_gpu_minute`` = (τ − 1) / (data + train GPU-minutes). τ − 1, not τ:
the target alone makes 1 token per verify step for free, so the drafter's work is what lies
above 1 (a raw τ per minute would rank a run of a few seconds first). The frontier is judged on
MT-Bench τ against the total, and among points whose total is known.
"""
from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

from bench import md_block
from bench.ablation_files import (H200, REPO, committed, metrics_of, read_json, rel, round_of,
                                  sibling, timeline)
from bench.metrics_file import read_metrics
from bench.entry import run
from bench.figures_from_log import figures
from dflash.errors import DFlashError
from dflash.eval.sweep_report import frontier as pareto

OUT_JSON = H200 / "frontier.json"
OUT_PNG = H200 / "frontier.png"
BEGIN, END = "<!-- ours:frontier:begin -->", "<!-- ours:frontier:end -->"
SETS = ("mtbench", "humaneval", "heldout")
# full-budget DAG runs not in ablation.json: label, the folder's stage files (stage -> file)
DAGS = ({"label": "3 epochs, feature cache (round 6)",
         "bench_log": "round6-2026-12-01/lease/logs/smollm2-quality/bench.log",
         "metrics": "round6-2026-12-01/lease/r/smollm2-quality__train__metrics.jsonl.gz",
         "data": "round6-2026-12-01/lease/r/smollm2-quality__data__manifest.json"},
        {"label": "code drafter, smollm2-code (round 9)",
         "bench_log": "round9-2026-12-02/lease/logs/smollm2-code/bench.log",
         "metrics": "round9-2026-12-02/lease/r/smollm2-code__train__metrics.jsonl.gz",
         "data": "round9-2026-12-02/lease/r/smollm2-code__data__manifest.json"},
        {"label": "positions 1..8 supervised, smollm2-recipe-cap8 (round 10)",
         "bench_log": "round10-2026-12-02/lease/logs/smollm2-recipe-cap8/bench.log",
         "metrics": "round10-2026-12-02/lease/r/smollm2-recipe-cap8__train__metrics.jsonl.gz",
         "data": "round10-2026-12-02/lease/r/smollm2-quality__data__manifest.json"})
# the data manifests of ablation.json's full-budget runs (run 1 committed none: data n/a)
RUN_DATA = {"smollm2-quality-run2": "smollm2-quality-run2/data__manifest.json"}


def point(label: str, source: str, tau: dict, train_min: float, data_s: float | None,
          data_beside: int = 0) -> dict:
    """``data_beside``: other data stages that ran at the same time on the GPU (round 14's two):
    its seconds then overstate what the stage costs alone."""
    data_min = None if data_s is None else round(data_s / 60, 3)
    total = None if data_min is None else round(data_min + train_min, 3)
    mt = tau.get("mtbench")
    return {"label": label, "source": source,
            "tau": {s: tau.get(s) for s in SETS},
            "gpu_minutes": {"data": data_min, "train": round(train_min, 3), "total": total,
                            "data_beside": data_beside},
            "gain_per_gpu_minute": None if total is None or mt is None or total <= 0
            else round((mt - 1) / total, 4)}


def from_ablation(data: dict) -> list[dict]:
    """ablation.json's arms (their own data stage's seconds) and full-budget runs; not a ref that
    is the sweep's base spec's run (``ref_from``): :func:`from_reports` has it, once."""
    out = [point(f"{a['sweep']}/{a['arm']}", a["folder"], a["tau"], a["gpu_minutes"],
                 a.get("data_seconds"), a.get("data_beside", 0))
           for a in data["arms"] if not a.get("ref_from")]
    for r in data["runs"]:
        data_file = RUN_DATA.get(Path(r["folder"]).name)
        secs = read_json(H200 / data_file)["seconds"] if data_file else None
        out.append(point(r["arm"], r["folder"], r["tau"], r["gpu_minutes"], secs))
    return out


def from_dag(d: dict) -> dict:
    """A DAG run from its committed logs and manifests (no report.json: the call was cut)."""
    log = H200 / d["bench_log"]
    try:
        text = log.read_text()
    except OSError as e:
        raise DFlashError(f"{log}: not readable ({e})") from None
    tau = {s: v["tau_simulated"] for s, v in figures(text)["tau"].items()}
    if "mtbench" not in tau:
        raise DFlashError(f"{log}: no '[bench] τ mtbench: ...' line")
    steps_s = read_metrics(H200 / d["metrics"])[-1]["t"]
    return point(d["label"], str((H200 / d["bench_log"]).relative_to(REPO)), tau, steps_s / 60,
                 read_json(H200 / d["data"])["seconds"])


def from_reports(specs: set[str]) -> list[dict]:
    """Every committed ``<spec>__bench__report.json`` of a spec in ``specs`` (not a sweep's
    arm: those are ablation.json's) that measured τ, as a point."""
    out = []
    # rounds in their order (round7 before round21), so a new round's point comes last and the
    # docs' citations of the others (frontier.json#points.N) keep their N
    for rep_path in committed("*__bench__report.json", key=_natural):
        rep = read_json(rep_path)
        sets = (rep.get("acceptance") or {}).get("sets") or {}
        tau = {s: sets[s]["tau"] for s in SETS if (sets.get(s) or {}).get("tau") is not None}
        if rep.get("spec") not in specs or not tau:
            continue
        line = timeline(metrics_of(rep_path))
        data = read_json(sibling(rep_path, "data", "manifest.json"))
        out.append(point(f"{rep['spec']} ({round_of(rep_path)})", rel(rep_path), tau,
                         line[max(line)][0] / 60, data["seconds"]))
    return out


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def frontier(points: list[dict]) -> list[str]:
    """Labels of the points no other point beats on MT-Bench τ at most their total GPU-minutes
    (the sweep report's rule, :func:`dflash.eval.sweep_report.frontier`)."""
    return pareto([(p["label"], p["gpu_minutes"]["total"], p["tau"]["mtbench"])
                   for p in points])


def collect() -> dict:
    specs = {p.stem for p in (REPO / "specs").glob("*.yaml")}
    pts = (from_ablation(read_json(H200 / "ablation.json")) + [from_dag(d) for d in DAGS]
           + from_reports(specs))
    return {"command": "python -m bench.frontier --write docs/benchmarks.md",
            "figure_of_merit": "(τ MT-Bench − 1) / (data + train GPU-minutes)",
            "gpu_minutes": "train: training steps' seconds × the run's GPU share (ablation.json); "
                           "data: the data stage's seconds (whole stage, even when shared)",
            "points": pts, "frontier": frontier(pts)}


def _f(x, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def render(data: dict) -> str:
    lines = ["| run | τ MT-Bench | τ HumanEval | τ held-out | data GPU-min | train GPU-min | "
             "total GPU-min | (τ MT-Bench − 1) per GPU-min | on the frontier |",
             "|---" * 9 + "|"]
    for p in sorted(data["points"], key=lambda p: p["gpu_minutes"]["train"]):
        t, g = p["tau"], p["gpu_minutes"]
        lines.append(f"| {p['label']} | {_f(t['mtbench'])} | {_f(t['humaneval'])} | "
                     f"{_f(t['heldout'])} | {_f(g['data'], '.2f')}{'*' if g.get('data_beside') else ''} | "
                     f"{_f(g['train'], '.2f')} | "
                     f"{_f(g['total'], '.2f')} | {_f(p['gain_per_gpu_minute'], '.4f')} | "
                     f"{'yes' if p['label'] in data['frontier'] else ''} |")
    lines += ["", f"Figure of merit: {data['figure_of_merit']}. GPU-minutes: "
              f"{data['gpu_minutes']}. Frontier: the runs no run with at most their total "
              "GPU-minutes beats on MT-Bench τ. * the data stage ran beside another data stage "
              "on the same GPU (round 14): its seconds overstate what it costs alone."]
    return "\n".join(lines)


def plot(data: dict, png: Path) -> None:
    import matplotlib  # noqa: PLC0415 - the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    pts = [p for p in data["points"] if p["gpu_minutes"]["total"] is not None]
    for s, marker in zip(SETS, "o^s"):
        xs = [(p["gpu_minutes"]["total"], p["tau"][s]) for p in pts if p["tau"][s] is not None]
        ax.scatter(*zip(*xs), marker=marker, label=f"τ {s}")
    front = sorted((p for p in pts if p["label"] in data["frontier"]),
                   key=lambda p: p["gpu_minutes"]["total"])
    ax.plot([p["gpu_minutes"]["total"] for p in front], [p["tau"]["mtbench"] for p in front],
            "k--", label="frontier (MT-Bench)")
    for p in pts:
        ax.annotate(p["label"], (p["gpu_minutes"]["total"], p["tau"]["mtbench"]), fontsize=6,
                    xytext=(3, -9), textcoords="offset points")
    ax.set(xlabel="GPU-minutes, data + train (one H200; h100/: one H100)",
           ylabel="τ (simulated, greedy, block 16)", title="τ vs GPU-minutes (committed runs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


splice = partial(md_block.splice, begin=BEGIN, end=END)


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


main = md_block.main_of(__doc__.split("\n")[0], collect=collect, render=render, plot=plot,
                        dumps=dumps, json_path=OUT_JSON, png_path=OUT_PNG, begin=BEGIN, end=END)


if __name__ == "__main__":
    run(main)
