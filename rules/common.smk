# Shared by every rule: the specs, what each stage depends on, and how stages are invoked.
import json
import logging
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The one sys.path edit, on purpose (docs/design.md "Where things live"): this workflow imports
# the package beside its own Snakefile, so a copy of the workflow runs the copy's code even where
# another checkout is installed (editable) in the interpreter.
sys.path.insert(0, workflow.basedir)

from snakemake.cli import get_argument_parser

from dflash.artifacts.code_fingerprint import stage_code_fingerprint
from dflash.data.check import check_data
from dflash.errors import DFlashError
from dflash.eval.report import PLOTS
from dflash.artifacts.manifest import check_output
from dflash.artifacts.sharing import lock_digest
from dflash.runtime import resources
from dflash.spec.load import load_spec
from dflash.spec.sweeps import load_sweeps, materialise
from dflash.spec.types import no_decoders_stage


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


def command_line_targets():
    """The targets of the `snakemake` command line, read with Snakemake's own parser (its options'
    values never count as targets), or None where that is not known: a job sent to a cluster node
    (--target-jobs), a workflow run through the API. Snakemake hands its DAG settings to the
    workflow only after the parse, so this is the one way the rules see what was asked for."""
    try:
        args, _ = get_argument_parser().parse_known_args(sys.argv[1:])
    except SystemExit:  # not a snakemake command line
        return None
    return None if args.target_jobs else list(args.targets or ())


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


STAGE_TARGETS = ("env", "warmup", "data", "decoders", "train", "bench")
# the config (validated by the Snakefile) enters here only
DEFAULT_SPEC = config["default_spec"]
RESULTS = config["results"]
LOGS = config["logs"]
BENCHMARKS = config["benchmarks"]
SLURM = config["slurm"]  # profiles/slurm: jobs go to a SLURM cluster (see device_resources)
GPU_JOBS = config["gpu_jobs"]  # jobs per CUDA device (config/config.schema.yaml: default 1)
GPU_MEMORY_GB = config.get("gpu_memory_gb")  # each device's memory (default: nvidia-smi's)


def _load_sweep_arms():
    """sweeps/<name>.yaml: each arm becomes a spec (dflash/spec/sweeps.py), its merged file (under
    results/<sweep>.sweep/specs/, for the stages to read) written by `spec_file` when a job of
    the arm is planned, never at parse; rules/sweeps.smk adds bench_<sweep>."""
    try:
        sweeps, files = load_sweeps(Path(workflow.basedir, "sweeps"), RESULTS, SPECS)
    except DFlashError as e:
        raise WorkflowError(str(e)) from None
    SPECS.update({a.name: a.spec for sw in sweeps.values() for a in sw.arms})
    return sweeps, {name: str(path) for name, path in files.items()}


SWEEPS, SPEC_FILES = _load_sweep_arms()
wildcard_constraints:
    spec="|".join(SPECS) or "no-specs",


def code_hash(stage):
    """Content hash of the package code and data the stage runs: its module's import closure
    inside dflash/ (computed, see dflash/artifacts/code_fingerprint.py). Editing dflash/train/scheduler.py
    reruns warmup, train and bench; editing the report template reruns bench only."""
    return stage_code_fingerprint(stage, Path(workflow.basedir, "dflash"))


def spec_params(stage):
    """The spec fields a stage depends on (content, so an edit reruns exactly what it should)."""
    return lambda wc: json.dumps(SPECS[wc.spec].section(stage), sort_keys=True)


def lock_sha(wc):
    return lock_digest(SPECS[wc.spec], workflow.basedir)


def python_for(wc):
    """The interpreter the stages run in: the built venv (env.mode build) or this one."""
    from dflash.env.venv import interpreter_for

    return interpreter_for(SPECS[wc.spec])


# GPUs, from the specs only (dflash/runtime/resources.py says how, locally and on SLURM): a
# resource of 3 x gpu_jobs units (default 1) per CUDA device any spec names. Train and bench
# hold a device whole (3), so by default they never share a GPU; a warm-up, data or decoders
# stage whose estimated memory is small beside the device's holds a third (1): a small pair's
# warm-up and decoders run beside its data stage. register_resource overrides
# `--resources cuda_0=N`: the config decides.
CUDA_DEVICES = resources.cuda_devices(SPECS)
for _device in CUDA_DEVICES:
    workflow.register_resource(resources.resource_name(_device), resources.UNITS * GPU_JOBS)
# each device's memory: config gpu_memory_gb, else nvidia-smi (none: every stage holds it whole)
DEVICE_BYTES = resources.device_memory(CUDA_DEVICES, GPU_MEMORY_GB)
_STAGE_BYTES = {}


