"""A lease's ``ref`` arm lent by another lease's folder, for bench/ablation_table.py.

Round 14 ran no ref arm of its own (one H200 lease, the recipe arms first): round 13's ref, trained
on the byte-identical dataset with the same training code, stands in. The folder says so in a
``ref.json`` beside its reports::

    {"report": "bench/results/h200/<folder>/<sweep>-ref__bench__report.json", "why": "..."}

The lent report must be a ``ref`` arm of a sweep whose arms are in the folder, and its dataset
(``dataset.sha256`` of its data manifest) must be one the folder's arms of that sweep trained on;
anything else is one clear error naming ``ref.json``. Δτ is taken against the lent report's τ.
The lender's train files need not have come back (round 13's did not), so its cost is the bench
stage's own figure, ``gpu_minutes.train`` of report.json, and the equal-minutes ratio uses the
same figure of each arm (``report_train_minutes``): like against like, across two machines.

Round 19 ran only data arms (the steered prompts, alone and with γ 4 and 8 layers): no arm there
can share the ref's dataset. It borrows round 17's run of the sweep's base spec (a ``ref`` arm
in all but name: bench/ablation_files.py's ``base_as_ref``), and the dataset rule becomes: when
every arm of the sweep in the folder changes ``data``, the lent dataset must have been made
byte-identical by two committed runs (data generation reproduces across leases: rounds 16 and
17 wrote the base's, rounds 18 and 19 the steered one, each pair with one sha256), so it is the
dataset the folder's own ref would have trained on.

A run of another name lends as ref too when it trained exactly as the sweep's ref arm trains
today (:func:`trains_as_ref`: its recorded training, shape and data fingerprints are today's
ref's): round 19's ``steered-gamma4-depth8`` arm became the base, so the next hold's ``epochs9``
arm borrows that run, on the same dataset. When the base moves on (round 26: soft labels for 8
epochs), the folders that lent the old base's run name the sweep arm that now trains as it did
(``"trained_as": "ce"`` in ref.json): the check is then against that arm, so the ref each folder
was judged against stays what it was.
"""
from __future__ import annotations

from pathlib import Path

from bench.ablation_files import (REPO, base_as_ref, by_category, committed, overrides, read_json,
                                  rel, sibling, taus)
from dflash.errors import DFlashError
from dflash.spec.sweeps import load_sweep

REF_FILE = "ref.json"
COST_BASIS = "report.json gpu_minutes.train (the lender's train files did not come back)"


def _data_manifest(report: Path, where: Path) -> tuple[dict, str]:
    """The lender's data manifest and its dataset.sha256 (one clear error without them)."""
    path = sibling(report, "data", "manifest.json")
    manifest = read_json(path) if path.is_file() else {}
    sha = (manifest.get("dataset") or {}).get("sha256")
    if not sha:
        raise DFlashError(f"{where}: {rel(path)} has no dataset.sha256")
    return manifest, sha


def lent_ref(folder: Path, rows: list[dict]) -> dict | None:
    """The ref row ``folder/ref.json`` lends to the folder's arms ``rows``, or None without one."""
    path = folder / REF_FILE
    if not path.is_file():
        return None
    doc = read_json(path)
    report = REPO / str(doc.get("report", ""))
    if not doc.get("report") or not report.is_file():
        raise DFlashError(f"{path}: report {doc.get('report')!r} is not a committed file")
    if not doc.get("why"):
        raise DFlashError(f"{path}: says not why the lent ref compares ('why')")
    rep = read_json(report)
    arm = doc.get("trained_as", "ref")
    # each sweep of the folder once (trains_as_ref loads the sweep's every arm)
    sweeps = {s for s in {r["sweep"] for r in rows}
              if rep.get("spec") in (f"{s}-ref", base_as_ref(s))
              or trains_as_ref(rep, report, s, arm)}
    if not sweeps:
        raise DFlashError(f"{path}: {rep.get('spec')!r} is no ref arm of the sweeps here "
                          f"({sorted({r['sweep'] for r in rows})}) and trained not as their "
                          f"{arm!r} arm does")
    sweep = sweeps.pop()
    data, lent = _data_manifest(report, path)
    arms = [r for r in rows if r["sweep"] == sweep]
    data_arms = all(_data_arm(sweep, r["arm"]) for r in arms)
    if not any(r["data_sha256"] == lent for r in arms) and not (
            data_arms and _reproduced(lent, report)):
        raise DFlashError(f"{path}: the lent ref trained on dataset {lent[:12]}, no arm here did"
                          + (" and no other committed run made it" if data_arms else ""))
    steps = rep["step_time"]
    acc = rep["acceptance"]
    return {
        "arm": "ref", "sweep": sweep, "folder": rel(folder), "ref_from": rel(report),
        "why": doc["why"], "cost_basis": COST_BASIS,
        # steady-state tokens/s × the steps' mean time: the lender's counters did not come back
        "target_tokens": round(rep["tokens_per_s"] * steps["mean_s"] * steps["steps"]),
        "steps": steps["steps"], "train_step_seconds": None,
        "gpu_minutes": rep["gpu_minutes"]["train"], "gpu_share": 1.0,
        "report_train_minutes": rep["gpu_minutes"]["train"],
        "data_seconds": data["seconds"], "data_checksum": lent, "data_sha256": lent,
        "data_shared_by": 1,
        "tau": taus(acc["sets"]),
        "mtbench_by_category": by_category(acc["sets"], "mtbench"),
        "train_by_category": by_category(acc["sets"], "train"),
        "while_training": [],
    }


def trains_as_ref(rep: dict, report: Path, sweep: str, arm: str = "ref") -> bool:
    """Whether the lent run trained exactly as the sweep's ``arm`` (its ``ref`` unless ref.json
    says ``trained_as``) trains today: the training, shape and data fingerprints it recorded
    (report.json ``fingerprints``, its data manifest's) are those of today's ``<sweep>-<arm>``.
    Round 19's candidate arm (``steered-gamma4-depth8``) became the base, so its run was the
    ref's from then on, and the ``ce`` arm's since round 26."""
    ref = next((a.spec for a in load_sweep(REPO / "sweeps" / f"{sweep}.yaml").arms
                if a.name == f"{sweep}-{arm}"), None)
    fp = rep.get("fingerprints") or {}
    data = sibling(report, "data", "manifest.json")
    return ref is not None and data.is_file() \
        and fp.get("spec_train") == ref.fingerprint("train") \
        and fp.get("spec_shape") == ref.fingerprint("warmup") \
        and (read_json(data).get("fingerprints") or {}).get("data") == ref.fingerprint("data")


def _data_arm(sweep: str, arm: str) -> bool:
    """Whether the arm changes the data (so it can never share its ref's dataset)."""
    return any(k.startswith("data.") for k in overrides(sweep, arm))


def _reproduced(sha: str, report: Path) -> bool:
    """Whether a committed run other than ``report``'s made the dataset ``sha`` too."""
    for path in committed("*__data__manifest.json"):
        if path.parent != report.parent:
            doc = read_json(path)
            if (doc.get("dataset") or {}).get("sha256") == sha:
                return True
    return False
