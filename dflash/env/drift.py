"""Drift: a live environment against a lock or an env manifest, and the check every stage after
env runs first (:func:`check_env`). ``DFLASH_ALLOW_DRIFT=1`` turns the refusal into a loud
warning that the caller records in its manifest."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .. import settings
from ..errors import DFlashError, EnvDrift
from ..artifacts.manifest import read_manifest, rerun_command, sha256_file
from .facts import PROBE_ONLY, STACK_KEYS, key_stack, live_env
from .lock import version_matches

ALLOW_DRIFT_VAR = settings.ALLOW_DRIFT


def diff_pins(pins: dict[str, dict], facts: dict) -> list[dict]:
    """Every locked package that is missing or has another version in ``facts``."""
    live = facts.get("packages", {})
    out = []
    for key, p in sorted(pins.items()):
        found = live.get(key)
        if not version_matches(p["version"], found):
            out.append({"kind": "package", "name": key, "pinned": p["version"], "found": found})
    return out


def diff_stack(recorded: dict, facts: dict) -> list[dict]:
    """Key stack items that differ; cuDNN/NCCL only when ``facts`` imported torch."""
    live = key_stack(facts)
    probed = facts.get("torch", {}).get("probed", False)
    out = []
    for k in STACK_KEYS:
        if k in PROBE_ONLY and not probed:
            continue
        if recorded.get(k) != live.get(k):
            out.append({"kind": "stack", "name": k, "pinned": recorded.get(k), "found": live.get(k)})
    return out


def diff_manifest(manifest: dict, facts: dict) -> list[dict]:
    """Drift of ``facts`` against an env manifest: pinned packages + key stack (+ venv identity)."""
    pins = {k: {"version": v} for k, v in manifest.get("pinned", {}).items()}
    drift = diff_pins(pins, facts)
    drift += [d for d in diff_stack(manifest.get("stack", {}), facts)
              if not any(x["kind"] == "package" and x["name"] == d["name"] for x in drift)]
    if manifest.get("mode") == "build" and manifest.get("prefix") and \
            os.path.abspath(facts.get("prefix", "")) != os.path.abspath(manifest["prefix"]):
        drift.append({"kind": "stack", "name": "interpreter", "pinned": manifest.get("interpreter"),
                      "found": facts.get("interpreter")})
    return drift


def _fmt(v: Any) -> str:
    if v is None:
        return "not installed"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "none"
    return str(v)


def format_drift(drift: list[dict]) -> str:
    return "\n".join(f"  {d['name']}: pinned {_fmt(d['pinned'])}, found {_fmt(d['found'])}"
                     for d in drift)


def allow_drift() -> bool:
    return settings.allow_drift()


def warn_drift(msg: str) -> None:
    bar = "!" * 78
    print(f"{bar}\nWARNING: {ALLOW_DRIFT_VAR}=1 — proceeding DESPITE environment drift "
          f"(recorded in the manifest):\n{msg}\n{bar}", file=sys.stderr, flush=True)


def check_env(results_dir: str | os.PathLike, probe_torch: bool | None = None) -> dict:
    """Compare the running process to ``results_dir/env/manifest.json``; refuse drift.

    Returns ``{"manifest", "env_fingerprint", "lock_sha256", "drift": [...], "drift_allowed"}``;
    with ``DFLASH_ALLOW_DRIFT=1`` drift is printed loudly to stderr and returned instead of raised
    (record it in the caller's manifest). cuDNN/NCCL are compared when torch is already imported
    (or ``probe_torch=True``); no subprocess is spawned on a machine without NVIDIA GPUs.
    """
    path = Path(results_dir) / "env" / "manifest.json"
    manifest = read_manifest(path, "env")
    if probe_torch is None:
        probe_torch = "torch" in sys.modules
    facts = live_env(None, probe_torch=probe_torch)
    drift = diff_manifest(manifest, facts)
    lock_path = manifest.get("lock", {}).get("path")
    if lock_path and Path(lock_path).is_file():
        now = sha256_file(lock_path)
        if now != manifest["lock"].get("sha256"):
            drift.append({"kind": "lock", "name": f"lock file {lock_path}",
                          "pinned": manifest["lock"].get("sha256"), "found": now})
    result = {"manifest": str(path), "env_fingerprint": manifest["fingerprints"].get("env"),
              "lock_sha256": manifest["fingerprints"].get("lock"), "drift": drift,
              "drift_allowed": False}
    if drift:
        n_pkg = sum(d["kind"] == "package" for d in drift)
        msg = (f"{path}: environment drift — {sys.executable} differs from the environment the "
               f"env stage pinned ({n_pkg} package(s), {len(drift) - n_pkg} other item(s)):\n"
               f"{format_drift(drift)}\n"
               f"Rebuild/reverify it: rerun the env stage "
               f"(`{rerun_command('env', path)}`), "
               f"or audit with `dflash audit {path}`; {ALLOW_DRIFT_VAR}=1 overrides.")
        if not allow_drift():
            raise EnvDrift(msg)
        warn_drift(msg)
        result["drift_allowed"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    """``dflash check-env results/<spec>``: this interpreter against the env manifest (exit 0
    OK, 1 drift, 2 bad input)."""
    ap = argparse.ArgumentParser(prog="dflash check-env", description=main.__doc__.split(":")[0])
    ap.add_argument("results_dir", help="results/<spec>")
    a = ap.parse_args(argv)
    try:
        r = check_env(a.results_dir)
    except EnvDrift as e:
        print(str(e), file=sys.stderr)
        return 1
    except DFlashError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"env: OK{' (drift allowed)' if r['drift_allowed'] else ''}: "
          f"{sys.executable} matches {r['manifest']}")
    return 0
