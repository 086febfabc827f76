"""Shared stages name the spec the user asked for, and a DAG parse writes nothing under results/
for a sweep nobody asked for (issue 37). A sweep over micro whose arms sort before it ('a-lr-*')
shares micro's env, warm-up and data store entries: asked for bench_micro, those jobs read
specs/micro.yaml (their log's `[data] spec ...` line), not an arm's merged file."""
from __future__ import annotations

import re

import pytest
import yaml

from dflash.runtime.harness import copy_workflow, snakemake

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
