"""End to end: the real DAG through Snakemake on the micro spec, then what reruns after edits.

One full run (env → warmup → data → train → bench, started in the background with the session:
tests/conftest.py) is shared by the module; each edit test
asks Snakemake (dry run, the same decision a real run makes) which stages it would rerun, and
the failure test runs the stages for real.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys

import pytest
import yaml

from dflash.artifacts.manifest import read_manifest, write_manifest
from dflash.runtime.harness import REPO, copy_workflow, job_counts, snakemake, stage_env

pytestmark = pytest.mark.e2e


def _prepare(tmp):
    return copy_workflow(tmp, [REPO / "tests" / "specs" / "micro.yaml"])


BACKGROUND_DAG = (_prepare, ["bench_micro"])  # started with the session (tests/conftest.py)


@pytest.fixture(scope="module")
def wf(background_dag):
    wf, rc, out = background_dag
    assert rc == 0, out[-6000:]
    assert job_counts(out) == {"env": 1, "warmup": 1, "data": 1, "train": 1, "bench": 1}
    return wf


@contextlib.contextmanager
def _rewritten(path, fn):
    """``path`` with its text replaced by ``fn(text)``, restored afterwards."""
    original = path.read_text()
    path.write_text(fn(original))
    try:
        yield
    finally:
        path.write_text(original)


def _edited(wf, fn):
    """The micro spec with ``fn`` applied to its fields, restored afterwards."""
    def edit(text):
        d = yaml.safe_load(text)
        fn(d)
        return yaml.safe_dump(d)

    return _rewritten(wf / "specs" / "micro.yaml", edit)


def _would_run(wf) -> dict:
    r = snakemake(wf, "-n", "bench_micro")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return job_counts(r.stdout + r.stderr)


def test_full_dag_artifacts(wf):
    res = wf / "results" / "micro"
    for stage in ("env", "warmup", "data", "train"):
        m = json.loads((res / stage / "manifest.json").read_text())
        assert m["stage"] == stage and m["manifest_version"] == 1
        # the GPU stages record their devices' peak memory: none on a CPU spec
        assert stage == "env" or m["peak_device_memory"] == {}, (stage, m.get("peak_device_memory"))
    train = json.loads((res / "train" / "manifest.json").read_text())
    assert train["gate"]["recompiles_after_warmup"] == 0
    assert train["gate"]["race_errors"] == 0
    assert train["replicas"] == 2 and train["replicas_identical"] is True
    assert train["exactly_once"]["0"]["exactly_once"] is True
    # per-position draft accuracy is logged with the loss: block 4 -> positions 1..3
    rows = [json.loads(x) for x in (res / "train" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["draft_acc"]) == 3 for r in rows)
    assert all(a is None or 0.0 <= a <= 1.0 for r in rows for a in r["draft_acc"])
    # the τ monitor (monitor.tau_every_steps: 3) logged at steps 3 and 6
    assert [r["step"] for r in rows if "tau_heldout" in r] == [2, 5]
    assert all(r["tau_heldout"] >= 1.0 for r in rows if "tau_heldout" in r)
    # the live status carries each worker's busy fraction (how a user sees an idling drafter)
    status = json.loads((res / "train" / "status.json").read_text())
    assert status["phase"] == "done"
    assert set(status["busy"]) >= {"drafter-0", "drafter-1", "target-0"}
    assert all(0.0 < f <= 1.0 for f in status["busy"].values())
    warm = json.loads((res / "warmup" / "manifest.json").read_text())
    assert {(c["replica"], c["bucket"]) for c in warm["compiled"]} == {(0, 256), (1, 256)}
    cfg = json.loads((res / "train" / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    report = json.loads((res / "bench" / "report.json").read_text())
    # values, not key presence: the throughput is the train stage's steady state, the MFUs
    # are fractions of the measured CPU peak, the gate figures are the train manifest's
    assert report["tokens_per_s"] == train["steady_state"]["tokens_per_s"] > 0
    assert report["samples_per_s"] > 0 and report["race_errors"] == 0
    assert 0.0 < report["target_mfu"] < 2.0 and 0.0 < report["drafter_mfu"] < 2.0
    assert report["peak"]["device"] == "cpu" and report["peak"]["flops_per_s"] > 1e8
    assert report["peak"]["datasheet"] is None and report["mfu_datasheet"] is None  # CPU
    assert 0.0 < report["target_busy_fraction"] <= 1.0
    assert report["step_time"]["steps"] == train["steps"]["run_now"]
    assert report["time_to_first_step_s"] == train["time_to_first_step_s"] > 0
    assert report["recompiles_after_warmup"] == 0 and report["gate_wait_s"] >= 0.0
    assert report["tau"] is None and report["acceptance"]["skipped"]  # micro: eval_prompts 0
    assert report["env_drift_overridden"] == []
    # sizing figures: per-worker rates, the anchor recommendation; the hardware says CPU
    bal = report["balance"]
    assert bal["target_tokens_per_s_per_gpu"] > 0 and bal["drafter_tokens_per_s_per_gpu"] > 0
    assert 0.0 <= bal["drafter_idle_fraction"] < 1.0
    assert 1 <= bal["anchors"]["recommended_max_anchors"] <= 256  # micro: token_budget 256
    assert report["hardware"] == {"accelerator": "cpu", "gpu_count": 0, "gpus": [],
                                  "driver": None, "note": "CPU run: no GPU in the topology"}
    md = (res / "bench" / "report.md").read_text()
    assert md.startswith("# DFlash bench report")
    assert "## Worker balance" in md and "CPU run: no GPU in the topology" in md
    for stage in ("env", "warmup", "data", "train", "bench"):
        assert (wf / "logs" / "micro" / f"{stage}.log").stat().st_size > 0
        bench = (wf / "benchmarks" / "micro" / f"{stage}.tsv").read_text().splitlines()
        assert bench[0].split("\t")[:2] == ["s", "h:m:s"] and float(bench[1].split("\t")[0]) > 0
    for png in ("loss.png", "throughput.png", "draft_accuracy.png", "tau_training.png",
                "acceptance.png", "tau_by_category.png"):
        assert (res / "bench" / png).stat().st_size > 1000  # declared outputs, always written


def test_report_holds_the_plots_with_their_captions(wf):
    r = snakemake(wf, "--report", "report.html", "bench_micro")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    html = (wf / "report.html").read_text()
    for name in ("loss.png", "throughput.png", "draft_accuracy.png", "tau_training.png",
                 "acceptance.png", "tau_by_category.png", "report.md", "report.json"):
        assert name in html, name
    for caption in ("Training loss per step", "Target tokens per second", "Top-1 draft accuracy",
                    "per-position top-1 draft accuracy on training batches",
                    "Simulated acceptance by block position", "per MT-Bench category"):
        assert caption in html, caption


@pytest.mark.parametrize("config, message", [
    ("resultz=out", "Additional properties are not allowed ('resultz' was unexpected)"),
    ("default_spec=nope", "default_spec 'nope' is not a spec in specs/"),
    ("gpu_jobs=0", "0 is less than the minimum of 1"),
    ("gpu_memory_gb=-1", "-1 is less than the minimum of 0"),
])
def test_bad_config_is_refused_before_anything_runs(wf, config, message):
    r = snakemake(wf, "-n", "--config", config)
    assert r.returncode != 0 and message in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr


def test_gpu_jobs_hold_the_devices_their_spec_names(tmp_path, micro_spec):
    """GPU resources come from the specs only: a job holds each CUDA device its spec names."""
    gpu = copy_workflow(tmp_path, [micro_spec, REPO / "specs" / "qwen3-8b-2gpu.yaml"])
    r = snakemake(gpu, "-n", "train_qwen3-8b-2gpu")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "gpu=" in ln]
    # train also carries `launch` (empty here: srun only for a multi-node job on SLURM)
    res = [ln.removesuffix(", launch=") for ln in res]
    assert len(res) == 4 and set(res) == {"resources: tmpdir=/tmp, gpu=2, cuda_0=3, cuda_1=3"}, res


def test_nothing_reruns_when_nothing_changed(wf):
    assert _would_run(wf) == {}


def test_touching_the_lock_reruns_nothing(wf):
    (wf / "envs" / "cpu-py311.lock").touch()  # mtime only: content decides
    assert _would_run(wf) == {}


def test_lr_change_reruns_train_and_bench_only(wf):
    with _edited(wf, lambda d: d["optim"].update(lr=5e-4)):
        assert _would_run(wf) == {"train": 1, "bench": 1}


def test_block_size_change_reruns_warmup_train_bench(wf):
    with _edited(wf, lambda d: d["drafter"].update(block_size=8)):
        assert _would_run(wf) == {"warmup": 1, "train": 1, "bench": 1}


def test_report_template_edit_reruns_bench_only(wf):
    with _rewritten(wf / "dflash" / "templates" / "report.md.j2", lambda t: t + "\n{# edited #}\n"):
        assert _would_run(wf) == {"bench": 1}


@pytest.mark.parametrize("module, reruns", [
    ("train/scheduler.py", {"train": 1, "bench": 1}),  # the training pipeline (bench's timed run too)
    ("train/packing.py", {"warmup": 1, "train": 1, "bench": 1}),  # warmup builds its buckets
    ("train/books.py", {"train": 1, "bench": 1}),  # the trainer's books (bench's timed run too)
    ("eval/report.py", {"bench": 1}),  # the report module: bench only
])
def test_module_edit_reruns_every_stage_that_imports_it(wf, module, reruns):
    with _rewritten(wf / "dflash" / module, lambda t: t + "\n_EDITED = 1\n"):
        assert _would_run(wf) == reruns


def test_comment_or_docstring_edit_reruns_nothing(wf):
    """Code fingerprints hash what runs: a comment in artifacts/manifest.py (every stage imports it) or a
    reworded docstring reruns no stage."""
    with _rewritten(wf / "dflash" / "artifacts" / "manifest.py", lambda t: t + "\n# a note\n"), \
            _rewritten(wf / "dflash" / "train" / "scheduler.py",
                       lambda t: t.replace('"""', '"""Reworded. ', 1)):
        assert _would_run(wf) == {}


@contextlib.contextmanager
def _damaged(path, fn, manifest):
    """``path`` damaged by ``fn(bytes)``; afterwards restored, and ``manifest`` put back if a
    check set it aside."""
    original = path.read_bytes()
    path.write_bytes(fn(original))
    try:
        yield
    finally:
        # the spec's own manifest, or the shared copy's its folder links to (rules/share.smk)
        shared = manifest.parents[2] / ".shared"
        for aside in [manifest.with_name(manifest.name + ".damaged"),
                      *shared.glob(f"{manifest.parent.name}-*/*/manifest.json.damaged")]:
            if aside.exists():
                aside.replace(aside.with_name("manifest.json"))
        path.write_bytes(original)


def _flip(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1:]


@pytest.mark.parametrize("damage, manifest, reruns", [
    ("train/drafter/model.safetensors", "train", {"train": 1, "bench": 1}),
    ("train/drafter/config.json", "train", {"train": 1, "bench": 1}),
    ("data/dataset.parquet", "data", {"data": 1, "train": 1, "bench": 1}),
    ("data/manifest.json", "data", {"data": 1, "train": 1, "bench": 1}),
])
def test_damaged_artifact_is_seen_by_snakemake(wf, damage, manifest, reruns):
    """A flipped byte in a produced file: `snakemake -n` itself shows its producer (and what
    follows) rerunning, and says which file, with no --forcerun."""
    res = wf / "results" / "micro"
    with _damaged(res / damage, _flip, res / manifest / "manifest.json"):
        r = snakemake(wf, "-n", "bench_micro")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert job_counts(r.stdout + r.stderr) == reruns
        # the file by name: the spec's own, or the shared copy its folder holds hard links to
        assert f"results/micro/{damage}" in r.stderr or (
            f"/{damage}: damaged" in r.stderr
            and f"results/micro/{manifest}/ holds hard links" in r.stderr), r.stderr[-2000:]
        assert f"so Snakemake reruns the {manifest} stage" in r.stderr, r.stderr[-2000:]
        assert "bench_micro`" in r.stderr, r.stderr[-2000:]  # the command for this spec
    assert _would_run(wf) == {}  # restored


def test_bench_refuses_a_damaged_drafter_in_one_line(wf):
    """The consumer's own check (a run outside Snakemake): one line naming the file, and the
    train manifest set aside, so the next `snakemake` reruns train."""
    res = wf / "results" / "micro"
    weights = res / "train" / "drafter" / "model.safetensors"
    with _damaged(weights, _flip, res / "train" / "manifest.json"):
        r = subprocess.run([sys.executable, "-m", "dflash", "bench", "specs/micro.yaml"],
                           cwd=wf, capture_output=True, text=True, timeout=300,
                           env={**__import__("os").environ, "PYTHONPATH": str(wf)})
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        assert len(err) == 1 and err[0].startswith(
            "error: results/micro/train/drafter/model.safetensors: damaged (sha256 "), err
        assert "so Snakemake reruns the train stage: `snakemake --cores all bench_micro`" \
            in err[0]
        assert not (res / "train" / "manifest.json").exists()
    assert _would_run(wf) == {}


def test_lock_content_change_reruns_everything(wf):
    lock = wf / "envs" / "cpu-py311.lock"
    original = lock.read_text()
    lock.write_text(original + "# regenerated\n")
    try:
        assert _would_run(wf) == {"env": 1, "warmup": 1, "data": 1, "train": 1, "bench": 1}
    finally:
        lock.write_text(original)


def test_stale_warmup_manifest_is_refused(wf):
    """Change a shape field behind Snakemake's back: train refuses the old warmup manifest."""
    with _edited(wf, lambda d: d["batching"].update(max_anchors=8)):
        r = subprocess.run([sys.executable, "-m", "dflash", "train", "specs/micro.yaml"],
                           cwd=wf, capture_output=True, text=True, timeout=300,
                           env={**__import__("os").environ, "PYTHONPATH": str(wf)})
        assert r.returncode != 0
        assert "fingerprints.shape" in r.stderr and "Traceback" not in r.stderr


