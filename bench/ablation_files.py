"""The committed GPU files the recipe ablations are read from, and the sweep files' arms:
one room for the readers that bench/ablation_table.py (the table), bench/ablation_ref.py (a
lent ref) and bench/frontier.py (the frontier) share, so none of them imports another's.

A bench stage's files sit beside its report as ``<arm>__<stage>__<name>`` (bench/gpu/session.sh's
naming); a report cut after its first τ sets is ``<arm>__bench__figures.json``
(bench/figures_from_log.py).
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import yaml

from bench.figures_from_log import CUT
from bench.metrics_file import read_metrics
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
H200 = RESULTS / "h200"
# the GPUs whose committed rounds hold arms and runs, H200's first: the tables keep their rows'
# order (the docs cite them by index) and a round on another GPU comes after. Round 22 ran on an
# H100 (no H200 started): the byte-identical dataset, training within 1.4 % of the H200's
# tokens/s (round 19: 244.6K, round 22: 241.2K), so its GPU-minutes compare
GPUS = (H200, RESULTS / "h100")
SETS = ("mtbench", "humaneval", "heldout", "train")


def rel(path: Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def committed(pattern: str, key=None) -> list[Path]:
    """The committed files matching ``pattern`` under every GPU's results, GPU by GPU
    (:data:`GPUS`' order), each GPU's sorted by ``key`` (the path by default)."""
    return [p for root in GPUS for p in sorted(root.rglob(pattern), key=key)]


def committed_folders(files: list[Path]) -> list[Path]:
    """The folders holding ``files`` (committed ones, :func:`committed`'s), GPU by GPU, each GPU's
    sorted: the rows the docs cite by index keep it when another GPU's round comes."""
    return [f for root in GPUS
            for f in sorted({p.parent for p in files if p.is_relative_to(root)})]


def short(folder: str) -> str:
    """A results folder as the tables show it: an H200 round bare (as always), another GPU's
    under its GPU (``h100/round22-...``)."""
    return folder.removeprefix("bench/results/").removeprefix("h200/")


def round_of(path: Path) -> str:
    """The round folder a committed file sits in, as the tables show it (``round21-2026-12-05``;
    another GPU's: ``h100/round22-2026-12-05``)."""
    root = next(r for r in GPUS if Path(path).is_relative_to(r))
    return short(rel(root / Path(path).relative_to(root).parts[0]))


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def sibling(report: Path, stage: str, name: str) -> Path:
    """``<arm>__<stage>__<name>`` beside ``<arm>__bench__report.json`` (or its figures)."""
    return report.with_name(report.name.replace("__bench__report.json", f"__{stage}__{name}")
                            .replace(CUT, f"__{stage}__{name}"))


def has_train_files(report: Path) -> bool:
    """Whether the train manifest beside a report came back (round 13's ref arm: the machine was
    lost while its train folder was set aside; not tabled, listed in ``without_train_files``)."""
    return sibling(report, "train", "manifest.json").is_file()


def metrics_of(report: Path) -> list[dict]:
    for name in ("metrics.jsonl.gz", "metrics.jsonl"):
        if (p := sibling(report, "train", name)).is_file():
            return read_metrics(p)
    raise DFlashError(f"{sibling(report, 'train', 'metrics.jsonl[.gz]')}: missing")


def timeline(metrics: list[dict]) -> dict[int, tuple[float, int]]:
    """step -> (training seconds so far, target tokens so far). ``t`` restarts at 0 when a
    train stage resumes from a checkpoint: each segment's seconds add up (a step logged twice,
    replayed after the resume, keeps its last figures)."""
    out, before, prev, tokens = {}, 0.0, 0.0, 0
    for m in metrics:
        if m["t"] < prev:  # a new segment (resumed)
            before += prev
        prev = m["t"]
        tokens += m["tokens"]
        out[m["step"]] = (before + m["t"], tokens)
    return out


def taus(sets: dict) -> dict:
    return {s: round(sets[s]["tau"], 4) if sets.get(s, {}).get("tau") is not None else None
            for s in SETS}


def by_category(sets: dict, name: str) -> dict:
    return {c: round(t, 4) for c, t in (sets.get(name, {}).get("tau_by_category") or {}).items()}


@functools.lru_cache(maxsize=None)
def _sweep_doc(sweep: str) -> dict:
    """sweeps/<sweep>.yaml as a dict, read once a process: a table reads each sweep for every
    arm of every folder (51 reads, 3 of collect()'s 7 s on the 2-core box)."""
    path = REPO / "sweeps" / f"{sweep}.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise DFlashError(f"{path}: not a readable sweep ({type(e).__name__}: {e})") from None


def base_as_ref(sweep: str) -> str | None:
    """The sweep's base spec, when its run trains exactly as the ``ref`` arm would: ``ref`` has
    no overrides and the sweep-wide ones touch only ``bench`` (how τ and decoding are measured,
    never the training or the data). None otherwise."""
    doc = _sweep_doc(sweep)
    arms = doc.get("arms") or {}
    if "ref" not in arms or arms["ref"] or set(doc.get("overrides") or {}) - {"bench"}:
        return None
    return doc.get("base")


def arms(sweep: str) -> dict:
    """sweeps/<sweep>.yaml's arms (name -> overrides), in file order (a copy: the read is shared)."""
    return copy.deepcopy(_sweep_doc(sweep).get("arms") or {})


def overrides(sweep: str, arm: str) -> dict:
    """The arm's fields in sweeps/<sweep>.yaml, flattened (``loss.kind: kd``): what a winner
    would apply to the defaults or the quality spec."""
    found = arms(sweep)
    out: dict = {}

    def flat(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                flat(f"{prefix}.{k}" if prefix else k, x)
        else:
            out[prefix] = v
    flat("", (found or {}).get(arm) or {})
    # bench.*: how an arm is measured (the epochs9 arm's whole bench), never a recipe change
    return {k: v for k, v in out.items() if not k.startswith("bench.")}
