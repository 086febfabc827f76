"""Shared stages name the spec the user asked for, and a DAG parse writes nothing under results/
for a sweep nobody asked for (issue 37). A sweep over micro whose arms sort before it ('a-lr-*')
shares micro's env, warm-up and data store entries: asked for bench_micro, those jobs read
specs/micro.yaml (their log's `[data] spec ...` line), not an arm's merged file; the stage names
the others sharing its entry (dflash.spec.sharers: the arms here) from the same key helper as the
DAG, at run time, writing nothing (tests/test_sweep_dag.py checks a real run's log and manifest)."""
from __future__ import annotations

import re

import pytest
import yaml

from dflash.runtime.harness import copy_workflow, snakemake
from dflash.spec.load import load_spec
from dflash.spec.sharers import sharers
from dflash.stages import shared_note

SWEEP = {"base": "micro", "arms": {"lo": {"optim": {"lr": 5.0e-4}}, "hi": {"optim": {"lr": 2.0e-3}}}}


@pytest.fixture(scope="module")
def wf(tmp_path_factory, micro_spec):
    wf = copy_workflow(tmp_path_factory.mktemp("requested"), [micro_spec])
    (wf / "sweeps").mkdir()
    (wf / "sweeps" / "a-lr.yaml").write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    return wf


def _stage_specs(out: str) -> dict[str, str]:
    """{shared stage: the spec file its planned job reads}, from `snakemake -n -p`."""
    return {m[1]: m[2] for m in re.finditer(r"-m dflash (env|warmup|data) (\S+) ", out)}


def test_a_plain_spec_s_shared_stages_name_it_and_no_sweep_is_written(wf):
    r = snakemake(wf, "-n", "-p", "bench_micro")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert _stage_specs(out) == {st: "specs/micro.yaml" for st in ("env", "warmup", "data")}, out
    assert "a-lr" not in out, out
    assert not (wf / "results").exists(), sorted(map(str, (wf / "results").rglob("*")))


def test_a_shared_stage_names_the_specs_sharing_its_entry_and_writes_nothing(wf):
    r = snakemake(wf, "-n", "-p", "bench_micro")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # the store entries the DAG planned for micro's shared jobs, by the folder they write into
    at = {m[1]: m[2] for m in re.finditer(r"-m dflash (env|warmup|data) \S+ .*?--at (\S+)", out)}
    assert sorted(at) == ["data", "env", "warmup"], out
    micro = load_spec(wf / "specs" / "micro.yaml")
    for stage, entry in at.items():
        assert sharers(micro, stage, wf / entry, repo=wf) == ["a-lr-hi", "a-lr-lo"], stage
    assert not (wf / "results").exists()  # the arms expanded in memory: no file written
    # micro's own folder (a stage run by hand) is no store entry; an entry of another key
    # (another checkout's code or lock) cannot be told: None, not a guess
    assert sharers(micro, "data", wf / "results" / "micro", repo=wf) is None
    other = (wf / at["data"]).with_name("data-0123456789abcdef")
    assert sharers(micro, "data", other, repo=wf) is None
    assert shared_note(["a-lr-hi", "a-lr-lo"]) == " · shared with a-lr-hi, a-lr-lo"
    assert shared_note([]) == " · shared with no other spec" and shared_note(None) == ""
    many = [f"s{i}" for i in range(9)]  # the log names six, the manifest every one
    assert shared_note(many) == (" · shared with s0, s1, s2, s3, s4, s5 and 3 more "
                                 "(the manifest's shared_with lists all 9)")


def test_a_sweep_asked_for_writes_its_own_arm_files_only(wf):
    (wf / "sweeps" / "b-lr.yaml").write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    try:
        r = snakemake(wf, "-n", "-p", "bench_a-lr")
    finally:
        (wf / "sweeps" / "b-lr.yaml").unlink()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    arm_file = "results/a-lr.sweep/specs/a-lr-hi.yaml"  # the first arm asked for, by name
    assert _stage_specs(out) == {st: arm_file for st in ("env", "warmup", "data")}, out
    written = sorted(p.relative_to(wf).as_posix() for p in (wf / "results").rglob("*.yaml"))
    assert written == [arm_file, "results/a-lr.sweep/specs/a-lr-lo.yaml"], written
