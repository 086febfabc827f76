# Shared by every rule: the specs, what each stage depends on, and how stages are invoked.
import json
import logging
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # the dflash package lives beside this Snakefile

from dflash.code_fingerprint import stage_code_fingerprint
from dflash.data.check import check_data
from dflash.errors import DFlashError
from dflash.eval.report import PLOTS
from dflash.manifest import sha256_file
from dflash.spec import load_spec


def _load_specs():
    """Every spec in specs/ that passes its checks (schema, cross-field rules, the data checks that
    read no file: dflash.data.check), and the refusal of each that does not. A bad spec affects
    only its own targets (rules/targets.smk refuses them, naming the file and field); every other
    spec still plans and runs."""
    specs, bad = {}, {}
    for path in sorted(Path(workflow.basedir, "specs").glob("*.yaml")):
        try:
            spec = load_spec(path)  # schema + cross-field rules, no torch
            check_data(spec, read_files=False)  # names, files exist, counts: before any job
            specs[path.stem] = spec
        except DFlashError as e:
            bad[path.stem] = str(e)
    return specs, bad


SPECS, BAD_SPECS = _load_specs()


class _StageErrorFilter(logging.Filter):
    """A stage that fails with its own one-line error (dflash.errors: exit 2 or 3) has printed
    it already (the console, via tee); Snakemake's `RuleException: CalledProcessError ...` block
    repeats only the shell command. Drop that block; a crash (any other exit code) keeps it."""

    def filter(self, record):
        msg = record.getMessage()
        return not ("CalledProcessError" in msg and "-m dflash " in msg
                    and re.search(r"returned non-zero exit status [23]\.", msg))


for _handler in logging.getLogger("snakemake.logging").handlers or [None]:
    (_handler or logging.getLogger("snakemake.logging")).addFilter(_StageErrorFilter())


def refused(name):
    """An input function for a bad spec's targets: one clear message, no traceback."""

    def f(wc):
        raise WorkflowError(f"spec {name!r} is refused: {BAD_SPECS[name]}")

    return f


def refuse_requested(targets):
    """Asked for a bad spec's target by name (or a file under results/<spec>/): its one-line
    error and exit 2, before the DAG is built."""
    for target in targets or ():
        stage, _, name = target.partition("_")
        parts = Path(target).parts
        if not (stage in STAGE_TARGETS and name in BAD_SPECS):
            name = parts[1] if len(parts) > 2 and parts[0] == RESULTS else None
        if name in BAD_SPECS:
            print(f"error: spec {name!r} is refused (its targets only): {BAD_SPECS[name]}",
                  file=sys.stderr)
            sys.exit(2)


STAGE_TARGETS = ("env", "warmup", "data", "train", "bench")
# the config (validated by the Snakefile) enters here only
DEFAULT_SPEC = config["default_spec"]
RESULTS = config["results"]
LOGS = config["logs"]
BENCHMARKS = config["benchmarks"]
SLURM = config["slurm"]  # profiles/slurm: jobs go to a SLURM cluster (see device_resources)
wildcard_constraints:
    spec="|".join(SPECS) or "no-specs",


def code_hash(stage):
    """Content hash of the package code and data the stage runs: its module's import closure
    inside dflash/ (computed, see dflash/code_fingerprint.py). Editing dflash/train/scheduler.py
    reruns warmup, train and bench; editing the report template reruns bench only."""
    return stage_code_fingerprint(stage, Path(workflow.basedir, "dflash"))


def spec_params(stage):
    """The spec fields a stage depends on (content, so an edit reruns exactly what it should)."""
    return lambda wc: json.dumps(SPECS[wc.spec].section(stage), sort_keys=True)


def lock_sha(wc):
    lock = Path(workflow.basedir, SPECS[wc.spec].env.lock)
    return sha256_file(lock) if lock.exists() else f"missing:{lock}"


def python_for(wc):
    """The interpreter the stages run in: the built venv (env.mode build) or this one."""
    from dflash.env.venv import interpreter_for

    return interpreter_for(SPECS[wc.spec])


