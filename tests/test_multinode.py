"""topology.nodes > 1 on one machine: 2 ranks (local processes under torchrun, gloo on CPU),
the real stage on the micro target.

* through Snakemake (``snakemake train_<spec>``): the step ids of 2 nodes × 2 replicas are
  exactly those of 1 node × 4 replicas (the sharding takes batch s·R·M + k·M + r), each epoch
  exactly once (an end-of-epoch step where rank 1 has no batch included), the weights are
  bit-identical across ranks and equal (to float rounding) to the 1-node run's: the mean weighs
  every active replica of every node equally;
* one rank killed with SIGKILL (two "SLURM nodes", one torchrun each): every process exits
  within the heartbeat timeout (8 s here, DFLASH_HEARTBEAT_TIMEOUT_S) + 15 s, naming the dead
  rank and its host; the same command resumes from the last
  checkpoint; killing node 0 (the rendezvous store's host) ends node 1 naming the lost store;
  the third run finishes, every epoch exactly once;
* an error on one rank stops the other, naming it; a checkpoint of 2 nodes refuses a 1-node run
  with one message naming topology.nodes; nodes = 1 runs without torchrun or a process group.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash.runtime import faults as fi
from dflash.runtime.harness import copy_workflow, snakemake, stage_env

pytestmark = pytest.mark.e2e
HOST = socket.gethostname()


def _spec(name: str, nodes: int, drafters: int, epochs: int, every: int) -> dict:
    d = fi.derived_spec(name, 1, every, keep=2)
    del d["optim"]["max_steps"]
    d["optim"]["epochs"] = epochs
    d["monitor"] = {}
    d["batching"]["max_batch_size"] = 2     # 6 batches of 12 samples: 2 steps of 4 per epoch
    d["topology"]["drafters"] = ["cpu"] * drafters
    d["topology"]["nodes"] = nodes
    return d


def _prepare(tmp: Path) -> Path:
    wf = copy_workflow(tmp, [])
    for spec in (_spec("mn", 2, 2, 3, 2), _spec("mn1", 1, 4, 3, 2), _spec("mnk", 2, 2, 30, 4)):
        (wf / "specs" / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    return wf


# data and warm-up only, started with the session (tests/conftest.py): the trainings run in the
# foreground, where the heartbeat timeouts they test cannot fire for a niced, starved process
BACKGROUND_DAG = (_prepare, [f"{st}_{s}" for s in ("mn", "mn1", "mnk")
                             for st in ("data", "warmup")])


@pytest.fixture(scope="module")
def w(background_dag) -> fi.Workflow:
    wf, rc, out = background_dag
    assert rc == 0, out[-6000:]
    return fi.Workflow(wf, "mn")


@pytest.fixture(scope="module")
def trained(w) -> dict:
    r = snakemake(w.wf, "train_mn", "train_mn1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = {}
    for s in ("mn", "mn1"):
        td = w.wf / "results" / s / "train"
        out[s] = {"manifest": json.loads((td / "manifest.json").read_text()),
                  "metrics": fi.metrics_steps(td / "metrics.jsonl"),
                  "tensors": fi.final_tensors(td), "dir": td,
                  "log": (w.wf / "logs" / s / "train.log").read_text()}
    return out


def test_two_nodes_shard_each_epoch_exactly_once_and_stay_identical(w, trained):
    two, one = trained["mn"], trained["mn1"]
    m = two["manifest"]
    assert "2 simulated nodes" in two["log"] and "torch.distributed.run" in two["log"]
    d = m["distributed"]
    assert d["nodes"] == 2 and d["backend"] == "gloo" and d["hosts"] == [HOST, HOST]
    # bit-identical replicas on both ranks (each rank hashed its own weights)
    assert d["replicas_identical_across_ranks"] and len(set(d["weights_sha256_by_rank"])) == 1
    assert d["allreduce_s_per_step_mean"] > 0 and d["allreduce_bytes_per_step"] > 0
    # the step plan: 2 nodes x 2 replicas take exactly the batches 1 node x 4 replicas takes
    assert m["steps"]["total"] == one["manifest"]["steps"]["total"] == 6
    assert {s: r["sample_ids"] for s, r in two["metrics"].items()} == \
        {s: r["sample_ids"] for s, r in one["metrics"].items()}
    # counted from the metrics of all ranks (rank 0 writes the gathered steps): every epoch
    # each sample exactly once; and the stage's own ledger says so too
    ids = sorted(fi.dataset_ids(w))
    by_epoch: dict[int, list[int]] = {}
    for r in two["metrics"].values():
        by_epoch.setdefault(r["epoch"], []).extend(r["sample_ids"])
    assert sorted(by_epoch) == [0, 1, 2]
    assert all(sorted(v) == ids for v in by_epoch.values())
    assert all(v["exactly_once"] for v in m["exactly_once"].values())
    # the end-of-epoch step where rank 1's replicas have no batch: the mean is over the
    # active replicas of all ranks, so the weights track the 1-node run (to float rounding)
    assert any(len(r["sample_ids"]) <= 4 for r in two["metrics"].values())

    for k, v in one["tensors"][0].items():
        assert torch.allclose(two["tensors"][0][k], v, rtol=1e-4, atol=1e-6), k
    for s in two["metrics"]:
        assert two["metrics"][s]["loss"] == pytest.approx(one["metrics"][s]["loss"], rel=1e-4)
    # same outputs as a one-node run, written once
    assert sorted(p.name for p in two["dir"].iterdir()) == \
        sorted(p.name for p in one["dir"].iterdir())


def test_one_node_runs_without_torchrun(trained):
    one = trained["mn1"]
    assert "torch.distributed.run" not in one["log"]
    assert one["manifest"]["distributed"] == {"nodes": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The watchdog's timeout for the kill test: the default 15 s would be waited out twice (a dead
# rank, then the lost store) for what 8 s shows as well; 8 s of no heartbeat (one a second, from
# a thread) is still far beyond any stall of a foreground process on a busy 2-core box.
KILL_TIMEOUT_S = 8


def _start_nodes(w: fi.Workflow, spec: str, root: str, tag: str) -> list[fi.Run]:
    """Two "SLURM nodes" on this machine: one `dflash train` (→ one torchrun) per node."""
    port = _free_port()
    runs = []
    for node in (0, 1):
        env = stage_env(w.wf)
        env.update(SLURM_JOB_NODELIST="localhost", SLURM_NNODES="2", SLURM_NODEID=str(node),
                   SLURM_JOB_ID="4242", DFLASH_RDZV_ENDPOINT=f"localhost:{port}",
                   DFLASH_HEARTBEAT_TIMEOUT_S=str(KILL_TIMEOUT_S))
        log = w.wf / f"{tag}-node{node}.log"
        cmd = [sys.executable, "-m", "dflash", "train", f"specs/{spec}.yaml", "--results", root]
        with open(log, "w") as fh:
            p = subprocess.Popen(cmd, cwd=w.wf, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        runs.append(fi.Run(p, time.time(), log, cmd))
    return runs



def _kill_and_wait(pid: int, runs) -> float:
    """kill -9 one rank's process; seconds until every node's run has exited."""
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    for r in runs:
        r.wait(timeout=60)
    return time.time() - t_kill


def _stop(runs) -> None:
    for r in runs:
        if r.alive():
            r.kill()

def _rank_pid(run: fi.Run) -> int:
    """The rank process torchrun started for this node (its child running dflash)."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == run.proc.pid and b"dflash" in argv:
            return int(p.name)
    raise AssertionError("no rank process found")


