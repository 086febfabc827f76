"""How `dflash train` starts torchrun for topology.nodes > 1 (dflash.runtime.launch): the command line
it builds from the environment (one machine, SLURM, by hand), and its refusals. The real runs
are tests/test_multinode.py."""
from __future__ import annotations

import os

import pytest
import yaml

from dflash.errors import SpecError
from dflash.runtime.distributed import select_local_gpus
from dflash.runtime.harness import REPO, copy_workflow, snakemake
from dflash.runtime.launch import first_host, torchrun_args
from dflash.spec.load import load_spec


def _spec(tmp_path, nodes=2, rendezvous="auto", targets=("cpu",), drafters=("cpu", "cpu")):
    d = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())
    d["topology"].update(nodes=nodes, targets=list(targets), drafters=list(drafters),
                         allow_shared_devices=True)
    if rendezvous != "auto":
        d["topology"]["rendezvous"] = rendezvous
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(d))
    return load_spec(tmp_path / "tiny.yaml")


def _opt(args, name):
    return args[args.index(name) + 1]


def test_first_host_of_a_slurm_node_list(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list is parsed
    assert first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert first_host("node7,node8") == "node7"
    assert first_host("a-b[001-004]") == "a-b001"


def test_one_machine_runs_nodes_local_processes_on_cpu(tmp_path):
    args, extra, how = torchrun_args(_spec(tmp_path), {})
    assert "--standalone" in args and _opt(args, "--nproc-per-node") == "2"
    assert _opt(args, "--max-restarts") == "0" and extra == {"DFLASH_DIST_WORKER": "1"}
    assert "gloo on CPU" in how


def test_simulated_nodes_get_their_own_gpus(tmp_path):
    spec = _spec(tmp_path, targets=["cuda:0"], drafters=["cuda:0"])
    args, extra, _ = torchrun_args(spec, {"CUDA_VISIBLE_DEVICES": "0,1"})
    # one GPU per node (the spec's cuda:0), local process i gets GPU i, NVLS off
    assert extra["DFLASH_GPUS_PER_NODE"] == "1"
    assert extra["DFLASH_LAUNCH_VISIBLE_DEVICES"] == "0,1" and extra["NCCL_NVLS_ENABLE"] == "0"
    with pytest.raises(SpecError, match=r"field 'topology.nodes'.*need 2 GPUs.*found 1"):
        torchrun_args(spec, {"CUDA_VISIBLE_DEVICES": "3"})


def test_select_local_gpus_shifts_by_local_rank(monkeypatch):
    monkeypatch.setenv("DFLASH_DIST_WORKER", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("DFLASH_GPUS_PER_NODE", "2")
    monkeypatch.setenv("DFLASH_LAUNCH_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    select_local_gpus()

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_slurm_one_torchrun_per_node_meeting_at_the_first_host(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = {"SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "123456"}
    args, _, how = torchrun_args(_spec(tmp_path), env)
    assert _opt(args, "--nnodes") == "2" and _opt(args, "--node-rank") == "1"
    assert _opt(args, "--nproc-per-node") == "1" and _opt(args, "--rdzv-backend") == "c10d"
    assert _opt(args, "--rdzv-endpoint") == "gpu12:29956"  # 29500 + job id % 1000
    assert _opt(args, "--rdzv-conf") == "is_host=0" and "--standalone" not in args
    # an explicit rendezvous wins: the spec's, then the environment's
    args, _, _ = torchrun_args(_spec(tmp_path, rendezvous="head:4000"), env)
    assert _opt(args, "--rdzv-endpoint") == "head:4000"
    args, _, _ = torchrun_args(_spec(tmp_path, rendezvous="head:4000"),
                               {**env, "DFLASH_RDZV_ENDPOINT": "other:5000"})
    assert _opt(args, "--rdzv-endpoint") == "other:5000"


def test_slurm_job_of_another_size_is_refused(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu[1-4]", "SLURM_NNODES": "4", "SLURM_NODEID": "0"}
    with pytest.raises(SpecError, match=r"field 'topology.nodes'.*2 nodes.*has 4"):
        torchrun_args(_spec(tmp_path), env)
    # a one-node SLURM job (e.g. an interactive allocation) simulates the nodes locally
    args, _, _ = torchrun_args(_spec(tmp_path), {**env, "SLURM_NNODES": "1"})
    assert "--standalone" in args


def test_by_hand_needs_a_rendezvous(tmp_path):
    with pytest.raises(SpecError, match=r"field 'topology.rendezvous'"):
        torchrun_args(_spec(tmp_path), {"DFLASH_NODE_RANK": "0"})
    args, _, _ = torchrun_args(_spec(tmp_path, rendezvous="head:4000"),
                               {"DFLASH_NODE_RANK": "0"})
    assert _opt(args, "--node-rank") == "0" and _opt(args, "--rdzv-conf") == "is_host=1"


def test_simulated_nodes_hold_every_gpu_they_use(tmp_path):
    """Snakemake: the 2-node spec's jobs hold cuda_0 and cuda_1 (node 1 runs on GPU 1 here)."""
    wf = copy_workflow(tmp_path, [REPO / "specs" / "qwen3-8b-2node-shared.yaml"])
    r = snakemake(wf, "-n", "train_qwen3-8b-2node-shared")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "gpu=" in ln]
    # train also carries `launch` (empty here: srun only for a multi-node job on SLURM)
    res = [ln.removesuffix(", launch=") for ln in res]
    assert res and set(res) == {"resources: tmpdir=/tmp, gpu=2, cuda_0=3, cuda_1=3"}, res


def test_one_machine_uses_a_local_rendezvous_and_refuses_another_host(tmp_path):
    args, _, how = torchrun_args(_spec(tmp_path, rendezvous="localhost:29777"), {})
    assert "--standalone" not in args and _opt(args, "--rdzv-endpoint") == "localhost:29777"
    assert _opt(args, "--nnodes") == "1" and _opt(args, "--nproc-per-node") == "2"
    assert "rendezvous localhost:29777" in how
    with pytest.raises(SpecError, match="'topology.rendezvous': 'head:4000' names another host"):
        torchrun_args(_spec(tmp_path, rendezvous="head:4000"), {})
