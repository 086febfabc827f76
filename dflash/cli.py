"""`dflash <command>`: the stages Snakemake runs, plus validate and the tools (audit, status, ...).

Every user-facing failure is one message (naming the file and field) and a non-zero exit; the
last line of a failed stage's log says what failed and what to do.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from .errors import DFlashError

# The one dispatch table. Stages: dflash.stages.<name>.run(ctx), what Snakemake's rules run;
# imported by name, and no stage module imports another (what two stages share lives in the
# library: the bench stage's timed run is dflash.train.trainer), so no stage's code fingerprint
# (dflash.code_fingerprint) includes another stage module. Tools: dflash.<module>.main(argv)
# takes the rest of the command line.
STAGES = ("env", "warmup", "data", "train", "bench")
TOOLS = {
    "audit": ("env.audit", "pinned vs live environment; non-zero on drift"),
    "check-env": ("env.drift", "this interpreter against results/<spec>/env; exit 1 on drift"),
    "link": ("sharing", "results/<spec>/<stage> as hard links to a shared store entry"),
    "lock-from-freeze": ("env.freeze", "an adopt-mode lock from `pip list --format=freeze`"),
    "export-check": ("models.export_check", "is an exported drafter folder intact (checksums)"),
    "status": ("runtime.status", "live status of a training run"),
    "stress": ("runtime.stress", "race stress harness (gate on/off)"),
    "sweep-report": ("stages.sweep", "one table and plot over a sweep's arms (sweeps/<name>.yaml)"),
}


# Function-local imports below, on purpose (ruff PLC0415 is off for this file): `dflash` starts
# every command with the standard library only (`check-env` runs in a bare interpreter, `status`
# must answer at once), and each command loads only what it runs (the spec: jsonschema + yaml;
# the stages: torch).
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


def _print_cache_budget(spec, root: str) -> None:
    """``features.cache`` on: its storage budget against this machine's free memory or disk
    (exact once the data stage has run, else an upper bound from data.*). An exact budget
    that does not fit fails here as it would fail the train stage."""
    from .spec_types import cache_mode  # validate only

    if cache_mode(spec) == "off":
        return  # no torch import for the common case
    from .stages import results_dir

    # by name, like the stages: validate's model-side checks stay out of every stage's code
    # fingerprint (dflash.code_fingerprint follows static imports only)
    fc = importlib.import_module("dflash.train.cache_budget")
    b = fc.spec_budget(spec, results_dir(spec, root))
    if b is None:
        return
    verdict = "fits" if b.fits else "does NOT fit: the train stage would refuse it"
    print(f"   {b.describe()}: {verdict}")
    if not b.upper_bound:
        fc.check_budget(b, spec.path)


def _specs_in(path: str) -> list:
    """(where, spec) for a spec file, or for every arm of a sweep file (under sweeps/)."""
    from .spec import load_spec  # validate only
    from .sweeps import load_sweep

    if Path(path).parent.name != "sweeps":
        return [(path, load_spec(path))]
    sw = load_sweep(path)
    print(f"ok: {path} (sweep '{sw.name}' on {sw.base}: {len(sw.arms)} arms, "
          f"{', '.join(sw.arm_names())})")
    return [(str(a.spec.path), a.spec) for a in sw.arms]


def validate(paths: list[str], check_devices: bool, results: str = "results",
             show: bool = False) -> int:
    """Check every spec (or sweep arm) given and report each (exit 2 if any fails): schema and
    cross-field rules, the data checks that need no model, the devices (unless --no-devices),
    then the budgets (memory per device, disk, rough time per stage, a feature cache) and the
    disk refusal. ``show``: print each spec as validated (bases merged, defaults filled)."""
    import yaml  # validate only (not in a bare interpreter)

    from .spec import check_devices as devices_present

    # by name, like the stages: the CLI is in every stage's code closure (code_fingerprint)
    check_data = importlib.import_module("dflash.data.check").check_data
    bud = importlib.import_module("dflash.train.budget")

    failed, checked = 0, 0
    for path in paths:
        try:
            specs = _specs_in(path)
        except DFlashError as e:
            failed, checked = failed + 1, checked + 1
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        for where, s in specs:
            checked += 1
            try:
                if check_devices:
                    devices_present(s)
                check_data(s)
                if check_devices:  # like the devices: what is installed here
                    importlib.import_module("dflash.train.tracker").check_tracker(s)
                # the disk check is this machine's: skipped with the devices (a spec for elsewhere)
                b = bud.check_disk(s, Path(results)) if check_devices else bud.budget(s, Path(results))
            except DFlashError as e:
                failed += 1
                print(f"error: {e}", file=sys.stderr, flush=True)
                continue
            nodes = f" on each of {s.topology.nodes} nodes" if s.topology.nodes > 1 else ""
            print(f"ok: {where} (spec '{s.name}', devices {', '.join(s.devices())}{nodes})")
            print("\n".join(bud.render(b)), flush=True)
            _print_cache_budget(s, results)
            if show:  # JSON first: tuples become lists, as YAML can dump them
                print(f"--- # {where} as validated")
                print(yaml.safe_dump(json.loads(json.dumps(s.to_dict())), sort_keys=False))
    if checked > 1:
        print(f"{checked - failed} of {checked} specs ok", file=sys.stderr if failed
              else sys.stdout)
    return 2 if failed else 0


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
                       "(default: <results>/<spec>; Snakemake's shared store, dflash.sharing)")
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
            return validate(a.specs, not a.no_devices, a.results, show=a.show)
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
