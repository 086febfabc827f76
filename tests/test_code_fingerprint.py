"""Each stage's code fingerprint covers exactly the package files its command runs or reads
(computed from imports and the package data they name), so Snakemake reruns what an edit
touches. The DAG-level check (``snakemake -n`` after an edit) is in test_dag.py."""
from __future__ import annotations

import shutil

import pytest

from dflash.artifacts.code_fingerprint import PACKAGE_DIR, stage_code_fingerprint, stage_files

STAGES = ("env", "warmup", "data", "train", "bench")


def _names(stage, root=PACKAGE_DIR) -> set[str]:
    return {str(p.relative_to(root)) for p in stage_files(stage, root)}


def test_every_stage_runs_the_cli_and_reads_the_schema():
    for stage in STAGES:
        names = _names(stage)
        assert {"__init__.py", "__main__.py", "cli.py", "spec/schema/spec.schema.yaml"} <= names, stage


def test_the_report_template_belongs_to_bench_only():
    assert [s for s in STAGES if "templates/report.md.j2" in _names(s)] == ["bench"]


def test_modules_belong_to_the_stages_that_import_them():
    # warmup builds packing's buckets (the hand-kept list missed packing); only training (and
    # bench's timed run) runs the scheduler; every stage that compiles takes the gate (warmup's
    # threads its dynamo settings, data's fast generation engine its exclusive side)
    for mod in ("train/packing.py", "train/warm.py", "train/replica.py"):
        assert [s for s in STAGES if mod in _names(s)] == ["warmup", "train", "bench"], mod
    assert [s for s in STAGES if "train/scheduler.py" in _names(s)] == ["train", "bench"]
    assert [s for s in STAGES if "runtime/gate.py" in _names(s)] == ["warmup", "data", "train", "bench"]
    assert [s for s in STAGES if "stages/data.py" in _names(s)] == ["data"]
    # a piece split out of a module reruns what its parent reruns (the chunk plan: data only)
    assert [s for s in STAGES if "data/chunks.py" in _names(s)] == ["data"]
    for piece, parent in (("decode/prefill.py", "decode/engine.py"),
                          ("decode/speculative_step.py", "decode/speculative.py")):
        assert ([s for s in STAGES if piece in _names(s)]
                == [s for s in STAGES if parent in _names(s)] != []), piece
    # the phases both train and bench run live in the library (no stage imports another)
    assert [s for s in STAGES if "train/trainer.py" in _names(s)] == ["train", "bench"]
    assert [s for s in STAGES if "eval/report.py" in _names(s)] == ["bench"]
    for stage in STAGES:
        assert [n for n in _names(stage) if n.startswith("stages/") and n != "stages/__init__.py"
                ] == [f"stages/{stage}.py"], stage


def test_env_runs_no_model_code():
    names = _names("env")
    assert not names & {"models/target.py", "models/drafter.py", "train/scheduler.py", "runtime/gate.py"}, names


@pytest.fixture
def package_copy(tmp_path):
    dst = tmp_path / "dflash"
    shutil.copytree(PACKAGE_DIR, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_an_edit_changes_exactly_the_fingerprints_of_the_stages_that_run_it(package_copy):
    before = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    assert before == {s: stage_code_fingerprint(s) for s in STAGES}  # relative paths: same value
    packing = package_copy / "train" / "packing.py"
    packing.write_text(packing.read_text() + "\n_EDITED = 1\n")
    after = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    assert {s for s in STAGES if after[s] != before[s]} == {"warmup", "train", "bench"}
    tpl = package_copy / "templates" / "report.md.j2"
    tpl.write_text(tpl.read_text() + "{# edited #}\n")
    again = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    assert {s for s in STAGES if again[s] != after[s]} == {"bench"}


def test_comments_docstrings_and_layout_change_no_fingerprint(package_copy):
    """Only what runs counts: a comment, a docstring or a blank line reruns nothing."""
    before = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    sched = package_copy / "train" / "scheduler.py"
    text = sched.read_text()
    sched.write_text(text.replace('"""', '"""Reworded. ', 1).replace("\ndef ", "\n\n\ndef ", 1)
                     + "\n\n# a comment\n")
    assert {s: stage_code_fingerprint(s, package_copy) for s in STAGES} == before
    sched.write_text(text + "\nX = 2\n")
    after = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    assert {s for s in STAGES if after[s] != before[s]} == {"train", "bench"}


def test_a_declared_non_trigger_reruns_nothing_but_what_it_imports_still_counts(package_copy):
    """stages/data.py imports train/budget.py plainly (its disk check), declared no rerun trigger
    for data: editing the budget leaves data's fingerprint alone; editing what data really runs
    (the chunk plan) changes it."""
    assert "train/budget.py" not in _names("data")
    before = stage_code_fingerprint("data", package_copy)
    budget = package_copy / "train" / "budget.py"
    budget.write_text(budget.read_text() + "\n_EDITED = 1\n")
    assert stage_code_fingerprint("data", package_copy) == before
    chunks = package_copy / "data" / "chunks.py"
    chunks.write_text(chunks.read_text() + "\n_EDITED = 1\n")
    assert stage_code_fingerprint("data", package_copy) != before


def test_the_sweep_report_rule_fingerprints_the_tool_it_runs():
    """rules/sweeps.smk's code_hash("sweep") runs `dflash sweep-report` (eval/sweep_report.py):
    its closure holds that module and the template it reads, not a stage."""
    names = {p.as_posix().split("dflash/", 1)[-1] for p in stage_files("sweep")}
    assert {"eval/sweep_report.py", "eval/report.py", "templates/sweep.md.j2"} <= names


def test_an_import_added_in_the_same_process_is_followed(package_copy):
    """Each module is parsed once per source text (one Snakefile parse fingerprints every
    stage): an import added after a first fingerprint is still seen, without a new process."""
    assert "eval/report.py" not in _names("env", package_copy)
    env = package_copy / "stages" / "env.py"
    env.write_text(env.read_text() + "\nfrom ..eval import report  # noqa: E402,F401\n")
    assert "eval/report.py" in _names("env", package_copy)


def test_the_sharers_note_reruns_no_stage(package_copy):
    """stages/__init__.py imports spec/sharers.py (a shared entry names the other specs reading
    it, at run time), declared no rerun trigger for every stage: editing it (or spec/sweeps.py,
    which only it brings in for env and warm-up) changes no stage's fingerprint."""
    assert [s for s in STAGES if "spec/sharers.py" in _names(s)] == []
    assert [s for s in STAGES if "spec/sweeps.py" in _names(s)] == []
    before = {s: stage_code_fingerprint(s, package_copy) for s in STAGES}
    for mod in ("sharers.py", "sweeps.py"):
        f = package_copy / "spec" / mod
        f.write_text(f.read_text() + "\n_EDITED = 1\n")
    assert {s: stage_code_fingerprint(s, package_copy) for s in STAGES} == before