def test_killed_rank_stops_every_rank_naming_it_then_resumes(w):
    w = fi.Workflow(w.wf, "mnk")
    root = w.fresh_root("results_kill")
    td = w.train_dir(root)
    runs = _start_nodes(w, "mnk", root, "kill")
    try:
        assert fi.wait_until(lambda: fi.newest_checkpoint(td) >= 4, runs[0], timeout=300), \
            runs[0].text()[-3000:]
        assert runs[1].alive(), "the run ended before the kill"
        victim = _rank_pid(runs[1])
        environ = Path(f"/proc/{victim}/environ").read_bytes().split(b"\0")
        rank = int(next(x for x in environ if x.startswith(b"RANK="))[5:])  # c10d assigns it
        waited = _kill_and_wait(victim, runs)
    finally:
        _stop(runs)
    assert waited < KILL_TIMEOUT_S + 15, waited
    assert all(r.proc.returncode != 0 for r in runs)
    text = runs[0].text()
    errors = [x for x in text.splitlines() if x.startswith("error: ")]
    # the survivor's one message names the dead rank and its host (torchrun's summary follows)
    assert len(errors) == 1 and f"rank {rank} on {HOST}" in errors[0] and \
        "stopped responding" in errors[0] and f"stopping rank {1 - rank} on {HOST}" in errors[0], \
        text
    # the same command resumes from the last checkpoint; this time node 0 (it hosts the
    # rendezvous store) loses its rank: node 1's rank names the lost store within seconds
    last = fi.newest_checkpoint(td)
    runs = _start_nodes(w, "mnk", root, "resume")
    try:
        assert fi.wait_until(lambda: fi.newest_checkpoint(td) >= last + 4, runs[0],
                             timeout=300), runs[0].text()[-3000:]
        assert runs[1].alive(), "the run ended before the kill"
        waited = _kill_and_wait(_rank_pid(runs[0]), runs)
    finally:
        _stop(runs)
    assert waited < KILL_TIMEOUT_S + 15 and all(r.proc.returncode != 0 for r in runs), waited
    assert max(r.resumed_from() for r in runs) == last > 0
    errors = [x for x in runs[1].text().splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "lost the rendezvous store" in errors[0], runs[1].text()
    # and once more: it finishes, every epoch exactly once over the three runs
    last = fi.newest_checkpoint(td)
    runs = _start_nodes(w, "mnk", root, "finish")
    try:
        assert [r.wait(timeout=300) for r in runs] == [0, 0], runs[0].text()[-3000:]
    finally:
        for r in runs:
            if r.alive():
                r.kill()
    assert max(r.resumed_from() for r in runs) == last > 0
    m = json.loads((td / "manifest.json").read_text())
    assert m["steps"]["resumed_from"] == last and m["distributed"]["nodes"] == 2
    assert m["distributed"]["replicas_identical_across_ranks"]
    assert len(m["exactly_once"]) == 30 and all(v["exactly_once"]
                                                for v in m["exactly_once"].values())


def test_error_on_one_rank_stops_the_other_naming_it(w):
    root = w.fresh_root("results_err")
    env = stage_env(w.wf)
    env["DFLASH_FAIL_AT"] = "drafter-0:1@1"
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "dflash", "train", "specs/mn.yaml", "--results",
                        root], cwd=w.wf, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and time.time() - t0 < 120, out[-3000:]
    # rank 0 names rank 1, its host and its error
    assert f"error: rank 1 on {HOST}" in out and "injected failure in drafter-0" in out and \
        f"stopping rank 0 on {HOST}" in out, out[-3000:]


def test_other_world_size_is_refused_naming_topology_nodes(w, trained, tmp_path):
    root = w.fresh_root("results_ws", stages=("env", "warmup", "data", "train"))
    spec = yaml.safe_load((w.wf / "specs" / "mn.yaml").read_text())
    spec["topology"]["nodes"] = 1
    alt = w.wf / "alt" / "specs"
    alt.mkdir(parents=True, exist_ok=True)
    (alt / "mn.yaml").write_text(yaml.safe_dump(spec))
    r = subprocess.run([sys.executable, "-m", "dflash", "train", "alt/specs/mn.yaml",
                        "--results", root], cwd=w.wf, env=stage_env(w.wf), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()
    msg = next(x for x in last if x.startswith("error: "))
    assert "field 'topology.nodes'" in msg and "topology.nodes = 2" in msg and \
        "topology.nodes = 1" in msg, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
