"""The one mechanism for artifacts: atomic writes, content fingerprints, versioned manifests.

Every stage writes ``results/<spec>/<stage>/manifest.json`` through :func:`write_manifest` and
reads its inputs through :func:`read_manifest` + :func:`expect`, so a missing, tampered or stale
artifact is refused with one message naming the file, the field, the expected and the found value.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import StaleArtifact

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
        with open(tmp_path, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (created if missing), released on exit or when
    the process dies: one builder of a shared artifact (a venv, a converted target), others wait
    and reuse what it built."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _fsync_dir(d: Path) -> None:
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
    body["checksum"] = sha256_bytes(canonical_json(body).encode())
    atomic_write_json(path, body)
    return body


def read_manifest(path: str | os.PathLike, stage: str) -> dict:
    """Read and integrity-check a manifest; refuse a missing, unreadable, tampered or wrong one."""
    path = Path(path)
    if not path.is_file():
        raise StaleArtifact(f"{path}: missing {stage} manifest — run the {stage} stage first "
                            f"(e.g. `snakemake --cores all {stage}_<spec>`).")
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StaleArtifact(f"{path}: unreadable {stage} manifest ({e}); rerun the {stage} stage.")
    if not isinstance(body, dict):
        raise StaleArtifact(f"{path}: {stage} manifest is not a JSON object; rerun the {stage} stage.")
    found_sum = body.pop("checksum", None)
    if found_sum != sha256_bytes(canonical_json(body).encode()):
        raise StaleArtifact(f"{path}: {stage} manifest was modified after it was written "
                            f"(checksum mismatch); rerun the {stage} stage.")
    body["checksum"] = found_sum
    _expect_value(path, "manifest_version", MANIFEST_VERSION, body.get("manifest_version"))
    _expect_value(path, "stage", stage, body.get("stage"))
    return body


def expect(manifest: dict, path: str | os.PathLike, fingerprints: dict[str, str]) -> None:
    """Refuse a manifest whose recorded fingerprints differ from the live ones, naming each one."""
    found = manifest.get("fingerprints", {})
    for key, want in fingerprints.items():
        _expect_value(path, f"fingerprints.{key}", want, found.get(key))


def _expect_value(path, field: str, expected: Any, found: Any) -> None:
    if expected != found:
        raise StaleArtifact(f"{path}: stale artifact — field '{field}' expected {expected!r}, "
                            f"found {found!r}. Its inputs changed; rerun that stage "
                            f"(Snakemake does this for you: rerun the same target).")
