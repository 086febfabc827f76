"""`dflash validate`: check specs (or every arm of a sweep) before any heavy work and print their
budgets. Schema and cross-field rules, the data checks that need no model, the devices, then the
budgets (memory per device, disk, rough time per stage, a feature cache) and the disk refusal.
The CLI dispatches here by name, so none of this is in a stage's code fingerprint.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import yaml

from ..data.check import check_data
from ..errors import DFlashError
from ..stages import results_dir
from ..train.budget import budget, check_disk, render
from ..train.tracker import check_tracker
from .load import check_devices as devices_present
from .load import load_spec
from .sweeps import load_sweep
from .types import cache_mode


def _print_cache_budget(spec, root: str, check_devices: bool = True) -> None:
    """``features.cache`` on: its storage budget against this machine's free memory or disk
    (exact once the data stage has run, else an upper bound from data.*). An exact budget
    that does not fit fails here as it would fail the train stage. A store on a CUDA device
    that cannot be asked (``--no-devices``, or no CUDA here) is printed, not checked."""
    if cache_mode(spec) == "off":
        return  # no torch import for the common case
    fc = importlib.import_module("dflash.train.cache_budget")  # by name: not for the common case
    dev = fc.cache_device(spec) if cache_mode(spec) == "device" else None
    unknown = bool(dev and dev.startswith("cuda")) and not (
        check_devices and fc.torch.cuda.is_available())
    b = fc.spec_budget(spec, results_dir(spec, root), available=0 if unknown else None)
    if b is None:
        return
    if unknown:
        print(f"   {b.need()}: not checked against {dev}'s free memory (no devices asked here)")
        return
    verdict = "fits" if b.fits else "does NOT fit: the train stage would refuse it"
    print(f"   {b.describe()}: {verdict}")
    if not b.upper_bound:
        fc.check_budget(b, spec.path)


def _specs_in(path: str) -> list:
    """(where, spec) for a spec file, or for every arm of a sweep file (under sweeps/)."""
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
                    check_tracker(s)
                # the disk check is this machine's: skipped with the devices (a spec for elsewhere)
                b = check_disk(s, Path(results)) if check_devices else budget(s, Path(results))
            except DFlashError as e:
                failed += 1
                print(f"error: {e}", file=sys.stderr, flush=True)
                continue
            nodes = f" on each of {s.topology.nodes} nodes" if s.topology.nodes > 1 else ""
            print(f"ok: {where} (spec '{s.name}', devices {', '.join(s.devices())}{nodes})")
            print("\n".join(render(b)), flush=True)
            _print_cache_budget(s, results, check_devices)
            if show:  # JSON first: tuples become lists, as YAML can dump them
                print(f"--- # {where} as validated")
                print(yaml.safe_dump(json.loads(json.dumps(s.to_dict())), sort_keys=False))
    if checked > 1:
        print(f"{checked - failed} of {checked} specs ok", file=sys.stderr if failed
              else sys.stdout)
    return 2 if failed else 0
