"""The one mechanism for artifacts: atomic writes, content fingerprints, versioned manifests.

Every stage writes ``results/<spec>/<stage>/manifest.json`` through :func:`write_manifest` and
reads its inputs through :func:`read_manifest` + :func:`expect` (+ :func:`verify_files` for the
files a manifest lists with their sha256), so a missing, tampered or stale artifact is refused with
one message naming the file, the field, the expected and the found value, and the exact command
that recovers (:func:`rerun_command`). A damaged manifest, or one whose files no longer match, is
set aside (``manifest.json`` -> ``manifest.json.damaged``): the producer's declared output is then
missing, so the same Snakemake command reruns the producer.

Files are written with the mode a plain ``open()`` would give (0666 minus the umask): results on a
shared filesystem stay readable by the team, as the umask says.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import StaleArtifact

MANIFEST_VERSION = 1


# ---------------------------------------------------------------------------------------------
# atomic writes: temp file in the same directory, fsync, rename, fsync the directory
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``.

    Use for writers that want a filename (safetensors, pyarrow, matplotlib). On failure the
    temporary file is removed and ``path`` is untouched, so a reader never sees a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes 0600 whatever the umask (and a writer may replace the file)
        plain_mode(tmp_path)
        with open(tmp_path, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask (Linux exposes it read-only; elsewhere set and restore it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def plain_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open()`` would (0666 minus the umask): mkstemp and
    safetensors' writer make 0600 whatever the umask."""
    os.chmod(path, 0o666 & ~current_umask())


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing), released on exit or when
    the process dies: one builder of a shared artifact (a venv, a converted target), others wait
    and reuse what it built."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# fingerprints
# ---------------------------------------------------------------------------------------------
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(obj: Any) -> str:
    """Stable short fingerprint of a JSON-able object (key order does not matter)."""
    return sha256_bytes(canonical_json(obj).encode())[:16]


# ---------------------------------------------------------------------------------------------
# manifests
# ---------------------------------------------------------------------------------------------
def write_manifest(path: str | os.PathLike, stage: str, fingerprints: dict[str, str],
                   **fields: Any) -> dict:
    """Write a versioned manifest with a self-checksum (so hand edits are detected as tampering)."""
    body = {
        "manifest_version": MANIFEST_VERSION,
        "stage": stage,
        "created_unix": round(time.time(), 3),
        "fingerprints": dict(fingerprints),
        **fields,
    }
    atomic_write_json(path, seal(body))
    with contextlib.suppress(FileNotFoundError):  # made again: an earlier set-aside is past
        os.unlink(set_aside_note(path))
    return body


def seal(body: dict) -> dict:
    """``body`` with a ``checksum`` over the rest (:func:`is_sealed` checks it): a hand edit or a
    flipped byte of a JSON record is then detected."""
    body.pop("checksum", None)
    body["checksum"] = sha256_bytes(canonical_json(body).encode())
    return body


