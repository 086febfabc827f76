"""The SLURM workflow profile (profiles/slurm): what each job would ask SLURM for.

A dry run with the profile (the real snakemake-executor-plugin-slurm from the lock validates the
executor; no sbatch needed) prints every job's resources and shell command. The resources then go
through the plugin's own sbatch-flag functions, so the test checks the flags a cluster would see:
the multi-node train job gets --nodes, one task per node, GPUs per node (--gres, never --gpus,
a job total SLURM may spread unevenly) and runs its shell as an MPI-style job (srun inside);
every other stage is a one-node job.
"""
from __future__ import annotations

import re

import pytest
import yaml
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from dflash.runtime.harness import REPO, copy_workflow, snakemake

pytestmark = pytest.mark.e2e


def _spec(tmp_path, src, name, **topology):
    d = yaml.safe_load(src.read_text())
    d["name"] = name
    d["topology"].update(topology)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _jobs(output: str) -> dict[tuple[str, str], dict]:
    """{(rule, spec): {"resources": {...}, "shell": str}} from a `snakemake -n -p` printout. The
    env, warmup and data jobs are per store key (rules/share.smk): their spec is the spec file
    they read; the link_stage jobs are local (localrules), never sent to SLURM."""
    jobs = {}
    for block in output.split("\nrule ")[1:]:
        rule = block.split(":", 1)[0].strip()
        if rule == "link_stage":
            continue
        spec = (re.search(r"wildcards: spec=(\S+)", block)
                or re.search(r"Shell command: .* -m dflash \w+ specs/(\S+)\.yaml", block))
        res = re.search(r"resources: (.*)", block)
        shell = re.search(r"Shell command: (.*)", block)
        if not spec:
            continue  # the named targets (train_<spec>): no job of their own
        resources = {}
        for item in res.group(1).split(", "):
            k, _, v = item.partition("=")
            resources[k] = int(v) if v.isdigit() else v
        jobs[rule, spec.group(1)] = {"resources": resources, "shell": shell.group(1)}
    return jobs


class _Resources(dict):
    """A job's resources as the plugin reads them (``.get`` and attributes)."""

    __getattr__ = dict.__getitem__


class _Job:
    def __init__(self, resources):
        self.resources = _Resources(resources)
        self.threads = 1


