"""End to end: a two-arm sweep of the micro spec through the real DAG (issue #29).

The arms differ in a training field only (optim.lr), so Snakemake runs env, warm-up and data
ONCE (one store entry each, results/.shared/) and train + bench per arm; the sweep report lists
both arms and is in `snakemake --report`; a child spec (base: micro) plans onto the same shared
stages; deleting one arm's results leaves the other's inputs (and the store) intact, and asking
for the arm again reruns its own train and bench only.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from dflash.artifacts.manifest import sha256_file
from dflash.runtime.harness import REPO, copy_workflow, job_counts, snakemake

pytestmark = pytest.mark.e2e

SWEEP = {"base": "micro", "description": "lr on micro",
         "arms": {"lo": {"optim": {"lr": 5.0e-4}}, "hi": {"optim": {"lr": 2.0e-3}}}}
ARMS = ("micro-lr-lo", "micro-lr-hi")


def _all_jobs(out: str) -> dict[str, int]:
    """Every row of Snakemake's job stats, the link and report jobs included."""
    rows = out.split("Job stats:\n", 1)[1].split("\ntotal", 1)[0].splitlines()[2:]
    return {r.split()[0]: int(r.split()[1]) for r in rows if len(r.split()) == 2}


def _prepare(tmp: Path) -> Path:
    wf = copy_workflow(tmp, [REPO / "tests" / "specs" / "micro.yaml"])
    (wf / "sweeps").mkdir()
    (wf / "sweeps" / "micro-lr.yaml").write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    return wf


BACKGROUND_DAG = (_prepare, ["bench_micro-lr"])  # started with the session (tests/conftest.py)


@pytest.fixture(scope="module")
def wf(background_dag):
    wf, rc, out = background_dag
    assert rc == 0, out[-4000:]
    # the data and warm-up stages (and env) ran ONCE for the two arms
    assert job_counts(out) == {"env": 1, "warmup": 1, "data": 1, "train": 2, "bench": 2}, out
    assert _all_jobs(out)["link_stage"] == 6 and _all_jobs(out)["sweep_report"] == 1
    return wf


def test_arms_share_one_store_entry_per_upstream_stage(wf):
    res = wf / "results"
    for st in ("env", "warmup", "data"):
        entries = sorted(p.name for p in (res / ".shared").glob(f"{st}-*"))
        assert len(entries) == 1, entries
        store = res / ".shared" / entries[0] / st
        for arm in ARMS:  # the arm's folder holds links to the very same files
            assert os.path.samefile(res / arm / st / "manifest.json", store / "manifest.json")
        assert (wf / "logs" / ARMS[0] / f"{st}.log").stat().st_size > 0
        # the job read the first arm asked for; it names the others reading this entry (micro
        # itself shares it: the arms change a training field only), in its log and manifest
        assert json.loads((store / "manifest.json").read_text())["shared_with"] == \
            ["micro", "micro-lr-lo"], st
        head = f"[{st}] spec results/micro-lr.sweep/specs/micro-lr-hi.yaml · shared with micro, micro-lr-lo"
        assert head in (wf / "logs" / ARMS[0] / f"{st}.log").read_text(), st
    ds = next((res / ".shared").glob("data-*")) / "data" / "dataset.parquet"
    assert ds.stat().st_nlink == 3  # the store + two arms
    for arm, lr in zip(ARMS, (5.0e-4, 2.0e-3)):
        train = json.loads((res / arm / "train" / "manifest.json").read_text())
        assert train["exactly_once"]["0"]["exactly_once"] is True
        spec = yaml.safe_load((res / "micro-lr.sweep" / "specs" / f"{arm}.yaml").read_text())
        assert spec["optim"]["lr"] == lr and spec["name"] == arm


