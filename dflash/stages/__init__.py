"""The stages Snakemake runs, one module each with one shape: ``run(ctx) -> manifest``.

``dflash <stage> specs/<name>.yaml`` → :func:`begin` (load the spec, check devices and the pinned
environment) → ``dflash.stages.<stage>.run(ctx)``. The env stage is the one that makes the
environment, so it starts without the environment check.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..env.drift import check_env
from ..artifacts.manifest import atomic_write_text, read_manifest
from ..spec.load import load_spec
from ..spec.sharers import sharers
from ..spec.types import Spec


@dataclass
class StageContext:
    spec: Spec
    results: Path           # results/<spec>
    env_manifest: dict = field(default_factory=dict)  # the verified env manifest
    env_fingerprint: str | None = None
    drift: list = field(default_factory=list)  # what differs, when the user overrode the refusal
    # a store entry's stage: the other specs that share it (dflash.spec.sharers); None: not one
    shared_with: list[str] | None = None


def results_dir(spec: Spec, root: str | Path = "results") -> Path:
    return Path(root) / spec.name


def begin(spec_path: str | Path, stage: str, root: str | Path = "results",
          at: str | Path | None = None, env_at: str | Path | None = None) -> StageContext:
    """Validate the spec (devices included) and refuse to run on a drifted environment.

    ``at``: the results folder the stage writes its ``<stage>/`` into (default
    ``root/<spec>``); ``env_at``: the one whose ``env/`` it checks (default ``at``). Snakemake
    points both into the shared store for env, warm-up and data (:mod:`dflash.artifacts.sharing`)."""
    if stage == "env":  # it checks the devices itself, without torch (build mode has none)
        spec = load_spec(spec_path)
        rdir = Path(at) if at else results_dir(spec, root)
        shared = sharers(spec, stage, rdir, results=root)
        if shared is not None:
            print(f"[env] spec {spec.path}{shared_note(shared)}", flush=True)
        return StageContext(spec=spec, results=rdir, shared_with=shared)
    spec = load_spec(spec_path, check_devices_present=True)
    rdir = Path(at) if at else results_dir(spec, root)
    env_root = Path(env_at) if env_at else rdir
    checked = check_env(env_root)
    drift = checked["drift"] if checked["drift_allowed"] else []
    env = read_manifest(env_root / "env" / "manifest.json", "env")
    shared = sharers(spec, stage, rdir, results=root)
    print(f"[{stage}] spec {spec.path}{shared_note(shared)} · env {checked['env_fingerprint']} "
          "verified" + (f" · DRIFT OVERRIDDEN: {len(drift)} items" if drift else ""), flush=True)
    return StageContext(spec=spec, results=rdir, env_manifest=env,
                        env_fingerprint=checked["env_fingerprint"], drift=drift,
                        shared_with=shared)


NOTE_NAMES = 6  # a store env entry may serve dozens of specs: the log names a few, the manifest all


def shared_note(shared: list[str] | None) -> str:
    """What the log line adds for a store entry: who else reads it (the spec named reads it too)."""
    if shared is None:
        return ""
    if len(shared) > NOTE_NAMES:
        return (f" · shared with {', '.join(shared[:NOTE_NAMES])} and {len(shared) - NOTE_NAMES} "
                f"more (the manifest's shared_with lists all {len(shared)})")
    return " · shared with " + (", ".join(shared) if shared else "no other spec")


def failure_line(e: BaseException, traceback_file: Path | None) -> str:
    """A failure as a stage reports it in one line, the exception being handled: its type and
    first line, its traceback written to ``traceback_file`` (when given) and named there."""
    line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if traceback_file is None:
        return line
    traceback_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(traceback_file, traceback.format_exc())
    return f"{line} (traceback in {traceback_file})"
