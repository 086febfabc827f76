"""Fault injection. The in-process test hooks the stages call (:func:`injected_failures`, from
``DFLASH_FAIL_AT``; :func:`on_shard` / :func:`shard_written`), so every stage is exactly
``run(ctx)``; and kill -9 and resume, the machinery: stage processes started (and killed) in a
workflow copy exactly as Snakemake starts them, and readers of what a killed run left behind
(metrics, checkpoints, tensors, the sample ids consumed per step). ``tests/test_resume.py`` (a
few kills) and ``bench/fault_injection.py`` (N >= 20 seeded random kills) share it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow.parquet as pq
import torch
import yaml
from safetensors.torch import load_file

from .. import settings
from .harness import REPO, copy_workflow, snakemake, stage_env


# ---------------------------------------------------------------------------------------------
# in-process hooks (the stages call these; tests set them)
# ---------------------------------------------------------------------------------------------
def injected_failures(rank: int | None = None) -> dict[str, int]:
    """Test hook: DFLASH_FAIL_AT="drafter-0:3,target-0:5" makes that worker raise at that step
    (failure-propagation and rerun-after-failure tests use it on the real stage);
    "drafter-0:3@1": on rank 1 only (topology.nodes > 1)."""
    out = {}
    for part in filter(None, settings.fail_at().split(",")):
        part, _, on_rank = part.partition("@")
        if on_rank and int(on_rank) != (rank or 0):
            continue
        name, _, step = part.partition(":")
        out[name.strip()] = int(step)
    return out


_SHARD_HOOKS: list[Callable[[int, Path], None]] = []


@contextlib.contextmanager
def on_shard(fn: Callable[[int, Path], None]) -> Iterator[None]:
    """Test hook: ``fn(chunk_index, path)`` runs after each data shard is written, inside the
    block (tests record the chunks generated, or raise to simulate a kill mid-stage)."""
    _SHARD_HOOKS.append(fn)
    try:
        yield
    finally:
        _SHARD_HOOKS.remove(fn)


def shard_written(chunk: int, path: Path) -> None:
    """The data stage wrote shard ``chunk`` at ``path``: run the hooks of :func:`on_shard`."""
    for fn in list(_SHARD_HOOKS):
        fn(chunk, path)


RESUME_RE = re.compile(r"\[train\] resuming from (\S+) \(step (\d+)/(\d+)\)")
CORRUPT_RE = re.compile(r"\[train\] checkpoint (\S+) is corrupted")


# ---------------------------------------------------------------------------------------------
# the workflow copy and the stage processes
# ---------------------------------------------------------------------------------------------
def derived_spec(name: str, max_steps: int, every_steps: int, keep: int = 2,
                 **data: object) -> dict:
    """tests/specs/micro.yaml with another name, step count and checkpoint interval."""
    d = yaml.safe_load((REPO / "tests" / "specs" / "micro.yaml").read_text())
    d["name"] = name
    d["optim"]["max_steps"] = max_steps
    d["checkpoint"] = {"every_steps": every_steps, "keep": keep}
    d["data"].update(data)
    return d


@dataclass
class Workflow:
    wf: Path
    spec: str

    def spec_file(self) -> str:
        return f"specs/{self.spec}.yaml"

    def res(self, root: str) -> Path:
        return self.wf / root / self.spec

    def train_dir(self, root: str) -> Path:
        return self.res(root) / "train"

    def fresh_root(self, root: str, stages=("env", "warmup", "data")) -> str:
        """A results root holding copies of the upstream stages made by Snakemake."""
        shutil.rmtree(self.wf / root, ignore_errors=True)
        for st in stages:
            shutil.copytree(self.res("results") / st, self.res(root) / st)
        return root

    def start(self, stage: str, root: str, log: Path) -> "Run":
        cmd = [sys.executable, "-m", "dflash", stage, self.spec_file(), "--results", root]
        fh = open(log, "w")
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=self.wf, env=stage_env(self.wf), stdout=fh,
                             stderr=subprocess.STDOUT, start_new_session=True)
        fh.close()
        return Run(p, t0, log, cmd)


def prepare(base: Path, spec: dict, stages=("data", "warmup")) -> Workflow:
    """Copy the workflow, add the spec, run env → warmup → data once through Snakemake."""
    base.mkdir(parents=True, exist_ok=True)
    wf = copy_workflow(base, [])
    (wf / "specs" / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    r = snakemake(wf, *[f"{st}_{spec['name']}" for st in stages])
    if r.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return Workflow(wf, spec["name"])


@dataclass
class Run:
    proc: subprocess.Popen
    t0: float
    log: Path
    cmd: list
    killed_at: float | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL the stage's process group (the stage and anything it started)."""
        t = time.time()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.killed_at = t
        return t

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def resumed_from(self) -> int:
        m = RESUME_RE.search(self.text())
        return int(m.group(2)) if m else 0


def wait_until(pred, run: Run, timeout: float = 300, poll: float = 0.01) -> bool:
    """Poll ``pred()`` until true (→ True) or the process exits first (→ False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        if not run.alive():
            return bool(pred())
        time.sleep(poll)
    raise TimeoutError(f"condition not met within {timeout}s; log:\n{run.text()[-2000:]}")

# ---------------------------------------------------------------------------------------------
# reading what a run left behind
# ---------------------------------------------------------------------------------------------
def metrics_steps(path: Path) -> dict[int, dict]:
    """step -> record of metrics.jsonl (a torn last line from a kill is ignored)."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            out[rec["step"]] = rec
        except (ValueError, KeyError, TypeError):
            break
    return out