def _import_estimator():
    """(dflash.train.budget.stage_memory or None where it cannot be imported, seconds taken),
    each CUDA spec's target config read meanwhile (hf_config keeps a GGUF's, the ~3 s of the
    first estimate: then an estimate is arithmetic)."""
    t0 = time.perf_counter()
    try:
        from dflash.train.budget import stage_memory
        from dflash.models.target import hf_config
    except Exception:  # no estimate (say the target's package is not in this interpreter):
        return None, time.perf_counter() - t0  # the safe rule, every stage holds its GPU whole
    for target in {s.target for s in SPECS.values() if set(s.machine_devices()) - {"cpu"}}:
        try:
            hf_config(target)
        except Exception:  # that spec's estimate fails the same way later: its GPU whole
            pass
    return stage_memory, time.perf_counter() - t0


# Rounds 18 and 19 on an H200 waited 45 s and 36 s after the env stage before the warm-up and
# data stage started (round 17's DAG, before the sharing, none). The one new work at that point
# is the estimator: it imports torch and transformers into Snakemake's own process, which
# schedules nothing meanwhile. The import (and the reading of the targets' configs) starts here,
# in a thread, so the DAG's first job (env) runs while it loads; device_share waits for it and
# logs what each estimate cost (the next lease says whether that was the wait).
_ESTIMATOR = (ThreadPoolExecutor(1, "estimator-import").submit(_import_estimator)
              if any(DEVICE_BYTES.values()) else None)


def device_share(spec, stage, device):
    """The units of `device` a job of `spec`'s `stage` holds (dflash.runtime.resources.units).
    The estimate (dflash.train.budget.stage_memory: torch and the target's config) is made
    only for a stage that may share, on a machine whose devices' memory is known, once a spec."""
    estimate = None
    if stage in resources.SHARING_STAGES and DEVICE_BYTES.get(device):
        if spec not in _STAGE_BYTES:
            waited = time.perf_counter()
            stage_memory, import_s = _ESTIMATOR.result()
            t0 = time.perf_counter()
            try:
                _STAGE_BYTES[spec] = stage_memory(SPECS[spec])
            except Exception:  # no estimator or no estimate: the safe rule, the GPU whole
                _STAGE_BYTES[spec] = None
            print(f"[resources] {spec}: memory estimate in {time.perf_counter() - t0:.1f} s, "
                  f"{t0 - waited:.1f} s waited for the estimator's import "
                  f"({import_s:.1f} s in all)", file=sys.stderr)
        if _STAGE_BYTES[spec] is not None:
            estimate = _STAGE_BYTES[spec][stage].get(device, 0)
    return resources.units(stage, estimate, DEVICE_BYTES.get(device))


def device_resources(stage):
    return resources.device_resources(SPECS, SLURM, stage, device_share)


def train_resources():
    return resources.train_resources(SPECS, SLURM, device_share)


onstart:
    _mismatch = resources.executor_mismatch(getattr(workflow.executor_plugin, "name", None), SLURM)
    if _mismatch:
        raise WorkflowError(_mismatch)


def intact(stage):
    """An input function that adds no input: it checks the stage's own output by content first
    (dflash.artifacts.manifest.check_output). A damaged one (an edited manifest, a changed dataset or
    drafter file) is set aside, so the output is missing and Snakemake reruns the stage, even
    in a dry run (`snakemake -n` shows it), with no --forcerun."""

    def f(wc):
        if hasattr(wc, "key"):  # a store entry shared by content (rules/share.smk)
            spec = SHARE_REP[stage][wc.key]
            said = check_output(Path(shared_manifest(stage, wc.key)), stage, spec)
            if said:  # what the user knows: their spec's folder, hard links to this copy
                said += f" (results/{spec}/{stage}/ holds hard links to this shared copy)"
        else:
            said = check_output(Path(RESULTS, wc.spec, stage, "manifest.json"), stage)
        if said:
            print(said, file=sys.stderr)
        return []

    return f


def spec_file(wc):
    """The spec file a job of wc.spec reads; a sweep arm's merged file is written here, when a job
    of that arm is planned (a param function), so a parse writes nothing for unrequested arms."""
    if wc.spec not in SPEC_FILES:
        return f"specs/{wc.spec}.yaml"
    sweep = next(sw for sw in SWEEPS.values() if wc.spec in sw.arm_names())
    return str(materialise(sweep, RESULTS, names={wc.spec})[wc.spec])


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


def decoders_input(wc):
    """The bench's input from the decoders stage (its decoding sweep compiled ahead, beside the
    data stage): the manifest where the spec has the stage (dflash.spec.types.no_decoders_stage),
    else nothing, so a CPU spec's DAG has no such job."""
    if no_decoders_stage(SPECS[wc.spec]) is not None:
        return []
    return [f"{RESULTS}/{wc.spec}/decoders/manifest.json"]


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