def test_sweep_report_lists_both_arms(wf):
    d = wf / "results" / "micro-lr.sweep"
    rep = json.loads((d / "report.json").read_text())
    assert [a["arm"] for a in rep["arms"]] == ["lo", "hi"]
    assert [a["overrides"] for a in rep["arms"]] == [{"optim.lr": 5.0e-4}, {"optim.lr": 2.0e-3}]
    assert rep["stage_runs"] == {"env": 1, "warmup": 1, "data": 1}
    for a in rep["arms"]:
        arm_report = json.loads((wf / "results" / a["spec"] / "bench" / "report.json").read_text())
        assert a["final_loss"] == arm_report["final_loss"] and a["final_loss"] > 0
        assert a["tokens_per_s"] == arm_report["tokens_per_s"] > 0
        assert a["gpus"] == 0 and a["gpu_minutes"] == 0 and a["train_minutes"] > 0
    md = (d / "report.md").read_text()
    assert md.startswith("# DFlash sweep report: micro-lr")
    assert "| lo | `optim.lr=0.0005`" in md and "| hi | `optim.lr=0.002`" in md
    assert (d / "sweep.png").stat().st_size > 1000
    r = snakemake(wf, "--report", "report.html", "bench_micro-lr")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    html = (wf / "report.html").read_text()
    assert "sweep.png" in html and "The sweep report of" in html


def test_nothing_reruns_and_a_child_spec_plans_onto_the_shared_stages(wf):
    r = snakemake(wf, "-n", "bench_micro-lr")
    assert r.returncode == 0 and job_counts(r.stdout + r.stderr) == {}, r.stdout[-3000:]
    # "a-g3" sorts before every other spec: the shared jobs' spec file would now be its own
    child = {"base": "micro", "name": "a-g3", "loss": {"gamma": 3}}
    (wf / "specs" / "a-g3.yaml").write_text(yaml.safe_dump(child))
    try:
        r = snakemake(wf, "-n", "bench_a-g3", "bench_micro-lr")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        # a new spec sorting first changes no shared job; the child trains on the arms' data
        assert job_counts(out) == {"train": 1, "bench": 1}, out[-3000:]
        assert _all_jobs(out)["link_stage"] == 3
    finally:
        (wf / "specs" / "a-g3.yaml").unlink()


def test_deleting_one_arms_results_keeps_the_others_inputs(wf):
    res = wf / "results"
    kept = res / ARMS[1] / "data" / "dataset.parquet"
    sha = json.loads((res / ARMS[1] / "data" / "manifest.json").read_text())["dataset"]["sha256"]
    shutil.rmtree(res / ARMS[0])
    assert kept.is_file() and next((res / ".shared").glob("data-*/data/dataset.parquet")).is_file()

    assert sha256_file(kept) == sha
    r = snakemake(wf, "-n", "bench_micro-lr")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # the deleted arm relinks its inputs and trains again; no shared stage reruns
    assert job_counts(out) == {"train": 1, "bench": 1}, out[-3000:]
    assert _all_jobs(out)["link_stage"] == 3


def test_a_spec_on_other_devices_never_stands_in_for_the_shared_jobs(wf):
    """Every stage checks the devices of the spec file its job runs with: a spec that sorts
    first but names devices this machine lacks (an 8-GPU spec beside a 1-GPU one) must get
    store entries of its own, never run micro's env, warm-up or data jobs."""
    other = {"base": "micro", "name": "a-gpu",
             "topology": {"targets": ["cuda:0"], "drafters": ["cuda:0"],
                          "allow_shared_devices": True}}
    (wf / "specs" / "a-gpu.yaml").write_text(yaml.safe_dump(other))
    try:
        r = snakemake(wf, "-n", "-p", "bench_micro-lr")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        # the arms' shared stages stay as they are (an arm deleted above may retrain)
        assert not {"env", "warmup", "data"} & set(job_counts(out)), out[-3000:]
        r = snakemake(wf, "-n", "-p", "bench_a-gpu")
        out = r.stdout + r.stderr
        assert job_counts(out) == {"env": 1, "warmup": 1, "data": 1, "train": 1, "bench": 1}
        assert "specs/a-gpu.yaml" in out and "specs/micro.yaml" not in out, out[-3000:]
    finally:
        (wf / "specs" / "a-gpu.yaml").unlink()