def test_drifted_env_is_refused_by_every_stage_and_the_override_recorded(wf, tmp_path):
    """Pin another version of one package in the env manifest (as if the interpreter had been
    upgraded under the run): warmup, data, train and bench each refuse to start, naming the
    package with both versions and writing nothing; with DFLASH_ALLOW_DRIFT=1 each runs and
    records what drifted in its manifest (the bench: its report.json and report.md)."""
    copy = tmp_path / "wf"
    shutil.copytree(wf, copy, ignore=shutil.ignore_patterns(".snakemake", "__pycache__"))
    res = copy / "results" / "micro"
    env_path = res / "env" / "manifest.json"
    env = read_manifest(env_path, "env")
    pkg = "pyyaml" if "pyyaml" in env["pinned"] else sorted(env["pinned"])[0]
    live = env["pinned"][pkg]
    env["pinned"][pkg] = "0.0.1"
    keep = {k: v for k, v in env.items() if k not in ("manifest_version", "stage",
                                                      "created_unix", "fingerprints", "checksum")}
    write_manifest(env_path, "env", fingerprints=env["fingerprints"], **keep)
    outputs = {"warmup": res / "warmup" / "manifest.json", "data": res / "data" / "manifest.json",
               "train": res / "train" / "manifest.json", "bench": res / "bench" / "report.json"}
    before = {s: p.read_bytes() for s, p in outputs.items()}

    def stage(name, **extra):
        return subprocess.run([sys.executable, "-m", "dflash", name, "specs/micro.yaml"],
                              cwd=copy, capture_output=True, text=True, timeout=600,
                              env={**stage_env(copy), **extra})

    for name in outputs:
        r = stage(name)
        assert r.returncode == 2, (name, r.stderr[-2000:])       # DFlashError, not a crash
        assert f"{pkg}: pinned 0.0.1, found {live}" in r.stderr, (name, r.stderr[-2000:])
        assert "environment drift" in r.stderr and "DFLASH_ALLOW_DRIFT=1 overrides" in r.stderr
        assert "Traceback" not in r.stderr, name
    assert {s: p.read_bytes() for s, p in outputs.items()} == before   # nothing written
    want = [{"kind": "package", "name": pkg, "pinned": "0.0.1", "found": live}]
    for name, path in outputs.items():
        r = stage(name, DFLASH_ALLOW_DRIFT="1")
        assert r.returncode == 0, (name, r.stderr[-3000:])
        assert "proceeding DESPITE environment drift" in r.stderr, name
        assert json.loads(path.read_text())["env_drift_overridden"] == want, name
    md = (res / "bench" / "report.md").read_text()
    assert f"environment drift overridden (`DFLASH_ALLOW_DRIFT=1`)**: {pkg} pinned 0.0.1, " \
           f"found {live}" in md


