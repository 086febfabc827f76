"""The recipe ablations of issue #26 as one table, one verdict per arm and one τ-vs-GPU-minutes
curve, rendered from the committed GPU files (never copied by hand):

    python -m bench.ablation_table                              # print the table + verdicts
    python -m bench.ablation_table --write docs/benchmarks.md   # + ablation.json, the plot
    python -m bench.ablation_table --check docs/benchmarks.md   # exit 1 if md or JSON is stale

Arms: every ``<arm>__bench__report.json`` (a bench stage cut after its first τ sets:
``<arm>__bench__figures.json``, bench/figures_from_log.py) under bench/results/h200/ (then
another GPU's folder: bench/ablation_files.py's ``GPUS``) whose
``spec`` is ``<sweep>-<arm>`` of a sweep in sweeps/ (bench/gpu/session.sh's naming), with the
``<arm>__train__manifest.json``, ``__train__metrics.jsonl[.gz]`` and ``__data__manifest.json``
beside it; Δ is against the ``ref`` arm of the SAME folder (the same lease and code), or the one
a folder's ``ref.json`` lends from another (bench/ablation_ref.py says when it may). Runs:
the full-budget runs of :data:`RUNS`. The curve: ``tau_curve.json``'s series and every arm's
τ-while-training points, against GPU-minutes.

GPU-minutes of training: the seconds of the run's training steps (``t`` of its last logged step,
metrics.jsonl) × its share of the GPU. A run alone has share 1; arms trained at once on one GPU
(``--config gpu_jobs=N``) split each second evenly between the train stages running at that
moment (each stage's span: its train manifest's ``created_unix - wall_s`` to ``created_unix``).
The data stage's seconds are listed apart (``shared by`` = arms reading that one stage).

The verdict (:func:`verdict`): an arm **wins** when its MT-Bench τ is at least
:data:`WIN_MTBENCH` above its ref's AND its HumanEval τ is not below its ref's; it **loses** when
MT-Bench is :data:`WIN_MTBENCH` or more below; anything between is **no change**. The threshold
is ~2-3× the run-to-run spread of the committed 3-epoch runs 1 and 2 (one spec, two code versions:
0.015 MT-Bench, 0.032 HumanEval). A winner's fields (the sweep arm's overrides) are printed as
what to apply; this script changes no default. The verdict is taken again at ref's GPU-minutes
(:func:`at_equal_gpu_minutes`: Δ less what ref gains per doubling of GPU-minutes,
:func:`tau_per_doubling`, × log2 of the arm's cost over ref's); only an arm that wins there too
is printed as a change to apply: an arm that costs more must buy more than the extra minutes.
"""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

from bench import md_block
from bench.ablation_files import (H200, REPO, SETS, arms, base_as_ref, by_category, committed,
                                  committed_folders, has_train_files, metrics_of, overrides,
                                  read_json, rel, short, sibling, timeline, taus)
from bench.ablation_plot import plot
from bench.ablation_ref import lent_ref
from bench.entry import run
from bench.figures_from_log import CUT, as_report
from bench.metrics_file import read_metrics

OUT_JSON = H200 / "ablation.json"
OUT_PNG = H200 / "tau_vs_gpu_minutes.png"
BEGIN, END = "<!-- ours:ablation:begin -->", "<!-- ours:ablation:end -->"
MTBENCH_ORDER = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                 "humanities")  # question.jsonl's order
WIN_MTBENCH = 0.05
SLOPE_SWEEP = "smollm2-recipe-1ep"  # its ref arms (1 epoch) against RUNS (3) give the slope
CHECKPOINT_EVERY = 500  # checkpoint.every_steps of specs/smollm2-quality.yaml (run 2 resumed)
# the full-budget runs beside the arms: folder under H200, label, epochs (their README says 3)
RUNS = ({"folder": "smollm2-quality-run1", "label": "3 epochs (run 1)", "epochs": 3},
        {"folder": "smollm2-quality-run2", "label": "3 epochs (run 2)", "epochs": 3})


