"""What each Snakemake job holds: GPUs from the specs only, locally or on a SLURM cluster.

``rules/common.smk`` binds these to the workflow's specs and config; the rules use the result.
Snakemake never picks devices (the stages use the spec's device names), so locally each job
holds every CUDA device its spec names: a resource per device (``cuda_0``, ``cuda_1``, ...;
:func:`cuda_devices`), and two measured stages never share a GPU on any machine. ``gpu``
is the count (for executors that place jobs by it; limit it with ``--resources gpu=N``). A spec
with ``topology.nodes`` > 1 holds the GPUs of all its nodes (as they run here: local processes;
``Spec.machine_devices``).

On a SLURM cluster (profiles/slurm sets ``config: slurm=True``; snakemake-executor-plugin-slurm
turns resources into sbatch flags) SLURM places the jobs: a job's GPUs are the ones SLURM gives
it, numbered from 0 on each node. The per-device resources would be cluster-wide limits there
(one cuda_0 job at a time on the whole cluster), and ``gpu`` becomes ``--gpus`` (a job total that
SLURM may spread over nodes), so instead each job asks for ``nodes`` and ``gres: gpu:K`` per
node. Only the train rule may span nodes (``topology.nodes``); every other stage is a one-node
job.

Sharing a GPU (local runs): each device is a resource of ``UNITS`` × ``gpu_jobs`` units. The
train and bench stages hold a device whole (``UNITS``): their tokens/s, MFU and decoding speed
are measurements of a GPU of their own. The warm-up (mostly compiling, on the host), the data
stage and the decoders stage (the bench's decoders compiled ahead) hold one unit each, a third,
when the stage's estimated peak memory there (``dflash validate`` prints it:
:func:`dflash.train.budget.stage_memory`) is at most ``SHARE_AT_MOST`` of the device's memory:
the three then fit with room for the estimate's error, so a small pair's warm-up and decoders
run beside its data stage (round 15 on one H200, the warm-up beside it: about a minute off the
DAG). The device's memory comes from ``nvidia-smi`` (:func:`device_memory`) or the config's
``gpu_memory_gb``; where neither says, every stage holds its device whole.

Owns: the resource functions, the sharing rule and the executor check. Standard library only
(Snakemake imports it at parse time, before any environment exists).
"""
from __future__ import annotations

import os
import subprocess
from typing import Callable, Mapping

UNITS = 3                 # a device's units per gpu_jobs: a whole job holds 3, a sharing job 1
SHARING_STAGES = ("warmup", "data", "decoders")  # the stages that may hold a third of a device
SHARE_AT_MOST = 0.3       # of the device's memory, the stage's estimate, for a third of it


def cuda_devices(specs: Mapping) -> list[str]:
    """Every CUDA device any spec names on this machine, in index order."""
    return sorted({d for s in specs.values() for d in s.machine_devices() if d != "cpu"},
                  key=lambda d: int(d.split(":", 1)[1]))


def resource_name(device: str) -> str:
    """``cuda:1`` -> ``cuda_1`` (a Snakemake resource name)."""
    return device.replace(":", "_")


def gpus_per_node(spec) -> int:
    """GPUs one node of a spec uses: the highest CUDA index it names + 1 (a spec that names
    cuda:5 needs six visible devices; SLURM, like dflash.runtime.launch, numbers a node's GPUs
    from 0)."""
    idx = [int(d.split(":", 1)[1]) for d in spec.devices() if d.startswith("cuda:")]
    return max(idx) + 1 if idx else 0


def nodes(spec) -> int:
    return spec.topology.nodes


def units(stage: str, estimate_bytes: int | None, device_bytes: int | None) -> int:
    """The units of one device a job of ``stage`` holds: one for a warm-up, data or decoders
    stage whose estimated peak there is at most ``SHARE_AT_MOST`` of the device's memory, else
    whole (``UNITS``); whole too where either figure is unknown."""
    if stage in SHARING_STAGES and estimate_bytes is not None and device_bytes \
            and estimate_bytes <= SHARE_AT_MOST * device_bytes:
        return 1
    return UNITS