def max_step(path: Path) -> int:
    """Highest step number in metrics.jsonl (-1: none); cheap enough to poll."""
    steps = metrics_steps(path)
    return max(steps) if steps else -1


def checkpoints(train_dir: Path) -> list[tuple[int, float]]:
    """(step, time its state.json was written) of every complete checkpoint folder."""
    out = []
    for p in sorted((train_dir / "checkpoints").glob("step-*")):
        try:
            out.append((int(p.name.split("-")[1]), (p / "state.json").stat().st_mtime))
        except (OSError, ValueError):
            continue  # pruned while we looked
    return out


def newest_checkpoint(train_dir: Path) -> int:
    c = checkpoints(train_dir)
    return c[-1][0] if c else -1


def load_tensors(path: Path) -> dict:
    return load_file(str(path))


def tensors_equal(a: dict, b: dict) -> tuple[bool, list[str]]:
    """Bit-identical: same keys, and torch.equal (same dtype, shape, every element) for each."""
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in sorted(set(a) & set(b))
            if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return not bad, bad


def final_tensors(train_dir: Path) -> tuple[dict, dict]:
    """The exported drafter weights and the optimizer state of the final checkpoint."""
    last = sorted((train_dir / "checkpoints").glob("step-*"))[-1]
    return (load_tensors(train_dir / "drafter" / "model.safetensors"),
            load_tensors(last / "optim.safetensors"))


def id_counts(per_step: dict[int, list[int]]) -> Counter:
    return Counter(i for ids in per_step.values() for i in ids)


def compare_ids(ref: dict[int, dict], got: dict[int, list[int]]) -> dict:
    """Consumed ids vs the reference: per step, as multisets, and per epoch exactly once."""
    ref_ids = {s: r["sample_ids"] for s, r in ref.items()}
    lost = id_counts(ref_ids) - id_counts(got)
    dup = id_counts(got) - id_counts(ref_ids)
    epochs: dict[int, list[int]] = {}
    for s, r in ref.items():
        epochs.setdefault(r["epoch"], []).extend(got.get(s, []))
    return {"samples_lost": sum(lost.values()), "samples_duplicated": sum(dup.values()),
            "steps_identical": ref_ids == got,
            "epochs": {e: sorted(ids) for e, ids in epochs.items()}}


def epochs_exactly_once(epochs: dict[int, list[int]], all_ids: list[int]) -> bool:
    return all(ids == sorted(all_ids) for ids in epochs.values())


def stitch(segments: list[tuple[int, int, dict[int, dict]]]) -> dict[int, list[int]]:
    """The ids the final weights were trained on, from the runs' own metrics: run i counts for
    steps [start_i, end_i) (end_i = the step the next run resumed from). A step claimed twice
    is kept twice (a duplicate); a step nobody wrote is missing (a loss)."""
    got: dict[int, list[int]] = {}
    for start, end, steps in segments:
        for s in range(start, end):
            if s in steps:
                got[s] = got.get(s, []) + steps[s]["sample_ids"]
    return got

def reference(w: Workflow, root: str, logs: Path) -> dict:
    """One uninterrupted train run in a fresh results ``root`` (the upstream stages copied):
    its wall and startup seconds beside what it wrote (:func:`reference_result`)."""
    w.fresh_root(root)
    run = w.start("train", root, logs / "reference.log")
    td = w.train_dir(root)
    wait_until(lambda: max_step(td / "metrics.jsonl") >= 0, run, poll=0.02)
    first = metrics_steps(td / "metrics.jsonl")
    # process start -> the pipeline starts (imports, data, replicas, checkpoint, warm start)
    startup = time.time() - run.t0 - (first[0]["t"] if 0 in first else 0.0)
    rc = run.wait()
    if rc != 0:
        raise RuntimeError(f"reference run failed ({rc}):\n{run.text()[-3000:]}")
    return {"wall_s": time.time() - run.t0, "startup_s": startup, **reference_result(w, root)}


def reference_result(w: Workflow, root: str) -> dict:
    """A finished train run of ``root`` read back: its manifest, per-step metrics (the sample
    ids consumed), final weights and optimizer state (a run made by :func:`reference` in
    another process, e.g. the tests' background lane)."""
    td = w.train_dir(root)
    manifest = json.loads((td / "manifest.json").read_text())
    return {"train_s": manifest["train_s"], "steps": manifest["steps"]["total"],
            "step_s": manifest["train_s"] / manifest["steps"]["total"], "manifest": manifest,
            "metrics": metrics_steps(td / "metrics.jsonl"), "tensors": final_tensors(td)}


def decided(run: Run) -> bool:
    """Did this run get past its resume decision (the resume line, or the warm start after it)?"""
    t = run.text()
    return bool(RESUME_RE.search(t)) or "[train] warm start" in t

def dataset_ids(w: Workflow) -> list[int]:
    return pq.read_table(w.res("results") / "data" / "dataset.parquet",
                         columns=["sample_id"])["sample_id"].to_pylist()
