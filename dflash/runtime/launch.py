"""``dflash train`` with ``topology.nodes`` > 1: become torchrun, which starts the ranks.

Three ways, picked from the environment (the rule in rules/train.smk stays one plain command):

* **SLURM** (``SLURM_JOB_NODELIST`` and ``SLURM_NNODES`` = ``topology.nodes``; one task per node,
  e.g. Snakemake's SLURM executor with the ``mpi`` resource = ``srun``): one torchrun per node,
  ``--nnodes N --node-rank $SLURM_NODEID``, rendezvous at the first host of the node list
  (``scontrol show hostnames``, else parsed) on port 29500 + job id % 1000, or
  ``topology.rendezvous`` / ``$DFLASH_RDZV_ENDPOINT`` when given.
* **By hand on several machines**: ``DFLASH_NODE_RANK=i dflash train spec`` on each, with the
  rendezvous given (spec or ``$DFLASH_RDZV_ENDPOINT``).
* **One machine** (neither): ``torchrun --standalone --nproc-per-node N``: N simulated nodes; on
  GPUs local process i gets GPUs [i·k, (i+1)·k) where k is the GPUs one node's spec uses (so
  ``targets: [cuda:0]`` on 2 nodes uses GPU 0 and GPU 1); gloo on CPU. The tests run this.

The process is replaced by torchrun (``exec``): signals from Snakemake or the user reach torchrun
and through it every rank; its exit code is the stage's.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

from .. import settings
from ..errors import SpecError
from ..spec.load import load_spec
from .distributed import is_worker

DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[03-05,09],cpu1" -> "gpu03")."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], text=True,
                                 capture_output=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise SpecError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot read the first host")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _endpoint(spec, env: dict) -> str | None:
    """An explicit rendezvous: the environment overrides the spec; None for auto."""
    if settings.rdzv_endpoint(env):
        return settings.rdzv_endpoint(env)
    return None if spec.topology.rendezvous == "auto" else spec.topology.rendezvous


def _gpus_per_node(spec) -> int:
    ids = [int(d.split(":")[1]) for d in spec.devices() if d.startswith("cuda:")]
    return max(ids) + 1 if ids else 0


def _per_node(nodes: int, node_rank: str, endpoint: str, rdzv_id: str) -> list[str]:
    """One torchrun per node; node 0's hosts the rendezvous store (the endpoint is its host),
    so the store lives as long as rank 0's node does, whichever node reaches it first."""
    return ["--nnodes", str(nodes), "--node-rank", node_rank, "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={int(node_rank == '0')}"]


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def _one_machine(spec, nodes: int, explicit: str | None) -> list[str]:
    """Simulated nodes: ``--standalone`` (a free port), or at the explicit rendezvous when it
    names this machine; one naming another host cannot apply here and is refused (it used to
    be ignored without a word)."""
    if not explicit:
        return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nodes)]

    host = explicit.rsplit(":", 1)[0].strip("[]")
    if host not in LOCAL_HOSTS + (socket.gethostname(), socket.getfqdn()):
        raise SpecError(f"{spec.path}: field 'topology.rendezvous': {explicit!r} names another "
                        f"host, but with no SLURM job and no DFLASH_NODE_RANK the {nodes} nodes "
                        f"run as local processes on this machine; use auto, localhost:PORT, "
                        f"or start each node with DFLASH_NODE_RANK=i (README, multi-node)")
    return ["--nnodes", "1", "--nproc-per-node", str(nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", explicit, "--rdzv-id", f"dflash-{spec.name}"]


def torchrun_args(spec, env: dict) -> tuple[list[str], dict, str]:
    """torchrun's options, the extra environment for the ranks, and how it runs (for the log)."""
    nodes = spec.topology.nodes
    extra = {settings.DIST_WORKER: "1"}
    common = ["--max-restarts", "0", "--monitor-interval", "1"]
    slurm_nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    explicit = _endpoint(spec, env)
    if env.get("SLURM_JOB_NODELIST") and slurm_nodes and int(slurm_nodes) > 1:
        if int(slurm_nodes) != nodes:
            raise SpecError(f"{spec.path}: field 'topology.nodes': the spec asks for {nodes} "
                            f"nodes but this SLURM job has {slurm_nodes} (SLURM_NNODES); give "
                            f"the job exactly topology.nodes nodes")
        if env.get("SLURM_LOCALID", "0") != "0":
            raise SpecError(f"{spec.path}: field 'topology.nodes': start one task per node "
                            f"(this is local task {env['SLURM_LOCALID']}); each node's task "
                            f"runs every target and drafter of that node")
        job = env.get("SLURM_JOB_ID", "0")
        endpoint = explicit or (f"{first_host(env['SLURM_JOB_NODELIST'])}:"
                                f"{DEFAULT_PORT + int(job) % 1000}")
        args = _per_node(nodes, env.get("SLURM_NODEID", "0"), endpoint,
                         f"dflash-{spec.name}-{job}")
        how = f"SLURM node {env.get('SLURM_NODEID', '0')} of {nodes}, rendezvous {endpoint}"
    elif settings.node_rank(env):
        if not explicit:
            raise SpecError(f"{spec.path}: field 'topology.rendezvous': DFLASH_NODE_RANK is set "
                            f"(one process per machine) but no rendezvous host:port is given "
                            f"(set topology.rendezvous or DFLASH_RDZV_ENDPOINT)")
        args = _per_node(nodes, settings.node_rank(env), explicit, f"dflash-{spec.name}")
        how = f"node {settings.node_rank(env)} of {nodes}, rendezvous {explicit}"
    else:
        args = _one_machine(spec, nodes, explicit)
        k = _gpus_per_node(spec)
        if k:
            visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            if "CUDA_VISIBLE_DEVICES" not in env:
                import torch  # this branch only: the launcher execs torchrun before torch loads

                visible = [str(i) for i in range(torch.cuda.device_count())]
            if len(visible) < nodes * k:
                raise SpecError(f"{spec.path}: field 'topology.nodes': {nodes} simulated nodes "
                                f"of {k} GPU(s) each need {nodes * k} GPUs on this machine; "
                                f"found {len(visible)} (no SLURM job here: the nodes run as "
                                f"local processes)")
            extra.update({settings.GPUS_PER_NODE: str(k),
                          settings.LAUNCH_VISIBLE_DEVICES: ",".join(visible)})
            # NVLink multicast (NVLS) off between processes sharing one host
            extra.setdefault("NCCL_NVLS_ENABLE", env.get("NCCL_NVLS_ENABLE", "0"))
        how = f"{nodes} simulated nodes on this machine (local processes" + \
              (f", {k} GPU(s) each" if k else ", gloo on CPU") + \
              (f", rendezvous {explicit})" if explicit else ")")
    return common + args, extra, how


def maybe_launch(spec_path: str, root: str) -> None:
    """With nodes > 1 and not yet a rank: replace this process with torchrun. Otherwise return
    (one node: the stage runs here, exactly as before)."""
    if is_worker():
        return
    spec = load_spec(spec_path)
    if spec.topology.nodes == 1:
        return
    args, extra, how = torchrun_args(spec, dict(os.environ))
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "dflash", "train",
           str(spec_path), "--results", str(root)]
    print(f"[train] {how}: {' '.join(cmd)}", flush=True)
    sys.stderr.flush()
    os.environ.update(extra)
    os.execv(sys.executable, cmd)