def parse_device_memory(smi_csv: str, visible: str | None) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,memory.total --format=csv,noheader,nounits`` (MiB) as
    {``cuda:i``: bytes} in torch's numbering: ``CUDA_VISIBLE_DEVICES`` (``visible``), when set,
    renumbers the devices; one it names by UUID or MIG leaves the numbering unknown ({})."""
    total = {}
    for line in smi_csv.splitlines():
        index, _, mib = (x.strip() for x in line.partition(","))
        if index.isdigit() and mib.isdigit():
            total[int(index)] = int(mib) * 2**20
    if visible is None:
        return {f"cuda:{i}": b for i, b in sorted(total.items())}
    order = [x.strip() for x in visible.split(",") if x.strip()]
    if not all(x.isdigit() for x in order):
        return {}
    return {f"cuda:{i}": total[int(x)] for i, x in enumerate(order) if int(x) in total}


def device_memory(devices: list[str], gpu_memory_gb: float | None = None) -> dict[str, int]:
    """{device: bytes} for the CUDA ``devices``: the config's ``gpu_memory_gb`` for each (0:
    none, which turns sharing off), else what ``nvidia-smi`` reports ({} where it is absent or
    fails: no sharing)."""
    if gpu_memory_gb is not None:
        return {d: int(gpu_memory_gb * 1e9) for d in devices} if gpu_memory_gb > 0 else {}
    if not devices:
        return {}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    if r.returncode != 0:
        return {}
    return parse_device_memory(r.stdout, os.environ.get("CUDA_VISIBLE_DEVICES"))


def device_resources(specs: Mapping, slurm: bool, stage: str = "",
                     share: Callable[[str, str, str], int] | None = None) -> dict[str, Callable]:
    """Resources of a stage: this machine's GPUs it holds (locally), or on SLURM a one-node job
    (the train rule adds the multi-node part, :func:`train_resources`). ``share(spec, stage,
    device)``: the units a job holds of a device (:func:`units`; default whole)."""
    if slurm:
        def gres(wc):
            k = gpus_per_node(specs[wc.spec])
            return f"gpu:{k}" if k else None  # None: no such resource (a CPU job)

        return {"nodes": 1, "gres": gres}

    # None, not 0: a resource the job does not hold is left out of its log line (a CPU job's
    # `resources:` would otherwise list gpu=0, cuda_0=0, ... for every GPU of every spec)
    def gpus(wc):
        return len({d for d in specs[wc.spec].machine_devices() if d != "cpu"}) or None

    def holds(device):
        def f(wc):
            if device not in specs[wc.spec].machine_devices():
                return None
            return share(wc.spec, stage, device) if share else UNITS

        return f

    return {"gpu": gpus, **{resource_name(d): holds(d) for d in cuda_devices(specs)}}


def executor_mismatch(executor: str | None, slurm: bool) -> str | None:
    """Why ``config: slurm`` and the executor disagree (None: they agree, or a dry run).
    ``slurm=True`` (profiles/slurm) and the SLURM executor go together: a ``--config`` on the
    command line replaces the profile's list, dropping slurm=True, and the jobs would then ask
    SLURM for nothing (no nodes, no GPUs)."""
    if executor is None or executor in ("dryrun", "touch"):
        return None
    if (executor == "slurm") == slurm:
        return None
    return (f"config slurm={slurm} but the executor is {executor!r}: "
            + ("add slurm=True to your --config (it replaces the one profiles/slurm sets)"
               if executor == "slurm" else
               "slurm=True is for the SLURM executor (--workflow-profile profiles/slurm)"))


def srun(n: int) -> str:
    """How the train stage starts on a SLURM allocation of n > 1 nodes: one task per node, each
    the same `python -m dflash train` (dflash/runtime/launch.py: it reads SLURM_NODEID,
    SLURM_NNODES and SLURM_JOB_NODELIST and becomes its node's torchrun, the rendezvous on the
    first host). --kill-on-bad-exit: a rank that dies takes the whole step down. The CPUs per
    task come from the allocation, so `cpus_per_task` stays a profile setting."""
    return (f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 "
            f"--cpus-per-task=${{SLURM_CPUS_PER_TASK:-1}} --kill-on-bad-exit=1 ")


def train_resources(specs: Mapping, slurm: bool,
                    share: Callable[[str, str, str], int] | None = None) -> dict[str, Callable]:
    """The train rule's resources: a one-node stage's, and under SLURM with topology.nodes > 1
    a multi-node job: `nodes`, `tasks` = one per node, `gres` per node, and `mpi` — which makes
    the plugin's jobstep run the rule's shell in the allocation as it is instead of under
    `srun -n1` (one task on one node), so the shell starts the ranks itself with `launch`
    (:func:`srun`). `launch` is empty otherwise. It sits in the shell command, so the command
    text (Snakemake's `code` rerun trigger) is the same under every profile: a train run on the
    cluster is not redone by a later local `snakemake bench_<spec>`."""
    res = device_resources(specs, slurm, "train", share)

    def launch(wc):
        n = nodes(specs[wc.spec])
        return srun(n) if slurm and n > 1 else ""

    if not slurm:
        return {**res, "launch": launch}

    def multi(value):  # only on a multi-node job: None leaves the resource out
        return lambda wc: value(nodes(specs[wc.spec])) if nodes(specs[wc.spec]) > 1 else None

    return {
        **res,
        "nodes": lambda wc: nodes(specs[wc.spec]),
        "tasks": multi(lambda n: n),
        # 0: no --ntasks-per-gpu; the plugin would otherwise take `tasks` for it (n tasks per GPU)
        "tasks_per_gpu": multi(lambda n: 0),
        "mpi": multi(lambda n: "srun"),
        "launch": launch,
    }
