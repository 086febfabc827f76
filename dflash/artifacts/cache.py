"""Where caches live: ``$DFLASH_CACHE`` (default ``.cache/dflash``) holds converted targets and
one compile cache per environment fingerprint."""
from __future__ import annotations

import os
from pathlib import Path

from .. import settings


def cache_root() -> Path:
    return Path(settings.cache_root()).resolve()


def compile_cache_dir(env_fingerprint: str) -> Path:
    """One inductor/triton cache per env fingerprint: a changed stack never reuses stale kernels.

    Set before the first compile; warmup and train use the same directory, so training starts
    with the kernels warmup built; the bench stage too, so its rerun (or another spec's bench
    with the same decoder shapes) loads its decoders' kernels.
    """
    d = cache_root() / "compile" / env_fingerprint
    d.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    return d