def is_sealed(body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return body.get("checksum") == sha256_bytes(canonical_json(rest).encode())


def rerun_command(stage: str, path: str | os.PathLike) -> str:
    """The one command that reruns ``stage`` (and what follows it) for the spec whose results
    hold ``path`` (``<results>/<spec>/<stage>/...``)."""
    parts = Path(path).parts
    at = len(parts) - 1 - parts[::-1].index(stage) if stage in parts else 0
    spec = parts[at - 1] if at > 0 else "<spec>"
    return f"snakemake --cores all --forcerun {stage} bench_{spec}"


def set_aside_note(manifest_path: str | os.PathLike) -> Path:
    """Where :func:`set_aside` records why it moved a manifest: the stage run by hand later finds
    the manifest missing and says what was damaged (read_manifest), not only that it is gone."""
    path = Path(manifest_path)
    return path.with_name(path.name + ".set-aside.json")


def set_aside(manifest_path: str | os.PathLike, stage: str, spec: str | None = None,
              why: str | None = None) -> str:
    """Move a damaged manifest out of the way (kept as ``*.damaged``) so that Snakemake sees the
    producer's output missing and reruns it; returns what to tell the user. ``spec``: whose
    target reruns it (default: the spec folder the manifest is in; a copy shared by content,
    ``results/.shared/...``, has none of its own). ``why`` (the damaged file, in one line) and the
    command are recorded beside it (:func:`set_aside_note`) until the stage writes it again."""
    path = Path(manifest_path)
    with contextlib.suppress(OSError):
        os.replace(path, path.with_name(path.name + ".damaged"))
    spec = spec or path.parent.parent.name
    command = f"snakemake --cores all bench_{spec}"
    with contextlib.suppress(OSError):
        atomic_write_json(set_aside_note(path), {"why": why or f"{path}: damaged",
                                                 "command": command})
    return (f"set {path.name} aside as {path.name}.damaged, so Snakemake reruns the {stage} "
            f"stage: `{command}`")


def check_output(path: str | os.PathLike, stage: str, spec: str | None = None) -> str | None:
    """The producer's side of :func:`verify_files`, for Snakemake before it decides what to run
    (rules/common.smk): a present manifest that is tampered with, or whose files no longer
    match, is set aside, so its rule's output is missing and Snakemake reruns it. Returns the
    line saying so (None: missing or intact)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        body = None
    if not is_sealed(body):
        why = f"{path}: damaged (checksum mismatch)"
        return f"{why}; {set_aside(path, stage, spec, why)}"
    try:
        verify_files(body, path, stage, spec)
    except StaleArtifact as e:
        return str(e)
    return None


def verify_files(manifest: dict, path: str | os.PathLike, stage: str,
                 spec: str | None = None) -> None:
    """Check every file the manifest lists (``files``: path relative to the manifest's folder ->
    sha256); a missing or changed one is refused in one line and the manifest set aside."""
    path = Path(path)
    for rel, want in manifest.get("files", {}).items():
        f = path.parent / rel
        found = sha256_file(f) if f.is_file() else None
        if found != want:
            what = "missing" if found is None else f"damaged (sha256 {found[:12]}…, its " \
                                                   f"manifest says {want[:12]}…)"
            raise StaleArtifact(f"{f}: {what}; {set_aside(path, stage, spec, f'{f}: {what}')}")


def read_manifest(path: str | os.PathLike, stage: str) -> dict:
    """Read and integrity-check a manifest; refuse a missing, unreadable, tampered or wrong one
    (a damaged one is set aside, so Snakemake reruns its stage)."""
    path = Path(path)
    if not path.is_file():
        raise StaleArtifact(_missing(path, stage))
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = f"{path}: unreadable {stage} manifest ({e})"
        raise StaleArtifact(f"{why}; {set_aside(path, stage, why=why)}") from None
    if not isinstance(body, dict):
        why = f"{path}: {stage} manifest is not a JSON object"
        raise StaleArtifact(f"{why}; {set_aside(path, stage, why=why)}")
    if not is_sealed(body):
        why = f"{path}: {stage} manifest was modified after it was written (checksum mismatch)"
        raise StaleArtifact(f"{why}; {set_aside(path, stage, why=why)}")
    _expect_value(path, "manifest_version", MANIFEST_VERSION, body.get("manifest_version"))
    _expect_value(path, "stage", stage, body.get("stage"))
    return body


def _missing(path: Path, stage: str) -> str:
    """A missing manifest: what an earlier check set aside, and why (the damaged file), when it
    did (a `snakemake -n` checks outputs before it plans), else that the stage has not run."""
    try:
        note = json.loads(set_aside_note(path).read_text())
        why, command = str(note["why"]), str(note["command"])
    except (OSError, ValueError, TypeError, KeyError):
        return (f"{path}: missing {stage} manifest — run the {stage} stage first: "
                f"`snakemake --cores all bench_{path.parent.parent.name}`.")
    return (f"{why}: the {stage} manifest was set aside (as {path.name}.damaged) by an earlier "
            f"check; recover with `{command}` (it reruns the {stage} stage)")


def expect(manifest: dict, path: str | os.PathLike, fingerprints: dict[str, str]) -> None:
    """Refuse a manifest whose recorded fingerprints differ from the live ones, naming each one."""
    found = manifest.get("fingerprints", {})
    for key, want in fingerprints.items():
        _expect_value(path, f"fingerprints.{key}", want, found.get(key))


def _expect_value(path, field: str, expected: Any, found: Any) -> None:
    if expected != found:
        stage = Path(path).parent.name
        raise StaleArtifact(f"{path}: stale artifact — field '{field}' expected {expected!r}, "
                            f"found {found!r}. Its inputs changed; rerun the {stage} stage: "
                            f"`{rerun_command(stage, path)}`")
