"""`dflash <command>`: the stages Snakemake runs, plus validate and the tools (audit, status, ...).

Every user-facing failure is one message (naming the file and field) and a non-zero exit; the
last line of a failed stage's log says what failed and what to do.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from .errors import DFlashError

# The one dispatch table. Stages: dflash.stages.<name>.run(ctx), what Snakemake's rules run;
# imported by name, and no stage module imports another (what two stages share lives in the
# library: the bench stage's timed run is dflash.train.trainer), so no stage's code fingerprint
# (dflash.artifacts.code_fingerprint) includes another stage module. Tools: dflash.<module>.main(argv)
# takes the rest of the command line.
STAGES = ("env", "warmup", "data", "decoders", "train", "bench")
TOOLS = {
    "audit": ("env.audit", "pinned vs live environment; non-zero on drift"),
    "check-env": ("env.drift", "this interpreter against results/<spec>/env; exit 1 on drift"),
    "link": ("artifacts.sharing", "results/<spec>/<stage> as hard links to a shared store entry"),
    "lock-from-freeze": ("env.freeze", "an adopt-mode lock from `pip list --format=freeze`"),
    "generate": ("generate", "try a trained drafter on prompts: answers, τ, speed-up, lossless"),
    "export-check": ("models.export_check", "is an exported drafter folder intact (checksums)"),
    "status": ("runtime.status", "live status of a training run"),
    "stress": ("runtime.stress", "race stress harness (gate on/off)"),
    "sweep-report": ("eval.sweep_report", "one table and plot over a sweep's arms (sweeps/<name>.yaml)"),
}


# Function-local imports below, on purpose (ruff PLC0415 is off for this file): `dflash` starts
# every command with the standard library only (`check-env` runs in a bare interpreter, `status`
# must answer at once), and each command loads only what it runs (a stage: the spec, torch).
def run_stage(name: str, spec_path: str, root: str = "results", at: str | None = None,
              env_at: str | None = None) -> dict:
    from .stages import begin  # the spec and a stage: only for `dflash <stage>`

    if name == "train":  # topology.nodes > 1: this process becomes torchrun (dflash.runtime.launch)
        from .runtime.distributed import select_local_gpus  # torch: the train stage only
        from .runtime.launch import maybe_launch

        maybe_launch(spec_path, root)
        select_local_gpus()  # a simulated node's own GPUs, before anything touches CUDA
    ctx = begin(spec_path, name, root, at=at, env_at=env_at)
    return importlib.import_module(f"dflash.stages.{name}").run(ctx)


# Third-party progress bars (GGUF conversion, weight loading, hub downloads) would fill every
# stage's log; the stages print their own progress. TQDM_DISABLE=0 brings them back.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def main(argv: list[str] | None = None) -> int:
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="dflash", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        p = sub.add_parser(s, help=f"run the {s} stage for a spec")
        p.add_argument("spec", help="specs/<name>.yaml")
        p.add_argument("--results", default="results", help="results root (default: results)")
        p.add_argument("--at", help="the folder the stage writes its <stage>/ into "
                       "(default: <results>/<spec>; Snakemake's shared store, dflash.artifacts.sharing)")
        p.add_argument("--env-at", help="the folder whose env/ the stage checks (default: --at)")
    p = sub.add_parser("validate", help="check specs or sweeps (schema, cross-field rules, data, "
                                        "devices) and print their budgets")
    p.add_argument("specs", nargs="+", help="specs/<name>.yaml or sweeps/<name>.yaml (every arm)")
    p.add_argument("--no-devices", action="store_true",
                   help="skip the check that the spec's devices exist here (e.g. a GPU spec "
                        "on a CPU box)")
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument("--show", action="store_true",
                   help="print each spec as validated: bases merged in, every default filled")
    for name, (_, hlp) in TOOLS.items():
        p = sub.add_parser(name, help=hlp, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv[:1] if argv and argv[0] in TOOLS else argv)
    try:
        if a.cmd in TOOLS:
            return importlib.import_module(f"dflash.{TOOLS[a.cmd][0]}").main(argv[1:])
        if a.cmd == "validate":
            # by name, like the stages: validate's checks stay out of every stage's code
            # fingerprint (dflash.artifacts.code_fingerprint follows static imports only)
            return importlib.import_module("dflash.spec.validate").validate(
                a.specs, not a.no_devices, a.results, show=a.show)
        run_stage(a.cmd, a.spec, a.results, a.at, a.env_at)
        return 0
    except DFlashError as e:
        if getattr(e, "__cause__", None) is not None and a.cmd in STAGES:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        if a.cmd in STAGES:
            print(f"what to do: fix the cause above, then rerun the same snakemake command "
                  f"(only the {a.cmd} stage and what follows it will run).", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