# GPUs, from the specs only. Snakemake never picks devices (the stages use the spec's device
# names), so each job holds every CUDA device its spec names: a resource of capacity 1 per device
# (cuda_0, cuda_1, ...), and two jobs never share a GPU on any machine. `gpu` is the count (for
# executors that place jobs by it; limit it with --resources gpu=N if you like). A spec with
# topology.nodes > 1 holds the GPUs of all its nodes (as they run here: local processes;
# Spec.machine_devices).
CUDA_DEVICES = sorted({d for s in SPECS.values() for d in s.machine_devices() if d != "cpu"},
                      key=lambda d: int(d.split(":", 1)[1]))
for _device in CUDA_DEVICES:
    workflow.register_resource(_device.replace(":", "_"), 1)


def gpus_per_node(spec):
    """GPUs one node of a spec uses: the highest CUDA index it names + 1 (a spec that names
    cuda:5 needs six visible devices; SLURM, like dflash.runtime.launch, numbers a node's GPUs from 0)."""
    idx = [int(d.split(":", 1)[1]) for d in spec.devices() if d.startswith("cuda:")]
    return max(idx) + 1 if idx else 0


def nodes(spec):
    return spec.topology.nodes


# On a SLURM cluster (profiles/slurm sets `config: slurm=True`; snakemake-executor-plugin-slurm
# turns resources into sbatch flags) SLURM places the jobs: a job's GPUs are the ones SLURM gives
# it, numbered from 0 on each node. The per-device resources above would be cluster-wide limits
# there (one cuda_0 job at a time on the whole cluster), and `gpu` becomes `--gpus` (a job total
# that SLURM may spread over nodes), so instead each job asks for `nodes` and `gres: gpu:K` per
# node. Only the train rule may span nodes (topology.nodes); every other stage is a one-node job.


def device_resources():
    """Resources of a stage: this machine's GPUs it holds (locally), or on SLURM a one-node job
    (the train rule adds the multi-node part, train_resources)."""
    if SLURM:
        def gres(wc):
            k = gpus_per_node(SPECS[wc.spec])
            return f"gpu:{k}" if k else None  # None: no such resource (a CPU job)

        return {"nodes": 1, "gres": gres}

    # None, not 0: a resource the job does not hold is left out of its log line (a CPU job's
    # `resources:` would otherwise list gpu=0, cuda_0=0, ... for every GPU of every spec)
    def gpus(wc):
        return len({d for d in SPECS[wc.spec].machine_devices() if d != "cpu"}) or None

    def holds(device):
        return lambda wc: 1 if device in SPECS[wc.spec].machine_devices() else None

    return {"gpu": gpus, **{d.replace(":", "_"): holds(d) for d in CUDA_DEVICES}}


def check_executor():
    """`config: slurm=True` (profiles/slurm) and the SLURM executor go together. A `--config` on the
    command line replaces the profile's list, dropping slurm=True: the jobs would then ask SLURM
    for nothing (no nodes, no GPUs). Checked when a real run starts (not for dry runs)."""
    executor = getattr(workflow.executor_plugin, "name", None)
    if executor is None or executor in ("dryrun", "touch"):
        return
    if (executor == "slurm") != SLURM:
        raise WorkflowError(
            f"config slurm={SLURM} but the executor is {executor!r}: "
            + ("add slurm=True to your --config (it replaces the one profiles/slurm sets)"
               if executor == "slurm" else
               "slurm=True is for the SLURM executor (--workflow-profile profiles/slurm)"))


onstart:
    check_executor()


def srun(n):
    """How the train stage starts on a SLURM allocation of n > 1 nodes: one task per node, each the
    same `python -m dflash train` (dflash/runtime/launch.py: it reads SLURM_NODEID, SLURM_NNODES and
    SLURM_JOB_NODELIST and becomes its node's torchrun, the rendezvous on the first host).
    --kill-on-bad-exit: a rank that dies takes the whole step down. The CPUs per task come from
    the allocation, so `cpus_per_task` stays a profile setting."""
    return (f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 "
            f"--cpus-per-task=${{SLURM_CPUS_PER_TASK:-1}} --kill-on-bad-exit=1 ")