def _sbatch_flags(resources: dict) -> str:
    """The sbatch flags the plugin (snakemake-executor-plugin-slurm, as pinned) builds from them."""
    job = _Job(resources)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "",
              "partition": f"-p {resources['slurm_partition']}", "workdir": ""}
    return get_submit_command(job, params) + set_gres_string(job)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, micro_spec):
    tmp = tmp_path_factory.mktemp("slurm")
    specs = [
        micro_spec,  # CPU, nodes: 1
        _spec(tmp, micro_spec, "micro2", nodes=2),  # CPU, two nodes
        _spec(tmp, REPO / "specs" / "expanded.yaml", "expanded2", nodes=2),  # 8 GPUs per node
    ]
    (tmp / "wf").mkdir()
    wf = copy_workflow(tmp / "wf", specs)
    r = snakemake(wf, "-n", "-p", "--workflow-profile", "profiles/slurm",
                  "train_micro", "train_micro2", "train_expanded2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = _jobs(r.stdout + r.stderr)
    assert {rule for rule, _ in jobs} == {"env", "warmup", "data", "train"}
    # micro2 differs from micro in topology.nodes only: one env, warmup and data job for both
    assert len(jobs) == 9 and ("data", "micro2") not in jobs and ("train", "micro2") in jobs
    return jobs


def test_multi_node_gpu_train_job(dry_run):
    res = dry_run["train", "expanded2"]["resources"]
    assert res["nodes"] == 2 and res["tasks"] == 2 and res["mpi"] == "srun"
    assert res["gres"] == "gpu:8"  # per node: the spec names cuda:0 .. cuda:7
    assert res["cpus_per_task"] == 64 and res["slurm_partition"] == "gpu"  # from the profile
    assert "gpu" not in res and not any(k.startswith("cuda_") for k in res)
    flags = _sbatch_flags(res).split()
    assert {"--nodes=2", "--ntasks=2", "--gres=gpu:8", "--cpus-per-task=64", "--mem",
            "512000"} <= set(flags), flags
    assert not any(f.startswith(("--gpus", "--ntasks-per-gpu")) for f in flags), flags
    # the rule's shell starts one task (one torchrun) per node inside the allocation
    shell = dry_run["train", "expanded2"]["shell"]
    assert shell.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "), shell
    assert "--kill-on-bad-exit=1" in shell and "-m dflash train specs/expanded2.yaml" in shell


def test_multi_node_cpu_train_job(dry_run):
    res = dry_run["train", "micro2"]["resources"]
    assert (res["nodes"], res["tasks"], res["mpi"]) == (2, 2, "srun") and "gres" not in res
    flags = _sbatch_flags(res).split()
    assert {"--nodes=2", "--ntasks=2", "--cpus-per-task=64"} <= set(flags), flags
    assert dry_run["train", "micro2"]["shell"].startswith("srun --nodes=2 --ntasks=2 ")


def test_one_node_train_job_is_a_plain_job(dry_run):
    """topology.nodes = 1: no mpi, so the plugin's jobstep runs it under `srun -n1`."""
    job = dry_run["train", "micro"]
    assert job["resources"]["nodes"] == 1
    assert not {"tasks", "mpi", "tasks_per_gpu", "gres"} & set(job["resources"])
    assert "--nodes=1" in _sbatch_flags(job["resources"]).split()
    assert "srun" not in job["shell"] and job["shell"].split()[1:4] == [
        "-m", "dflash", "train"], job["shell"]


@pytest.mark.parametrize("spec, gres", [("micro", None), ("expanded2", "gpu:8")])
@pytest.mark.parametrize("rule", ["env", "warmup", "data"])
def test_every_other_stage_is_a_one_node_job(dry_run, rule, spec, gres):
    job = dry_run[rule, spec]
    res = job["resources"]
    assert res["nodes"] == 1 and res.get("gres") == gres
    assert not {"tasks", "mpi", "gpu"} & set(res) and not any(k.startswith("cuda_") for k in res)
    flags = _sbatch_flags(res).split()
    assert "--nodes=1" in flags and (f"--gres={gres}" if gres else "--ntasks=1") in flags, flags
    assert not any(f.startswith(("--gpus", "--ntasks-per-gpu")) for f in flags), flags
    assert "srun" not in job["shell"]
    assert res["runtime"] == (360 if rule == "data" else 120)  # the profile's defaults / data's


def test_local_multi_node_jobs_hold_every_simulated_nodes_gpus(tmp_path):
    """Without the profile, nodes: 2 on one machine runs two local processes, process i on GPUs
    [i·k, (i+1)·k) (dflash/runtime/launch.py): the jobs hold all of them (Spec.machine_devices), and
    the train command is the plain one (no srun: dflash.runtime.launch starts the local processes)."""
    spec = _spec(tmp_path, REPO / "specs" / "qwen3-8b-2gpu.yaml", "two-by-two", nodes=2)
    (tmp_path / "wf").mkdir()
    wf = copy_workflow(tmp_path / "wf", [spec])
    r = snakemake(wf, "-n", "-p", "train_two-by-two")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = _jobs(r.stdout + r.stderr)
    for rule in ("env", "warmup", "data", "train"):
        res = jobs[rule, "two-by-two"]["resources"]
        assert {k: v for k, v in res.items() if k.startswith(("gpu", "cuda"))} == {
            "gpu": 4, "cuda_0": 3, "cuda_1": 3, "cuda_2": 3, "cuda_3": 3}, (rule, res)
        assert not {"nodes", "tasks", "mpi", "gres"} & set(res)
    assert jobs["train", "two-by-two"]["resources"]["launch"] == ""
    shell = jobs["train", "two-by-two"]["shell"]
    assert shell.split()[1:4] == ["-m", "dflash", "train"], shell


@pytest.mark.parametrize("args, message", [
    # a --config of one's own replaces the profile's list, dropping slurm=True
    (["--workflow-profile", "profiles/slurm", "--config", "default_spec=micro"],
     "config slurm=False but the executor is 'slurm'"),
    (["--config", "slurm=True"], "config slurm=True but the executor is 'local'"),
])
def test_slurm_flag_and_executor_must_agree(tmp_path, micro_spec, args, message):
    """Checked as the run starts, before any job is submitted or run."""
    (tmp_path / "wf").mkdir()
    wf = copy_workflow(tmp_path / "wf", [micro_spec])
    r = snakemake(wf, "train_micro", *args)
    assert r.returncode != 0 and message in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (wf / "results").exists() and not (wf / ".snakemake" / "slurm_logs").exists()
