"""What every stage does first: load the spec, check devices and the pinned environment.

Stages are thin: ``dflash <stage> specs/<name>.yaml`` → :func:`begin` → the stage's ``run``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .spec import Spec, load_spec


@dataclass
class StageContext:
    spec: Spec
    results: Path           # results/<spec>
    env_manifest: dict      # the verified env manifest
    env_fingerprint: str
    drift: list             # packages that differ, when the user overrode the refusal


def results_dir(spec: Spec, root: str | Path = "results") -> Path:
    return Path(root) / spec.name


def begin(spec_path: str | Path, stage: str, root: str | Path = "results") -> StageContext:
    """Validate the spec (devices included) and refuse to run on a drifted environment."""
    from .envstage import check_env
    from .manifest import read_manifest

    spec = load_spec(spec_path, check_devices_present=True)
    rdir = results_dir(spec, root)
    checked = check_env(rdir)
    drift = checked["drift"] if checked["drift_allowed"] else []
    env = read_manifest(rdir / "env" / "manifest.json", "env")
    print(f"[{stage}] spec {spec.path} · env {checked['env_fingerprint']} verified"
          + (f" · DRIFT OVERRIDDEN: {len(drift)} items" if drift else ""), flush=True)
    return StageContext(spec=spec, results=rdir, env_manifest=env,
                        env_fingerprint=checked["env_fingerprint"], drift=drift)