def train_resources():
    """The train rule's resources: a one-node stage's, and under SLURM with topology.nodes > 1 a
    multi-node job: `nodes`, `tasks` = one per node, `gres` per node, and `mpi` — which makes the
    plugin's jobstep run the rule's shell in the allocation as it is instead of under `srun -n1`
    (one task on one node), so the shell starts the ranks itself with `launch` (srun above).
    `launch` is empty otherwise. It sits in the shell command, so the command text (Snakemake's
    `code` rerun trigger) is the same under every profile: a train run on the cluster is not
    redone by a later local `snakemake bench_<spec>`."""
    res = device_resources()

    def launch(wc):
        n = nodes(SPECS[wc.spec])
        return srun(n) if SLURM and n > 1 else ""

    if not SLURM:
        return {**res, "launch": launch}

    def multi(value):  # only on a multi-node job: None leaves the resource out
        return lambda wc: value(nodes(SPECS[wc.spec])) if nodes(SPECS[wc.spec]) > 1 else None

    return {
        **res,
        "nodes": lambda wc: nodes(SPECS[wc.spec]),
        "tasks": multi(lambda n: n),
        # 0: no --ntasks-per-gpu; the plugin would otherwise take `tasks` for it (n tasks per GPU)
        "tasks_per_gpu": multi(lambda n: 0),
        "mpi": multi(lambda n: "srun"),
        "launch": launch,
    }


def spec_file(wc):
    return f"specs/{wc.spec}.yaml"


def stage_cmd(stage, launch=False):
    # `tee` shows live progress on the console and keeps the log; pipefail keeps the exit code.
    # Every value is shell-quoted: the interpreter path derives from the spec's env.lock (build
    # mode) and the results/logs roots from the config, so none may reach the shell raw.
    # `launch`: the rule's `launch` resource goes first (train_resources: srun on a multi-node
    # SLURM job, else empty); it is built from integers only.
    results = shlex.quote(RESULTS).replace("{", "{{").replace("}", "}}")
    prefix = "{resources.launch}" if launch else ""
    return (f"{prefix}{{params.python:q}} -m dflash {stage} {{params.spec:q}} --results {results}"
            f" 2>&1 | tee {{log:q}}")


def bench_outputs(spec):
    """The bench stage's outputs: the report and the ONE plot list (dflash.eval.report.PLOTS)."""
    return [f"{RESULTS}/{spec}/bench/report.json", f"{RESULTS}/{spec}/bench/report.md"] + [
        f"{RESULTS}/{spec}/bench/{p}" for p in PLOTS]


def default_outputs(wc):
    """The default target: the default spec through bench (checked only when it runs: a workflow copy
    may hold other specs only)."""
    if DEFAULT_SPEC in BAD_SPECS:
        refused(DEFAULT_SPEC)(wc)
    if DEFAULT_SPEC not in SPECS:
        raise WorkflowError(f"config: default_spec {DEFAULT_SPEC!r} is not a spec in specs/ "
                            f"(have: {', '.join(SPECS) or 'none'})")
    return bench_outputs(DEFAULT_SPEC)


def upstream(*stages):
    """Checksums of the upstream manifests this stage was made from. With mtime triggers off,
    Snakemake would not notice a deleted or regenerated intermediate manifest when the final
    outputs exist; as a param, a missing or different manifest reruns this stage."""

    def f(wc):
        out = {}
        for st in stages:
            p = Path(RESULTS, wc.spec, st, "manifest.json")
            try:
                out[st] = json.loads(p.read_text()).get("checksum", "none")
            except (OSError, ValueError):
                out[st] = "missing"
        return json.dumps(out, sort_keys=True)

    return f
