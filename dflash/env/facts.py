"""Live facts of an interpreter: every installed package, the key stack (python, torch, CUDA,
cuDNN, NCCL, triton, transformers, NVIDIA driver, GPU names) and the devices present.

One self-contained, stdlib-only collector (:func:`_collect_facts`), run in-process or, by its
source, in another interpreter (a build-mode venv).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from ..artifacts.manifest import fingerprint
from .lock import LockError

STACK_KEYS = ("python", "torch", "cuda", "cudnn", "nccl", "triton", "transformers", "driver", "gpus")
PROBE_ONLY = ("cudnn", "nccl")            # known only after `import torch`


def nvidia_probe(allow_subprocess: bool = True) -> tuple[str | None, list[str]]:
    """The NVIDIA driver version and GPU model names: the driver's /proc files, else nvidia-smi.
    Stdlib only and self-contained (its source runs in other interpreters, :func:`live_env`)."""
    # self-contained: this function's source runs alone in another interpreter (live_env)
    import glob
    import re
    import shutil
    import subprocess

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
    return driver, gpus


def _collect_facts(probe_torch: bool = True, allow_subprocess: bool = True) -> dict:
    # self-contained: this function's source runs alone in another interpreter (live_env)
    import importlib.metadata as md
    import os
    import platform
    import re
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
    driver, gpus = nvidia_probe(allow_subprocess)
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
    src = (inspect.getsource(nvidia_probe) + inspect.getsource(_collect_facts)
           + "\nimport json\n"
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


def found_devices() -> list[str]:
    """The devices here: torch's count, or (no torch in this interpreter) the NVIDIA driver's."""
    try:
        from ..spec.load import live_devices  # needs torch and jsonschema: absent outside the env
        return live_devices()
    except ImportError:                 # no torch in the outer interpreter (build mode): count GPUs
        n = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis is not None:
            n = min(n, len([x for x in vis.split(",") if x.strip()]))
        return ["cpu"] + [f"cuda:{i}" for i in range(n)]


def hardware_facts(devices: list[str], env_manifest: dict) -> dict:
    """The GPUs the run used: model name per topology device, their count, the NVIDIA driver
    (the env stage's record of this machine, else :func:`nvidia_probe`). CPU runs say so."""
    gpus = sorted({d for d in devices if d.startswith("cuda")},
                  key=lambda d: int(d.partition(":")[2] or 0))
    if not gpus:
        return {"accelerator": "cpu", "gpu_count": 0, "gpus": [], "driver": None,
                "note": "CPU run: no GPU in the topology"}
    import torch  # env/ imports the standard library only (it runs before the pinned env)

    names = []
    for d in gpus:
        try:
            names.append({"device": d, "name": torch.cuda.get_device_name(torch.device(d))})
        except Exception as e:  # noqa: BLE001 - a report field, not a reason to fail the bench
            names.append({"device": d, "name": None, "error": f"{type(e).__name__}: {e}"})
    driver, source = (env_manifest.get("nvidia") or {}).get("driver"), "env manifest"
    if not driver:
        driver, source = nvidia_probe()[0], "driver probe (/proc, nvidia-smi)"
    return {"accelerator": "cuda", "gpu_count": len(gpus), "gpus": names,
            "models": sorted({n["name"] for n in names if n["name"]}),
            "driver": driver, "driver_source": source if driver else None,
            "visible_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
