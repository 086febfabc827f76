"""Build mode: an isolated venv from a lock (``pip install --require-hashes --no-deps``, offline
from ``env.wheel_dir`` when given) at ``.venvs/<lockstem>-<sha12>/``, a path derived from the lock
content, so a changed lock gives a new venv and an unchanged one is reused once verified."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .. import settings
from ..artifacts.manifest import atomic_write_json, file_lock, fingerprint
from .drift import diff_pins, format_drift
from .facts import live_env
from .lock import LockError, check_python_tag, lock_digest, lock_files, locked_pins

VENV_DIR_VAR = settings.VENV_DIR          # where build-mode venvs live (default: ./.venvs)
MARKER = ".dflash-env.json"               # written last into a complete, verified venv


def _venvs_root() -> Path:
    return Path(settings.venv_dir() or Path.cwd() / ".venvs")


def venv_path(lock: str | os.PathLike) -> Path:
    lock = Path(lock)
    digest = fingerprint(lock_digest(lock))[:12]
    return _venvs_root() / f"{lock.stem}-{digest}"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def interpreter_for(spec) -> str:
    """The python later stages run with: the lock's venv in build mode, this one in adopt mode.
    (The path is returned even before the env stage built it.)"""
    if spec.env.mode == "build":
        return str(_venv_python(venv_path(spec.env.lock)).absolute())
    # one spelling: `python`, `python3` and `python3.11` name the same interpreter, and Snakemake
    # treats this path as a rule param (a different spelling must not rerun every stage). Not
    # realpath: a venv's bin/python is a symlink to the base interpreter, outside the venv.
    canonical = Path(sys.prefix) / "bin" / "python"
    return str(canonical) if canonical.exists() else sys.executable


def _pip_failure(lock: Path, rc: int, out: str, log: Path) -> LockError:
    m = re.search(r"^\s*([A-Za-z0-9._-]+)==(\S+) from (\S+).*?:\s*\n\s*Expected sha256 (\S+)"
                  r"(?:\s*\n\s*(?:or \S+\s*\n\s*)*)?\s*Got\s+(\S+)", out, re.M)
    if m:
        name, ver, url, exp, got = m.groups()
        return LockError(f"{lock}: hash check failed for {name}=={ver}: the lock expects sha256 "
                         f"{exp[:16]}…, the file {url} has {got[:16]}… — the lock or the wheel "
                         f"changed; regenerate the lock (docs/env.md) or fix env.wheel_dir")
    m = re.search(r"Hashes are required in --require-hashes mode.*?\n\s*(\S+)", out, re.S)
    if m:
        return LockError(f"{lock}: {m.group(1)} has no --hash in the lock (every package needs one "
                         f"in build mode); regenerate the lock (docs/env.md)")
    m = re.search(r"Could not find a version that satisfies the requirement (\S+)", out)
    if m:
        return LockError(f"{lock}: {m.group(1)} is not available"
                         f"{' in the wheel dir' if '--no-index' in out else ''} "
                         f"(pip exit {rc}; full log {log})")
    errs = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("ERROR")]
    return LockError(f"{lock}: pip install failed (exit {rc}): "
                     f"{errs[-1] if errs else 'see log'} (full log {log})")


def _outer_pip() -> bool:
    # Not importlib.util.find_spec("pip"): setuptools' distutils shim (a sys.meta_path finder)
    # takes a lookup of "pip" for pip being imported and disables itself for the whole process;
    # the next setuptools import (inductor's CPU C++ build does one) then fails an assertion.
    try:
        importlib.metadata.distribution("pip")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def pip_cmd(python: Path) -> list[str]:
    """pip for the venv: this interpreter's pip aimed at it (``pip --python``: the venv needs no
    pip of its own and is created in a fraction of a second), else the venv's own pip."""
    if _outer_pip():
        return [sys.executable, "-m", "pip", "--python", str(python)]
    return [str(python), "-m", "pip"]


def _pip_install(python: Path, lock: Path, wheel_dir: str | None, log: Path) -> None:
    cmd = pip_cmd(python) + ["install", "--require-hashes", "--no-deps",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    if wheel_dir:
        cmd += ["--no-index", "--find-links", str(Path(wheel_dir).absolute())]
    cmd += ["-r", str(lock)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}\n[exit {p.returncode}]\n")
    if p.returncode != 0:
        raise _pip_failure(lock, p.returncode, f"{' '.join(cmd)}\n{p.stdout}\n{p.stderr}", log)


def build_venv(lock: str | os.PathLike, wheel_dir: str | None = None,
               log: str | os.PathLike | None = None) -> tuple[Path, dict, bool]:
    """Create (or reuse, once verified) the venv for ``lock``. Returns (venv, facts, reused)."""
    lock = Path(lock)
    digest = lock_digest(lock)
    locked_pins(lock)                   # parse errors surface before any work
    check_python_tag(lock)
    if wheel_dir and not Path(wheel_dir).is_dir():
        raise LockError(f"env.wheel_dir {wheel_dir}: not a directory")
    venv = venv_path(lock)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else venv.parent / f"{venv.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(venv.parent / f".{venv.name}.lock"):  # one builder, others wait and reuse
        py = _venv_python(venv)
        marker = venv / MARKER
        if marker.is_file() and py.exists():
            try:
                ok = json.loads(marker.read_text()).get("digest") == digest
            except ValueError:
                ok = False
            if ok:
                facts = live_env(str(py))
                drift = diff_pins(locked_pins(lock, facts), facts)
                if not drift:
                    return venv, facts, True
                print(f"env: {venv} no longer matches {lock}; rebuilding it:\n"
                      f"{format_drift(drift)}", file=sys.stderr)
        if venv.exists():
            shutil.rmtree(venv)
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "venv", str(venv)]
                           + (["--without-pip"] if _outer_pip() else []),
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise LockError(f"{venv}: could not create a venv with {sys.executable}: "
                            f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
        for f in lock_files(lock):
            _pip_install(py, f, wheel_dir, log)
        facts = live_env(str(py))
        drift = diff_pins(locked_pins(lock, facts), facts)
        if drift:
            raise LockError(f"{lock}: the new venv {venv} does not match the lock after install:\n"
                            f"{format_drift(drift)}")
        atomic_write_json(marker, {"digest": digest, "lock": str(lock),
                                   "built_unix": round(time.time(), 3),
                                   "build_seconds": round(time.time() - t0, 1)})
        return venv, facts, False
