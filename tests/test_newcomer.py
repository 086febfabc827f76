"""A newcomer's first hour (issue #27): validate checks every spec and the data mistakes that need
no model, a bad spec in specs/ refuses only its own targets, a stage's one-line error is printed
once, budgets come before heavy work. Real CLI and real Snakemake (dry runs, one failing job)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dflash.data.check import check_data
from dflash.env.audit import audit, render
from dflash.env.lock import locked_pins
from dflash.errors import SpecError
from dflash.eval.evalsets import across_categories, mtbench_questions
from dflash.eval.report import fmt, tau_from_accuracy, throughput_windows
from dflash.runtime.gate import Gate
from dflash.runtime.harness import REPO, copy_workflow, snakemake
from dflash.runtime.status import StatusReporter, main
from dflash.spec.load import parse_spec
from dflash.stages.warmup import heartbeat
from dflash.train import budget as bud
from dflash.train import tracker


def dflash(*args, cwd: Path, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=300)


def micro(tmp: Path, name: str = "micro", **data) -> Path:
    d = yaml.safe_load((REPO / "tests" / "specs" / "micro.yaml").read_text())
    d["name"] = name
    if data:
        d["data"] = {k: v for k, v in {**d["data"], **data}.items() if v is not None}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def spec_of(path: Path):
    return parse_spec(yaml.safe_load(path.read_text()), str(path))


# ---------------------------------------------------------------------------------------------
# data checks that need no model (dflash.data.check)
# ---------------------------------------------------------------------------------------------
def test_data_mistakes_name_the_spec_file_and_the_field_path(tmp_path):
    def refused(path, *parts, read_files=True):
        with pytest.raises(SpecError) as e:
            check_data(spec_of(path), read_files=read_files)
        for p in (str(path), *parts):
            assert p in str(e.value), str(e.value)

    missing = str(tmp_path / "nope.jsonl")
    p = micro(tmp_path, source=None, sources=[{"source": "chatterbot-corpus", "count": 4},
                                              {"source": missing}])
    refused(p, "field 'data.sources[1].source'", "nope.jsonl not found", read_files=False)
    p = micro(tmp_path, source=None, sources=[{"source": "chatterbot"}])
    refused(p, "field 'data.sources[0].source'", "did you mean 'chatterbot-corpus'?",
            read_files=False)
    p = micro(tmp_path, source="chatterbot")
    refused(p, "field 'data.source'", "did you mean 'chatterbot-corpus'?", read_files=False)
    p = micro(tmp_path, source=None, max_prompts=12,
              sources=[{"source": "chatterbot-corpus", "count": 10},
                       {"source": "self-written", "count": 5}])
    refused(p, "field 'data.sources'", "add up to 15, more than data.max_prompts 12",
            read_files=False)
    # a file that exists but does not parse: found only when files are read
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n" * 5)
    p = micro(tmp_path, source=str(bad))
    check_data(spec_of(p), read_files=False)
    refused(p, "field 'data.source'", "invalid_json")
    # a good mix passes both ways
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}?"}]})
                            + "\n" for i in range(8)))
    p = micro(tmp_path, source=None, sources=[{"source": str(good), "count": 4},
                                              {"source": "chatterbot-corpus"}])
    check_data(spec_of(p))


# ---------------------------------------------------------------------------------------------
# dflash validate: every spec, each reported; budgets
# ---------------------------------------------------------------------------------------------
def test_validate_checks_every_spec_and_reports_each(tmp_path):
    good = micro(tmp_path)
    gpu = yaml.safe_load(good.read_text())
    gpu.update(name="gpu", topology={"targets": ["cuda:0"], "drafters": ["cuda:1"]})
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(gpu))
    bad = micro(tmp_path, "bad", source="chatterbot")
    r = dflash("validate", tmp_path / "gpu.yaml", bad, good, cwd=tmp_path,
               CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2 and "missing here: cuda:0, cuda:1" in errors[0], r.stderr
    assert "bad.yaml: field 'data.source'" in errors[1] and "Traceback" not in r.stderr
    assert f"ok: {good}" in r.stdout and "1 of 3 specs ok" in r.stderr
    # the budget of the good spec, per device, before any heavy work
    assert "  memory cpu:" in r.stdout and "  disk:" in r.stdout, r.stdout
    assert "checkpoints" in r.stdout and "train ~" in r.stdout, r.stdout
    # --no-devices: the GPU spec passes (its budget names both GPUs); the bad one still fails
    r = dflash("validate", "--no-devices", tmp_path / "gpu.yaml", good, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "memory cuda:0:" in r.stdout and "memory cuda:1:" in r.stdout


def test_budget_items_and_the_disk_refusal(tmp_path):
    spec = spec_of(micro(tmp_path))
    b = bud.budget(spec, tmp_path / "results")
    assert set(b["disk"]) == {"dataset", "checkpoints", "exported drafter"}
    s = bud.sizes(spec)
    # checkpoints: (keep + 1) states of 12 bytes per drafter parameter (fp32 weights, Adam m, v)
    assert b["disk"]["checkpoints"] == (spec.checkpoint.keep + 1) * s.drafter_params * 12
    assert b["disk_total"] == sum(b["disk"].values()) and set(b["memory"]) == {"cpu"}
    assert b["seconds"]["train"] > 0 and b["steps"] == 6
    # the extension point: a new named item joins the total and the refusal
    item = bud.Item("feature cache", lambda s: 10 ** 18)
    bud.DISK.append(item)
    try:
        with pytest.raises(bud.BudgetError, match="feature cache 1000000000.00 GB.*free"):
            bud.check_disk(spec, tmp_path / "results")
    finally:
        bud.DISK.remove(item)
    bud.check_disk(spec, tmp_path / "results")


# ---------------------------------------------------------------------------------------------
# Snakemake: a bad spec refuses only its own targets; a stage's error is printed once
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wf_bad(tmp_path_factory, micro_spec):
    wf = copy_workflow(tmp_path_factory.mktemp("wf"), [micro_spec])
    bad = yaml.safe_load(micro_spec.read_text())  # `cp specs/micro.yaml specs/my-first.yaml`
    (wf / "specs" / "my-first.yaml").write_text(yaml.safe_dump(bad))
    typo = dict(bad, name="typo", data=dict(bad["data"], source="chatterbot"))
    (wf / "specs" / "typo.yaml").write_text(yaml.safe_dump(typo))
    return wf


def test_a_bad_spec_refuses_only_its_own_targets(wf_bad):
    r = snakemake(wf_bad, "-n", "bench_micro", "--config", "default_spec=micro")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resources: tmpdir=/tmp\n" in r.stdout + r.stderr  # CPU jobs: no gpu=0, cuda_N=0
    for target, parts in (("bench_my-first", ["my-first.yaml", "field 'name'",
                                              "must equal the file stem 'my-first'"]),
                          ("data_typo", ["typo.yaml", "field 'data.source'",
                                         "did you mean 'chatterbot-corpus'?"])):
        r = snakemake(wf_bad, "-n", target)
        out = r.stdout + r.stderr
        assert r.returncode == 2, out[-2000:]
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and all(p in errors[0] for p in parts), out[-2000:]
        assert "Traceback" not in out and "common.smk" not in out, out[-2000:]


def test_a_stage_error_is_printed_once_without_rule_exception(wf_bad):
    gpu = yaml.safe_load((wf_bad / "specs" / "micro.yaml").read_text())
    gpu.update(name="gpu", topology={"targets": ["cuda:0"], "drafters": ["cuda:1"]})
    (wf_bad / "specs" / "gpu.yaml").write_text(yaml.safe_dump(gpu))
    r = snakemake(wf_bad, "env_gpu", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("missing here: cuda:0, cuda:1") == 1, out[-3000:]
    assert "RuleException" not in out and "CalledProcessError" not in out, out[-3000:]


# ---------------------------------------------------------------------------------------------
# quiet, useful output: `dflash status` in every stage, the train line's elapsed time and ETA
# ---------------------------------------------------------------------------------------------
def test_status_works_during_every_stage(tmp_path, capsys):
    res, logs = tmp_path / "results" / "x", tmp_path / "logs" / "x"
    (res / "env").mkdir(parents=True)
    (res / "env" / "manifest.json").write_text(json.dumps({"seconds": 75.2}))
    logs.mkdir(parents=True)
    (logs / "data.log").write_text("[data] 40/96 samples · 1m02s elapsed, ETA 1m30s\n")
    out = subprocess.run([sys.executable, "-m", "dflash", "status", str(res)], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["env", "done", "in", "1m15s"]
    assert lines[3].startswith("  data     running (log") and "40/96 samples" in lines[3]
    assert lines[4].split() == ["train", "not", "started"]  # no decoders line: not started
    (res / "train").mkdir()
    (res / "train" / "status.json").write_text(json.dumps({
        "phase": "training", "step": 10, "total_steps": 40, "elapsed_s": 30.0, "eta_s": 90.0,
        "updated_unix": 0, "loss": 6.123456789, "busy": {"drafter-0": 0.912345}}))
    assert main([str(res / "train")]) == 0  # the train folder works as well
    out = capsys.readouterr().out
    assert "step 10/40 · 30s elapsed, ETA 1m30s" in out, out
    assert "loss             6.123\n" in out and "drafter-0=0.9123" in out, out  # rounded


def test_train_status_line_has_elapsed_and_eta(tmp_path, capsys):
    spec = SimpleNamespace(name="x")
    rep = StatusReporter(tmp_path / "status.json", spec, total_steps=10)
    for i in range(4):
        rep.records.append((100.0 + 2.0 * i, i, 50, 1.0))  # 2 s per step
    rep.state["step"] = 4
    assert rep.eta_s() == pytest.approx(6 * 2.0)

    pipe = SimpleNamespace(first_step_s={}, gate=Gate(), queue_depths=lambda: {}, busy_s={},
                           wait_s={})
    rep.tick(pipe)
    line = capsys.readouterr().out
    assert line.startswith("[train] step 4/10 · ") and "elapsed, ETA 12s · " in line, line
    assert json.loads((tmp_path / "status.json").read_text())["eta_s"] == 12.0


# ---------------------------------------------------------------------------------------------
# an honest report
# ---------------------------------------------------------------------------------------------
def test_fewer_mtbench_prompts_are_sampled_across_categories():
    qs = mtbench_questions()
    cats = {q["category"] for q in qs}
    assert len({q["category"] for q in qs[:20]}) <= 2  # the file is sorted by category
    pick = across_categories(qs, 20, seed=0)
    assert len(pick) == 20 and {q["category"] for q in pick} == cats
    assert pick == across_categories(qs, 20, seed=0)          # seeded
    assert pick != across_categories(qs, 20, seed=1)
    assert across_categories(qs, 80, seed=3) == qs            # all: the file as it is
    assert [qs.index(q) for q in pick] == sorted(qs.index(q) for q in pick)


def test_report_figures_are_readable_and_without_partial_windows():
    assert fmt({"cuda": None, "version": "2.13.0", "probed": False}) == "version 2.13.0, probed false"
    assert fmt([0.123456, None]) == "0.123, n/a" and fmt(12345.6) == "12,346"
    # 41 steps of 100 tokens each 1 s apart, then a short partial flush at the end
    metrics = [{"step": i, "t": float(i), "tokens": 100} for i in range(41)]
    metrics.append({"step": 41, "t": 41.05, "tokens": 100})
    w = throughput_windows(metrics)
    assert len(w) == 20 and all(r == pytest.approx(100.0) for _, r in w), w
    assert tau_from_accuracy([0.5, 0.5, None, 0.9]) == pytest.approx(1 + 0.5 + 0.25)


# ---------------------------------------------------------------------------------------------
# the tracker: optional TensorBoard event files (monitor.tensorboard)
# ---------------------------------------------------------------------------------------------
def test_tensorboard_scalars_and_the_optional_dependency(tmp_path):
    row = {"step": 3, "loss": 6.5, "lr": 1e-3, "draft_acc": [0.5, None, 0.25],
           "tau_heldout": 1.2}
    assert tracker.scalars(row, 250.0) == {"train/loss": 6.5, "train/lr": 1e-3,
                                           "train/tokens_per_s": 250.0, "draft_acc/k1": 0.5,
                                           "draft_acc/k3": 0.25, "tau/heldout": 1.2}
    off = spec_of(micro(tmp_path))
    assert off.monitor.tensorboard is False and tracker.open_tracker(off, tmp_path) is None
    d = yaml.safe_load(micro(tmp_path).read_text())
    d["monitor"]["tensorboard"] = True
    on = parse_spec(d, str(tmp_path / "micro.yaml"))
    if not tracker.available():  # the locks leave it out: one clear refusal, naming the field
        with pytest.raises(SpecError, match="micro.yaml: field 'monitor.tensorboard'.*pip "
                                            "install tensorboard"):
            tracker.open_tracker(on, tmp_path)
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415 - optional

    t = tracker.open_tracker(on, tmp_path)
    t.log(row, 250.0)
    t.log({**row, "step": 4, "loss": 6.0}, 260.0)
    t.close()
    acc = EventAccumulator(str(tmp_path / tracker.EVENTS_DIR))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 6.5), (4, 6.0)]
    assert acc.Scalars("draft_acc/k3")[0].value == 0.25


def test_audit_says_what_it_checks_and_lists_the_unpinned_extras(capsys):
    r = audit(lock=str(REPO / "envs" / "cpu-py311.lock"))
    pinned = set(locked_pins(REPO / "envs" / "cpu-py311.lock"))
    assert r["packages_checked"] == len(pinned)
    assert "dflash-pipeline" in r["extras"] and not set(r["extras"]) & pinned
    assert r["packages_installed"] >= r["packages_checked"] + len(r["extras"]) - r["packages_differ"]
    render(r)
    out = capsys.readouterr().out
    assert f"each of its {len(pinned)} pinned packages must be installed at exactly its version" \
        in out.replace("\n", " ") and "not pinned (not checked: " in out.replace("\n", " ")


def test_warmup_heartbeat_prints_while_the_block_runs(capsys):
    with heartbeat(lambda s: f"[warmup] still compiling ({s:.1f}s in)", every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and all(ln.startswith("[warmup] still compiling (") for ln in lines)
    time.sleep(0.15)
    assert capsys.readouterr().out == ""  # stopped with the block
