"""The env stage: a pinned, hash-checked Python environment, recorded in ``results/<spec>/env``.

Two modes (``spec.env.mode``):

* ``build`` — create an isolated venv from the lock (:mod:`dflash.env.venv`); later stages run
  inside it (:func:`dflash.env.venv.interpreter_for` names its python).
* ``adopt`` — the running interpreter is the environment (a machine image that ships its own stack,
  e.g. the GPU box); every locked package must be present with exactly the pinned version.

Either way the stage first checks that the spec's devices exist, then writes
``results/<spec>/env/manifest.json`` (lock sha256, interpreter, python, every installed package, the
key stack: torch, CUDA, cuDNN, NCCL, triton, transformers, NVIDIA driver, GPU names).
Later stages check it at start (:func:`dflash.env.drift.check_env`); ``dflash audit`` prints
pinned vs live.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..env.drift import ALLOW_DRIFT_VAR, allow_drift, diff_pins, format_drift, warn_drift
from ..env.facts import env_fingerprint, found_devices, key_stack, live_env
from ..env.lock import check_python_tag, installs_no_deps, lock_digest, lock_files, locked_pins
from ..env.overlay import install_overlay
from ..env.venv import build_venv
from ..errors import EnvDrift
from ..artifacts.manifest import sha256_file, write_manifest
from ..spec.load import check_devices
from . import StageContext


def run(ctx: StageContext) -> dict:
    """Build or adopt the environment; write and return ``results/<spec>/env/manifest.json``."""
    spec = ctx.spec
    mode, lock = spec.env.mode, Path(spec.env.lock)
    found = found_devices()
    check_devices(spec, found)                      # seconds, before any install
    digest = lock_digest(lock)
    check_python_tag(lock)
    out_dir = ctx.results / "env"       # created by write_manifest: a failed run leaves nothing
    t0 = time.time()
    venv, reused = None, None
    if mode == "build":                 # pip's log goes beside the venv (.venvs/<venv>.log)
        venv, facts, reused = build_venv(lock, spec.env.wheel_dir)
    else:                               # the image, plus its overlay lock (dflash.env.overlay)
        facts = live_env(None, probe_torch=True)
        added = install_overlay(lock, spec.env.wheel_dir, facts["packages"])
        if added:
            print(f"[env] overlay: installed {len(added)} pinned package(s) from the wheel dir",
                  flush=True)
            facts = live_env(None, probe_torch=True)
    pins = locked_pins(lock, facts)
    drift = diff_pins(pins, facts)
    drift_allowed = False
    if drift:
        msg = (f"{lock}: the running interpreter {sys.executable} does not match the lock "
               f"(env.mode adopt, spec {spec.name}):\n{format_drift(drift)}\n"
               f"Install the lock (pip install --require-hashes -r {lock}), use env.mode: build, "
               f"or regenerate the lock from this machine (docs/env.md); {ALLOW_DRIFT_VAR}=1 "
               f"overrides.")
        if not allow_drift():
            raise EnvDrift(msg)
        warn_drift(msg)
        drift_allowed = True
    facts["lock_sha256"] = digest["lock"]
    stack = key_stack(facts)
    fps = {"lock": digest["lock"], "env": env_fingerprint(facts)}
    fps.update({k: v for k, v in digest.items() if k != "lock"})  # companion and overlay locks
    files = lock_files(lock)
    body = write_manifest(
        out_dir / "manifest.json", "env", fingerprints=fps,
        spec=spec.name, shared_with=ctx.shared_with, mode=mode,
        lock={"path": str(lock), "sha256": digest["lock"]},
        lock_files=[{"path": str(f), "sha256": sha256_file(f), "no_deps": installs_no_deps(f)}
                    for f in files],
        interpreter=facts["interpreter"], prefix=facts["prefix"],
        venv=str(venv.absolute()) if venv else None, venv_reused=reused,
        python=facts["python"], implementation=facts["implementation"],
        platform=facts["platform"], machine=facts["machine"], system=facts["system"],
        stack=stack, torch=facts["torch"], nvidia=facts["nvidia"],
        cuda_visible_devices=facts.get("cuda_visible_devices"),
        devices={"asked": list(dict.fromkeys(spec.devices())), "found": found},
        pinned={k: p["version"] for k, p in sorted(pins.items())},
        packages=facts["packages"], drift=drift, drift_allowed=drift_allowed,
        seconds=round(time.time() - t0, 2),
    )
    print(f"[env] {body['mode']} {body['lock']['path']} -> {body['interpreter']}: "
          f"{len(body['packages'])} packages recorded; "
          + ", ".join(f"{k} {v}" for k, v in stack.items() if v) +
          f"; env fingerprint {body['fingerprints']['env']}", flush=True)
    return body