def gpu_shares(spans: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each span's share of the GPU: ∫ 1 / (spans open at t) dt over the span, / its length."""
    cuts = sorted({x for span in spans.values() for x in span})
    out = {}
    for arm, (a, b) in spans.items():
        got = 0.0
        for lo, hi in zip(cuts, cuts[1:]):
            if a <= lo and hi <= b:
                got += (hi - lo) / sum(s <= lo and hi <= e for s, e in spans.values())
        out[arm] = got / (b - a) if b > a else 1.0
    return out


def arm_rows(folder: Path, sweeps: list[str]) -> list[dict]:
    """One row per arm of one results folder (one lease), with its GPU share among them. A sweep
    with no ``ref`` arm there takes its base spec's run of the same folder as ``ref``
    (:func:`base_as_ref`)."""
    rows, spans = [], {}
    reports = {p: read_json(p) for p in sorted(folder.glob("*__bench__report.json"))
               if has_train_files(p)}
    reports |= {p: as_report(p) for p in sorted(folder.glob("*" + CUT)) if has_train_files(p)
                and not sibling(p, "bench", "report.json").is_file()}  # a cut bench stage
    for rep_path, rep in reports.items():
        spec = rep.get("spec", "")
        sweep = max((s for s in sweeps if spec.startswith(s + "-")), key=len, default=None)
        if sweep is not None:
            rows.append(_row(rep_path, rep, sweep, spec[len(sweep) + 1:], folder, spans))
    for sweep in sorted({r["sweep"] for r in rows} - {r["sweep"] for r in rows
                                                      if r["arm"] == "ref"}):
        base = base_as_ref(sweep)
        for rep_path, rep in reports.items():
            if base is not None and rep.get("spec") == base:
                rows.append(dict(_row(rep_path, rep, sweep, "ref", folder, spans),
                                 ref_from=base))
    order = {sw: list(arms(sw)) for sw in {r["sweep"] for r in rows}}
    rows.sort(key=lambda r: (r["sweep"], order[r["sweep"]].index(r["arm"])
                             if r["arm"] in order[r["sweep"]] else len(order[r["sweep"]])))
    shares = gpu_shares(spans)
    lent = None if any(r["arm"] == "ref" for r in rows) else lent_ref(folder, rows)
    spans_by_data = {o["data_checksum"]: o["data_span"] for o in rows}
    for r in rows:
        r["gpu_share"] = round(shares[r["arm"]], 4)
        r["gpu_minutes"] = round(r["train_step_seconds"] * r["gpu_share"] / 60, 3)
        r["data_shared_by"] = sum(o["data_checksum"] == r["data_checksum"] for o in rows)
        (a, b) = r["data_span"]
        r["data_beside"] = sum(lo < b and a < hi for k, (lo, hi) in spans_by_data.items()
                               if k != r["data_checksum"])  # other data stages at the same time
        for p in r["while_training"]:
            p["gpu_minutes"] = round(p.pop("t") * r["gpu_share"] / 60, 3)
    return rows + ([lent] if lent else [])


def _row(rep_path: Path, rep: dict, sweep: str, arm: str, folder: Path, spans: dict) -> dict:
    """One arm's row from its report and the stage files beside it (``spans`` gets its train
    stage's span, for the GPU shares)."""
    train = read_json(sibling(rep_path, "train", "manifest.json"))
    data = read_json(sibling(rep_path, "data", "manifest.json"))
    line = timeline(metrics_of(rep_path))
    last = line[max(line)]
    spans[arm] = (train["created_unix"] - train["wall_s"], train["created_unix"])
    acc = rep["acceptance"]
    return {
        "arm": arm, "sweep": sweep, "folder": rel(folder),
        "target_tokens": train.get("counters", {}).get("tokens", last[1]),
        "steps": len(line), "train_step_seconds": round(last[0], 2),
        "data_seconds": data["seconds"], "data_checksum": data["checksum"],
        "data_sha256": (data.get("dataset") or {}).get("sha256"),
        "report_train_minutes": (rep.get("gpu_minutes") or {}).get("train"),
        "data_span": [round(data["created_unix"] - data["seconds"], 1), data["created_unix"]],
        "tau": taus(acc["sets"]),
        "mtbench_by_category": by_category(acc["sets"], "mtbench"),
        "train_by_category": by_category(acc["sets"], "train"),
        "while_training": [{"step": p["step"], "t": line[p["step"]][0],
                            "target_tokens": line[p["step"]][1],
                            "tau_heldout": round(p["tau"], 4)}
                           for p in rep.get("tau_while_training", [])],
    }


def run_row(run: dict) -> dict:
    """A full-budget run alone on the GPU: τ from report.json or, where the call's limit cut the
    report, figures.json; training seconds from metrics.jsonl (+ the resumed call's seconds)."""
    folder = H200 / run["folder"]
    metrics = read_metrics(folder / "metrics.jsonl")
    if (folder / "report.json").is_file():
        rep = read_json(folder / "report.json")
        tau, seconds = taus(rep["acceptance"]["sets"]), metrics[-1]["t"]
        tokens = sum(m["tokens"] for m in metrics)
        cats = by_category(rep["acceptance"]["sets"], "mtbench")
    else:  # run 2: call 2 logged steps 0..k; call 3 resumed from the last checkpoint <= k
        fig = read_json(folder / "figures.json")
        tau = {s: fig["tau"].get(s, {}).get("tau_simulated") for s in SETS}
        resumed_from = metrics[-1]["step"] // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        seconds = metrics[resumed_from - 1]["t"] + fig["train_done"]["seconds"]
        # every sample once an epoch (the train stage's exactly-once check)
        tokens = read_json(folder / "data__manifest.json")["tokens"]["total_tokens"] * run[
            "epochs"]
        cats = {}
    return {"arm": run["label"], "folder": rel(folder), "target_tokens": tokens,
            "train_step_seconds": round(seconds, 2), "gpu_share": 1.0,
            "gpu_minutes": round(seconds / 60, 3), "tau": tau,
            "mtbench_by_category": cats}


def verdict(row: dict, ref: dict | None) -> tuple[dict, str]:
    """(Δ τ per set against ``ref``, the verdict): see the module docstring's rule."""
    if ref is None:
        return {}, "no ref arm in this folder"
    if row is ref:
        return {}, "reference"
    d = {s: round(row["tau"][s] - ref["tau"][s], 4)
         if row["tau"][s] is not None and ref["tau"][s] is not None else None for s in SETS}
    return d, rule(d)


def rule(d: dict) -> str:
    """The verdict of Δ τ per set ``d``."""
    if d["mtbench"] is None or d["humaneval"] is None:
        return "no MT-Bench or HumanEval τ"
    if d["mtbench"] >= WIN_MTBENCH and d["humaneval"] >= 0:
        return "wins"
    if d["mtbench"] <= -WIN_MTBENCH:
        return "loses"
    return "no change"


def tau_per_doubling(arms: list[dict], runs: list[dict]) -> dict | None:
    """τ per doubling of training GPU-minutes (MT-Bench, HumanEval), from the committed points
    alone: the full-budget runs' mean against the 1-epoch ref arms' mean (same recipe, 3× the
    tokens). An estimate across leases and code versions; None without both."""
    refs = [a for a in arms if a["arm"] == "ref" and a["sweep"] == SLOPE_SWEEP]
    if not refs or not runs:
        return None

    def mean(rows, key):
        vals = [r["tau"][key] if key in r["tau"] else r[key] for r in rows]
        return None if any(v is None for v in vals) else sum(vals) / len(vals)

    doublings = math.log2(mean(runs, "gpu_minutes") / mean(refs, "gpu_minutes"))
    if doublings <= 0:
        return None
    slope = {s: None if mean(runs, s) is None or mean(refs, s) is None else
             round((mean(runs, s) - mean(refs, s)) / doublings, 4) for s in SETS}
    return {**slope, "from": "full-budget runs vs the ref arms, τ against log2 GPU-minutes"}


def at_equal_gpu_minutes(delta: dict, cost_ratio: float, slope: dict) -> dict:
    """Δ τ less what ref would gain from the arm's extra GPU-minutes (``cost_ratio`` × ref's),
    by ``slope`` per doubling: what the arm buys beyond spending more."""
    return {s: None if delta.get(s) is None or slope.get(s) is None else
            round(delta[s] - slope[s] * math.log2(cost_ratio), 4) for s in SETS}


def curve(arms: list[dict]) -> dict:
    """τ (held-out, the monitor's) against training GPU-minutes: tau_curve.json's series (runs
    alone: GPU-minutes = their metrics' seconds at that step) and the arms' monitor points."""
    series = {}
    for name, pts in read_json(H200 / "tau_curve.json").items():
        line = timeline(read_metrics(H200 / name / "metrics.jsonl"))
        series[name] = [{"step": p["step"], "target_tokens": p["target_tokens"],
                         "gpu_minutes": round(line[p["step"]][0] / 60, 3),
                         "tau_heldout": p["tau_heldout"]} for p in pts]
    for a in (a for a in arms if a["while_training"]):  # a lent ref has none
        series[f"{a['folder'].rsplit('/', 2)[-2]}/{a['arm']}"] = a["while_training"]
    return series


def collect() -> dict:
    sweeps = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
    arms = []
    reports = committed("*__bench__report.json")
    for folder in committed_folders(reports + committed("*" + CUT)):
        rows = arm_rows(folder, sweeps)
        for r in rows:  # against the ref arm of the same lease and sweep
            ref = next((o for o in rows if o["arm"] == "ref" and o["sweep"] == r["sweep"]),
                       None)
            r["delta"], r["verdict"] = verdict(r, ref)
            r["apply"] = overrides(r["sweep"], r["arm"]) if r["verdict"] == "wins" else {}
        arms += rows
    runs = [run_row(r) for r in RUNS]
    slope = tau_per_doubling(arms, runs)
    for r in arms:  # the verdict again at ref's GPU-minutes: a winner must win there too
        ref = next((o for o in arms if o["folder"] == r["folder"] and o["arm"] == "ref"
                    and o["sweep"] == r["sweep"]), None)
        if slope is None or ref is None or r is ref or not r["delta"]:
            continue
        key = "report_train_minutes" if ref.get("cost_basis") else "gpu_minutes"  # like for like
        r["gpu_minutes_ratio"] = round(r[key] / ref[key], 4)
        r["delta_equal_gpu_minutes"] = at_equal_gpu_minutes(r["delta"], r["gpu_minutes_ratio"],
                                                            slope)
        r["verdict_equal_gpu_minutes"] = rule(r["delta_equal_gpu_minutes"])
        if r["verdict_equal_gpu_minutes"] != "wins":
            r["apply"] = {}
    return {"command": "python -m bench.ablation_table --write docs/benchmarks.md",
            "rule": f"wins: Δτ MT-Bench >= +{WIN_MTBENCH} and Δτ HumanEval >= 0 against the ref "
                    f"arm of the same folder; loses: Δτ MT-Bench <= -{WIN_MTBENCH}; else no "
                    "change",
            "gpu_minutes": "training steps' seconds x the run's share of the GPU (arms trained "
                           "at once split each second evenly); the data stage apart",
            "tau_per_doubling": slope,
            "arms": arms, "runs": runs, "curve": curve(arms),
            "without_train_files": [rel(p) for p in reports if not has_train_files(p)]}


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _d(x) -> str:
    return "" if x is None else f"{x:+.3f}"


def render(data: dict) -> str:
    """The markdown block: the ablation table, τ per MT-Bench category, the verdicts."""
    head = ("| arm | folder | target tokens | train GPU-min (GPU share) | data stage s (arms "
            "sharing it) | τ MT-Bench | τ HumanEval | τ held-out | τ own training prompts | "
            "Δ MT-Bench | Δ HumanEval | Δ held-out | verdict |\n" + "|---" * 13 + "|")
    lines = [head]
    for r in data["arms"] + data["runs"]:
        t, d = r["tau"], r.get("delta") or {}
        data_s = (f"{r['data_seconds']:.0f} ({r['data_shared_by']})" if "data_seconds" in r
                  else "n/a")
        lines.append(
            f"| {r['arm']} | `{short(r['folder'])}` | "
            f"{r['target_tokens'] / 1e6:.2f}M | {r['gpu_minutes']:.2f} ({r['gpu_share']:.2f}) | "
            f"{data_s} | {_f(t['mtbench'])} | {_f(t['humaneval'])} | {_f(t['heldout'])} | "
            f"{_f(t['train'])} | {_d(d.get('mtbench'))} | {_d(d.get('humaneval'))} | "
            f"{_d(d.get('heldout'))} | {r.get('verdict', 'full budget, not an arm')} |")
    rows = [r for r in data["arms"] + data["runs"] if r["mtbench_by_category"]]
    cats = [c for c in MTBENCH_ORDER if any(c in r["mtbench_by_category"] for r in rows)]
    lines += ["", "τ per MT-Bench category (first turns, simulated, pooled):", "",
              "| arm | folder | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats)]
    for r in rows:
        lines.append(f"| {r['arm']} | `{short(r['folder'])}` | "
                     + " | ".join(_f(r["mtbench_by_category"].get(c)) for c in cats) + " |")
    own = [r for r in data["arms"] if r.get("train_by_category")]
    for r in own:
        lines += ["", f"τ per self-written category on {r['arm']}'s own training prompts: "
                  + ", ".join(f"{c} {t:.3f}" for c, t in r["train_by_category"].items())]
    lines += ["", f"Verdict rule: {data['rule']}.", ""]
    for r in data["arms"]:
        if r["verdict"] == "reference":
            continue
        cost = (f", train GPU-minutes ×{r['gpu_minutes_ratio']:.2f} of ref's"
                if r.get("gpu_minutes_ratio") else "")
        fields = ", ".join(f"`{k}: {v}`" for k, v in r["apply"].items())
        eq = r.get("delta_equal_gpu_minutes")
        equal = (f"; at ref's GPU-minutes Δ MT-Bench {_d(eq.get('mtbench'))}, HumanEval "
                 f"{_d(eq.get('humaneval'))}: **{r['verdict_equal_gpu_minutes']}**" if eq else "")
        deltas = (f" (Δ MT-Bench {_d(r['delta'].get('mtbench'))}, "
                  f"HumanEval {_d(r['delta'].get('humaneval'))}{cost})" if r["delta"] else "")
        lines.append(f"- {r['arm']} (`{short(r['folder'])}`): "
                     f"**{r['verdict']}**{deltas}{equal}" + (f"; to apply: {fields}" if fields else ""))
    slope = data.get("tau_per_doubling")
    if slope:
        lines += ["", f"At ref's GPU-minutes: Δ less {_f(slope['mtbench'])} (MT-Bench) / "
                  f"{_f(slope['humaneval'])} (HumanEval) τ per doubling of GPU-minutes × log2 "
                  f"of the arm's GPU-minutes over ref's (slope from the {slope['from']}: an "
                  "estimate across leases). A winner is applied only if it wins there too."]
    return "\n".join(lines)


splice = partial(md_block.splice, begin=BEGIN, end=END)


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


main = md_block.main_of(__doc__.split("\n")[0], collect=collect, render=render, plot=plot,
                        dumps=dumps, json_path=OUT_JSON, png_path=OUT_PNG, begin=BEGIN, end=END)


if __name__ == "__main__":
    run(main)
