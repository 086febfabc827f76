"""Which specs share a store entry: what a shared env, warm-up or data stage names beside the spec
it read (its log line and its manifest's ``shared_with``).

Computed when the stage runs, from the workflow's ``specs/`` and ``sweeps/`` and the same key
helper that names the entry in the DAG (:func:`dflash.artifacts.sharing.spec_keys`), never a
Snakemake param: one would rerun the shared entry whenever a spec is added. So the list is true
at the time the entry was made; a spec added later reads the same entry without its name there.
Nothing is written: a sweep's arms are expanded in memory (their files stay unwritten until a job
of the arm is planned, rules/common.smk ``spec_file``).

A spec the DAG refuses for its data files (``check_data`` at parse: a missing prompts file) is
still named when its fields give the key: it would read this entry once its file exists.
"""
from __future__ import annotations

from pathlib import Path

from ..artifacts.code_fingerprint import stage_code_fingerprint
from ..artifacts.sharing import SHARED_STAGES, entry_key, lock_digest, spec_keys
from ..errors import DFlashError
from .load import load_spec
from .sweeps import load_sweeps
from .types import Spec


def workflow_specs(repo: str | Path, results: str | Path = "results") -> dict[str, Spec]:
    """{name: spec} of every spec the DAG plans: ``repo/specs/*.yaml`` and each arm of
    ``repo/sweeps/*.yaml``; a file that does not load is left out (the DAG refuses it too)."""
    specs: dict[str, Spec] = {}
    for path in sorted(Path(repo, "specs").glob("*.yaml")):
        try:
            specs[path.stem] = load_spec(path)
        except DFlashError:
            continue
    try:
        sweeps, _ = load_sweeps(Path(repo, "sweeps"), results, specs)
    except DFlashError:  # the DAG refuses to parse then: no arm of any sweep runs
        return specs
    specs.update({a.name: a.spec for sw in sweeps.values() for a in sw.arms})
    return specs


def sharers(spec: Spec, stage: str, at: str | Path, repo: str | Path = ".",
            results: str | Path = "results") -> list[str] | None:
    """The other specs whose fields give the store entry ``at`` of ``stage`` (sorted; [] when
    none), or None where ``at`` is no store entry (a stage run by hand into results/<spec>/) or
    where ``spec``'s own key here is not the entry's (another checkout's code or lock made it:
    then nothing here can say who shares it)."""
    key = entry_key(at, stage)
    if key is None or stage not in SHARED_STAGES:
        return None
    code = {st: stage_code_fingerprint(st) for st in SHARED_STAGES}
    locks: dict[str, str] = {}  # lock path -> digest: the specs share a few locks, hashed once

    def key_of(s: Spec) -> str:
        lock = locks.get(s.env.lock) or locks.setdefault(s.env.lock, lock_digest(s, repo))
        return spec_keys(s, code, lock)[stage]

    if key_of(spec) != key:
        return None
    return sorted(name for name, s in workflow_specs(repo, results).items()
                  if name != spec.name and key_of(s) == key)
