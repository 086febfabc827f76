"""kill -9 and resume, for real: the train stage (under Snakemake and alone) and the data stage.

One workflow copy with a micro-derived spec (24 steps, a checkpoint every 3, data in 6 chunks of
2); Snakemake makes env → warmup → data once. Then:

* a reference: one uninterrupted train run (own results root) → weights, optimizer state, the
  sample ids consumed at every step (neither it nor the DAG before it is killed or timed, so
  both run in the background lane with the session: tests/conftest.py);
* a kill sequence on the Snakemake results root: the stage started by ``snakemake train_<spec>``
  is SIGKILLed right after its first checkpoint; the same stage command is then started alone
  and SIGKILLed during startup, mid-training, and right after a later checkpoint, whose
  ``model.safetensors`` is then corrupted; the same Snakemake command finishes the run. It must
  run only ``train``, report the corrupted checkpoint, resume from the previous good one and end
  bit-identical (weights and optimizer state) to the reference, with the consumed ids — rebuilt
  from each killed run's own metrics — equal to the reference step by step (nothing lost,
  nothing repeated, every epoch each sample exactly once);
* the data stage SIGKILLed after its first shard appears: the rerun says it resumed and writes
  the very dataset an uninterrupted run wrote (same sha256).

The machinery is :mod:`dflash.runtime.faults`, shared with ``bench/fault_injection.py`` (the N >= 20
random-kill benchmark).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash.runtime import faults as fi
from dflash.runtime.harness import copy_workflow, job_counts, snakemake
from dflash.train import checkpoint as ckpt

pytestmark = pytest.mark.e2e

SPEC = "resume"
STEPS, EVERY = 24, 3


def _prepare(tmp: Path) -> Path:
    wf = copy_workflow(tmp, [])
    spec = fi.derived_spec(SPEC, STEPS, EVERY, keep=2, gen_batch_size=2)
    (wf / "specs" / f"{SPEC}.yaml").write_text(yaml.safe_dump(spec))
    return wf


def _in_background(folder: str) -> None:
    """The background command (~40 s on 2 cores): the workflow copy in ``folder``, env -> warmup
    -> data through Snakemake (what fi.prepare runs), then the reference run in its own results
    root; the kills and resumes run in the foreground."""
    wf = _prepare(Path(folder))
    r = snakemake(wf, f"data_{SPEC}", f"warmup_{SPEC}")
    if r.returncode != 0:
        raise SystemExit(f"snakemake failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    w = fi.Workflow(wf, SPEC)
    fi.reference(w, "results_ref", _logs(w))


BACKGROUND_CMD = (lambda tmp: tmp, ["-m", "tests.test_resume", "{folder}"])


def _logs(w: fi.Workflow) -> Path:
    d = w.wf / "test-logs"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="module")
def w(background_cmd) -> fi.Workflow:
    wf, rc, out = background_cmd
    assert rc == 0, out[-6000:]
    return fi.Workflow(wf, SPEC)


@pytest.fixture(scope="module")
def logs(w) -> Path:
    return _logs(w)


@pytest.fixture(scope="module")
def ref(w) -> dict:
    return fi.reference_result(w, "results_ref")  # the background's reference run


def _stage_pids(root_pid: int, stage: str) -> list[int]:
    """Descendants of ``root_pid`` running ``python -m dflash <stage>``."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            try:
                argv = (Path("/proc") / str(c) / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"dflash" in argv and stage.encode() in argv and b"-m" in argv:
                out.append(c)
    return out


def _start_snakemake(w: fi.Workflow, target: str, log: Path) -> fi.Run:
    env = fi.stage_env(w.wf)
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", target]
    fh = open(log, "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=w.wf, env=env, stdout=fh, stderr=subprocess.STDOUT,
                         start_new_session=True)
    fh.close()
    return fi.Run(p, t0, log, cmd)


def _corrupt(path: Path) -> None:
    """Flip bytes in the middle of the file (the size stays the same)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def killed(w, ref, logs) -> dict:
    """The kill sequence on the Snakemake results root (see the module docstring)."""
    root = "results"
    td = w.train_dir(root)
    stage_log = w.wf / "logs" / SPEC / "train.log"
    runs = []  # (resumed_from, metrics snapshot) of every run that got past its resume decision
    kills = []

    def snapshot() -> dict:
        return fi.metrics_steps(td / "metrics.jsonl")

    # 1. under Snakemake: kill the stage process right after its first checkpoint
    sm = _start_snakemake(w, f"train_{SPEC}", logs / "snakemake-1.log")
    assert fi.wait_until(lambda: fi.newest_checkpoint(td) >= EVERY, sm), sm.text()[-3000:]
    pids = _stage_pids(sm.proc.pid, "train")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    assert sm.wait() != 0  # Snakemake reports the failed job and stops
    kills.append({"where": "snakemake, after the first checkpoint",
                  "newest_checkpoint": fi.newest_checkpoint(td),
                  "step_reached": fi.max_step(td / "metrics.jsonl")})
    runs.append((0, snapshot()))

    # 2.-4. the same stage command alone: during startup, mid-training, after a checkpoint
    plans = [
        ("startup", lambda run, start: "[train] spec" in run.text()),
        ("mid-training", lambda run, start: fi.max_step(td / "metrics.jsonl") >= 10),
        ("right after a checkpoint", lambda run, start: fi.newest_checkpoint(td) >= 15),
    ]
    for i, (where, cond) in enumerate(plans):
        run = w.start("train", root, logs / f"kill-{i + 2}.log")
        before = fi.newest_checkpoint(td)
        assert fi.wait_until(lambda: cond(run, before), run), run.text()[-3000:]
        assert run.alive(), f"{where}: the run ended before its kill\n{run.text()[-3000:]}"
        run.kill()
        kills.append({"where": where, "newest_checkpoint": fi.newest_checkpoint(td),
                      "step_reached": fi.max_step(td / "metrics.jsonl"),
                      "resumed_from": run.resumed_from(), "decided": fi.decided(run),
                      "expected_start": before})
        if fi.decided(run):
            runs.append((run.resumed_from(), snapshot()))

    # the newest checkpoint gets corrupted; the previous one must be used
    ckpts = fi.checkpoints(td)
    assert len(ckpts) >= 2, ckpts  # (3 when the kill came between a save and its pruning)
    corrupted = td / "checkpoints" / f"step-{ckpts[-1][0]:08d}"
    _corrupt(corrupted / "model.safetensors")

    # 5. the same Snakemake command finishes the run
    r = snakemake(w.wf, f"train_{SPEC}")
    final_log = stage_log.read_text()
    manifest = json.loads((td / "manifest.json").read_text())
    runs.append((manifest["steps"]["resumed_from"], fi.metrics_steps(td / "metrics.jsonl")))
    return {"kills": kills, "runs": runs, "final": r, "final_log": final_log,
            "manifest": manifest, "corrupted": corrupted, "previous": ckpts[-2][0],
            "td": td}


def test_reference_run_sees_every_sample_once_per_epoch(w, ref):
    ids = sorted(fi.dataset_ids(w))
    epochs: dict[int, list[int]] = {}
    for r in ref["metrics"].values():
        epochs.setdefault(r["epoch"], []).extend(r["sample_ids"])
    assert sorted(ref["metrics"]) == list(range(STEPS))
    assert len(epochs) >= 3 and fi.epochs_exactly_once(
        {e: sorted(v) for e, v in epochs.items()}, ids)


def test_killed_runs_resume_from_the_newest_good_checkpoint(killed):
    kills = killed["kills"]
    assert len(kills) >= 3
    # each kill landed at a different moment of the run
    assert len({(k["step_reached"], k["newest_checkpoint"]) for k in kills}) >= 3, kills
    for k in kills[1:]:
        if k["decided"]:
            assert k["resumed_from"] == k["expected_start"], kills
    assert not kills[1]["decided"]  # the startup kill came before the resume decision


def test_snakemake_rerun_runs_only_train_and_resumes(killed):
    r = killed["final"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert job_counts(r.stdout + r.stderr) == {"train": 1}, r.stdout[-3000:] + r.stderr[-3000:]
    assert killed["manifest"]["steps"]["resumed_from"] > 0
    assert killed["manifest"]["steps"]["resumed_from"] == killed["previous"]
    assert killed["manifest"]["replicas_identical"] is True


def test_corrupted_latest_checkpoint_is_reported_and_the_previous_used(killed):
    log = killed["final_log"]
    name = killed["corrupted"].name
    assert f"{name} is corrupted (model.safetensors checksum mismatch)" in log, log[-3000:]
    assert f"step-{killed['previous']:08d} (step {killed['previous']}/{STEPS})" in log, log[-3000:]


def test_resumed_weights_and_optimizer_are_bit_identical(killed, ref):
    got_w, got_o = fi.final_tensors(killed["td"])
    ok, bad = fi.tensors_equal(ref["tensors"][0], got_w)
    assert ok and len(got_w) > 0, f"drafter tensors differ: {bad}"
    ok, bad = fi.tensors_equal(ref["tensors"][1], got_o)
    assert ok and len(got_o) > 0, f"optimizer tensors differ: {bad}"


def test_consumed_samples_equal_one_uninterrupted_run(killed, ref, w):
    runs = killed["runs"]
    segments = [(start, runs[i + 1][0] if i + 1 < len(runs) else STEPS, steps)
                for i, (start, steps) in enumerate(runs)]
    got = fi.stitch(segments)
    cmp = fi.compare_ids(ref["metrics"], got)
    assert cmp["samples_lost"] == 0 and cmp["samples_duplicated"] == 0, cmp
    assert cmp["steps_identical"]
    assert fi.epochs_exactly_once(cmp["epochs"], fi.dataset_ids(w))
    # the final metrics.jsonl (cut back to the resume step, then continued) agrees too
    final = {s: r["sample_ids"] for s, r in fi.metrics_steps(killed["td"] / "metrics.jsonl").items()}
    assert final == {s: r["sample_ids"] for s, r in ref["metrics"].items()}



def test_resumed_run_proves_exactly_once_over_the_whole_run(killed, ref, w):
    """The exactly-once record covers every epoch of the run, not only the steps since the last
    resume (it travels in the checkpoints): the resumed run's record equals the uninterrupted
    run's, and every epoch run whole saw each sample exactly once."""
    once = killed["manifest"]["exactly_once"]
    epochs = {str(r["epoch"]) for r in ref["metrics"].values()}
    assert set(once) == epochs and len(epochs) >= 3, once
    assert once == ref["manifest"]["exactly_once"]
    n = len(fi.dataset_ids(w))
    whole = {e: v for e, v in once.items() if v["samples"] >= n}
    assert len(whole) >= 2 and all(v["exactly_once"] and v["distinct"] == n
                                   for v in whole.values()), once


def test_corrupt_or_truncated_checkpoints_are_skipped(ref, w, tmp_path):
    """checkpoint.latest_good on copies: a truncated file, a torn state.json, flipped bytes."""
    src = w.train_dir("results_ref") / "checkpoints"
    steps = sorted(src.glob("step-*"))
    assert len(steps) == 2
    for damage in ("truncate", "torn_state", "flip"):
        d = tmp_path / damage
        shutil.copytree(src, d)
        newest = d / steps[-1].name
        if damage == "truncate":
            f = newest / "optim.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
        elif damage == "torn_state":
            f = newest / "state.json"
            f.write_text(f.read_text()[:40])
        else:
            _corrupt(newest / "model.safetensors")
        said = []
        path, state = ckpt.latest_good(d, log=said.append)
        assert path.name == steps[0].name and state["step"] == int(steps[0].name[5:])
        assert len(said) == 1 and str(newest) in said[0] and "corrupted" in said[0]


def test_killed_data_stage_resumes_to_the_same_dataset(w, logs):
    """SIGKILL after the first shard; the rerun keeps the shards, says so, and writes the same
    dataset an uninterrupted run (Snakemake's, in results/) wrote."""
    ref_manifest = json.loads((w.res("results") / "data" / "manifest.json").read_text())
    n_chunks = ref_manifest["generation"]["chunks"]
    assert n_chunks >= 4
    root = w.fresh_root("results_data", stages=("env",))
    shards = w.res(root) / "data" / "shards"
    run = w.start("data", root, logs / "data-kill.log")
    assert fi.wait_until(lambda: any(shards.glob("part-*.parquet")), run, poll=0.005), \
        run.text()[-3000:]
    run.kill()
    at_kill = sorted(p.name for p in shards.glob("part-*.parquet"))
    assert 1 <= len(at_kill) < n_chunks, at_kill
    assert not (w.res(root) / "data" / "manifest.json").exists()

    run = w.start("data", root, logs / "data-resume.log")
    assert run.wait() == 0, run.text()[-3000:]
    text = run.text()
    assert "resuming: " in text and f"{len(at_kill)} chunk(s) already done" in text, text
    m = json.loads((w.res(root) / "data" / "manifest.json").read_text())
    assert m["generation"]["chunks_resumed"] == len(at_kill)
    assert m["dataset"]["sha256"] == ref_manifest["dataset"]["sha256"]
    assert m["dataset"]["rows"] == ref_manifest["dataset"]["rows"]


if __name__ == "__main__":
    _in_background(sys.argv[1])