def test_code_edits_redo_the_work_and_a_failed_train_resumes(wf):
    """Edit the generation code and the training code (real statements, not comments), with a
    fault injected into training: the data stage generates the answers again (its shards were
    made by other code), train starts over and says why, then fails at step 3 with its one line;
    the rerun runs train and bench only, resumes train from its step-2 checkpoint, finishes all
    its steps, and the bench report has figures. (One edited run for both: the failed run is the
    code edit's run, so the DAG trains once from scratch instead of twice.) Last in the module:
    it leaves results made by the edited code."""
    res = wf / "results" / "micro"
    edit = lambda t: t + "\n_EDITED = 1\n"  # noqa: E731
    with _rewritten(wf / "dflash" / "data" / "generate.py", edit), \
            _rewritten(wf / "dflash" / "train" / "scheduler.py", edit):
        r = snakemake(wf, "bench_micro", env={"DFLASH_FAIL_AT": "drafter-1:3"})
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-3000:]
        log = (wf / "logs" / "micro" / "train.log").read_text().strip().splitlines()
        assert "drafter-1" in "\n".join(log[-5:]) and "what to do" in log[-1]
        # the failed run's train log, before the rerun replaces it (the stages tee it to stdout)
        assert "[train] starting over from step 0" in out, out[-3000:]
        assert "the train stage's code changed (code " in out, out[-3000:]
        data_log = (wf / "logs" / "micro" / "data.log").read_text()
        # the data store entry is keyed by the data code too (rules/share.smk): edited code is a
        # new entry, generated from scratch; a stage run by hand on the old folder discards its
        # shards instead ("made by other code", test_data.py)
        assert "wrote results/.shared/data-" in data_log, data_log
        assert len(list((res.parent / ".shared").glob("data-*"))) >= 2  # the old entry stays
        data = json.loads((res / "data" / "manifest.json").read_text())
        assert data["generation"]["chunks_resumed"] == 0
        assert data["generation"]["new_tokens_generated"] > 0
        r = snakemake(wf, "bench_micro")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert job_counts(r.stdout + r.stderr) == {"train": 1, "bench": 1}, r.stdout[-3000:] + r.stderr[-3000:]
        train = json.loads((res / "train" / "manifest.json").read_text())
        # checkpoint every 2 steps; failed at step 3: the rest of the 6 steps run now
        assert train["steps"]["resumed_from"] == 2 and train["steps"]["run_now"] == 4
        # the exactly-once record covers the steps before the resume too (from the checkpoint)
        epochs = {json.loads(x)["epoch"] for x in
                  (res / "train" / "metrics.jsonl").read_text().splitlines()}
        assert set(train["exactly_once"]) == {str(e) for e in epochs}
        assert train["exactly_once"]["0"] == {"samples": 12, "distinct": 12, "duplicates": 0,
                                              "complete": True, "exactly_once": True}
        assert train["final_loss"] is not None
        report = json.loads((res / "bench" / "report.json").read_text())
        assert report["tokens_per_s"] > 0 and report["final_loss"] is not None
        status = json.loads((res / "train" / "status.json").read_text())
        assert status["step"] == 6
    # reverting the edit is a code change too: train and bench would run again; the data stage
    # would not, because the store still holds the entry of the original code (shared by content)
    assert _would_run(wf) == {"train": 1, "bench": 1}
