"""Sweep files: ``sweeps/<name>.yaml`` = a base spec and the arms that vary it, as specs.

    base: tiny                       # specs/tiny.yaml
    overrides: {optim: {epochs: 1}}  # every arm (optional)
    arms:                            # arm name -> overrides (a nested mapping, like a spec)
      lr3e-4: {optim: {lr: 3.0e-4}}
      lr1e-3: {optim: {lr: 1.0e-3}}
    grid:                            # or/and: field path -> {label: value}; arms = the product
      loss.gamma: {g4: 4, g7: 7}
    seed: 0                          # every arm's seed unless it sets one (default: the base's)
    repeats: 1                       # > 1: <arm>-r0, <arm>-r1, ... with seeds seed, seed+1, ...

This module owns expanding a sweep into its arms (each a full, validated :class:`Spec` named
``<sweep>-<arm>``) and materialising them as merged spec files the stages read
(``results/<sweep>.sweep/specs/<sweep>-<arm>.yaml``: a dot cannot occur in a spec name, so the
folder never collides with one), each when a job of that arm is planned, not at every DAG
parse. rules/common.smk loads every sweep file and adds its arms to the specs the DAG knows;
rules/sweeps.smk adds the ``bench_<sweep>`` target and the sweep report.
"""
from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

from ..artifacts.manifest import atomic_write_text
from ..errors import SpecError
from .inherit import Provenance, attribute, deep_merge, provenance, read_yaml, resolve
from .load import absent_nulls, fmt_path, parse_spec, schema
from .types import Spec

SCHEMA_PATH = Path(__file__).with_name("schema") / "sweep.schema.yaml"
NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")  # a spec name (spec.schema.yaml: name)


@lru_cache(maxsize=1)
def sweep_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


@dataclass(frozen=True)
class Arm:
    """One arm: ``name`` is its spec name (``<sweep>-<arm>``), ``overrides`` what it changes
    from the base (sweep-wide overrides excluded), ``data`` the merged spec mapping."""
    arm: str
    name: str
    seed: int
    overrides: dict
    data: dict = field(repr=False)
    spec: Spec = field(repr=False)


@dataclass(frozen=True)
class Sweep:
    name: str
    path: Path
    base: Path
    description: str
    arms: tuple[Arm, ...]

    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]


def sweep_dir(results: str | Path, sweep: str) -> Path:
    """Where a sweep's own files go: its materialised arm specs and its report."""
    return Path(results) / f"{sweep}.sweep"


def _nested(path: str, value) -> dict:
    out = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _arm_overrides(doc: dict) -> list[tuple[str, dict]]:
    """(arm name, overrides) from ``arms`` then the ``grid`` product, in file order."""
    arms = [(k, v) for k, v in (doc.get("arms") or {}).items()]
    grid = doc.get("grid") or {}
    for combo in ([] if not grid else
                  itertools.product(*[list(v.items()) for v in grid.values()])):
        over: dict = {}
        for path, (_, value) in zip(grid, combo):
            over = deep_merge(over, _nested(path, value))
        arms.append(("-".join(label for label, _ in combo), over))
    return arms


def _check_doc(file: str, doc) -> dict:
    if not isinstance(doc, dict):
        raise SpecError(f"{file}: a sweep file must be a YAML mapping (base, arms or grid, ...)")
    errors = sorted(jsonschema.Draft202012Validator(sweep_schema()).iter_errors(doc),
                    key=lambda e: len(e.absolute_path))
    if errors:
        e = errors[0]
        where = fmt_path(e.absolute_path)
        if e.validator == "anyOf":
            raise SpecError(f"{file}: give 'arms' or 'grid' (or both): the sweep has no arms")
        raise SpecError(f"{file}: field '{where}': {e.message}")
    return doc


def base_spec_path(sweep_file: Path, base: str) -> Path:
    """``base: tiny`` -> specs/tiny.yaml beside the sweeps/ folder; a .yaml path is relative to
    the sweep file."""
    if base.endswith((".yaml", ".yml")):
        return sweep_file.parent / base
    return sweep_file.parent.parent / "specs" / f"{base}.yaml"


def _expand_arm(file: str, sweep: str, arm: str, over: dict, ctx: dict) -> list[Arm]:
    """One arm (or its repeats), merged and validated; errors name the arm and who set the field."""
    label = f"{file} arm '{arm}'"
    if "name" in over:
        raise SpecError(f"{label}: field 'name': an arm's spec name is <sweep>-<arm> "
                        f"({sweep}-{arm}); do not set it")
    seed = over.get("seed", ctx["seed"])
    repeats = ctx["repeats"]
    out = []
    for r in range(repeats):
        name = f"{sweep}-{arm}" + (f"-r{r}" if repeats > 1 else "")
        if not NAME_RE.match(name):
            raise SpecError(f"{label}: the spec name {name!r} must match {NAME_RE.pattern} "
                            f"(at most 64 characters): use a shorter sweep or arm name")
        s = seed + r if isinstance(seed, int) else seed
        data = deep_merge(deep_merge(ctx["base"], ctx["overrides"]), over)
        data.update(name=name, seed=s)
        prov: Provenance = {**ctx["prov"], **provenance(ctx["overrides"], f"{file} overrides"),
                            **provenance(over, label)}
        data = absent_nulls(data, schema())
        try:
            spec = parse_spec(data, label)
        except SpecError as e:
            raise attribute(e, label, prov, ctx["bases"]) from None
        out.append(Arm(arm=arm + (f"-r{r}" if repeats > 1 else ""), name=name, seed=spec.seed,
                       overrides=copy.deepcopy(over), data=data, spec=spec))
    return out


def load_sweep(path: str | Path) -> Sweep:
    """Read, expand and validate a sweep file: every arm a valid spec."""
    path = Path(path)
    file = str(path)
    doc = _check_doc(file, read_yaml(path, "sweep"))
    base = base_spec_path(path, doc["base"])
    if not base.is_file():
        raise SpecError(f"{file}: field 'base': base spec {doc['base']!r} not found "
                        f"(looked for {base})")
    try:
        base_data, prov, bases = resolve(base)
    except SpecError as e:
        raise SpecError(f"{e} (the base of {file})") from None
    if not isinstance(base_data, dict):
        raise SpecError(f"{base}: the base of {file} must be a YAML mapping of fields")
    base_data = {k: v for k, v in base_data.items() if k != "name"}
    ctx = {"base": base_data, "prov": prov, "bases": [str(base)] + bases,
           "overrides": doc.get("overrides") or {}, "repeats": doc.get("repeats", 1),
           "seed": doc.get("seed", base_data.get("seed", 0))}
    arms: list[Arm] = []
    for arm, over in _arm_overrides(doc):
        arms += _expand_arm(file, path.stem, arm, over, ctx)
    dup = sorted({a.name for a in arms if [b.name for b in arms].count(a.name) > 1})
    if dup:
        raise SpecError(f"{file}: arms {', '.join(dup)} are defined twice (arms and grid?)")
    return Sweep(name=path.stem, path=path, base=base, description=doc.get("description", ""),
                 arms=tuple(arms))


def arm_spec_text(sweep: Sweep, arm: Arm) -> str:
    head = (f"# GENERATED from {sweep.path} (arm '{arm.arm}', base {sweep.base}); do not edit:\n"
            f"# edit the sweep file, the DAG rewrites this file when it loads.\n")
    return head + yaml.safe_dump(arm.data, sort_keys=False)


def arm_file(results: str | Path, sweep: str, name: str) -> Path:
    """Where arm ``name``'s merged spec file goes (:func:`materialise` writes it)."""
    return sweep_dir(results, sweep) / "specs" / f"{name}.yaml"


def materialise(sweep: Sweep, results: str | Path, names=None) -> dict[str, Path]:
    """Write each arm's merged spec file (only when its text changed; atomically) and return
    {spec name: file}. The stages read these files like any spec. ``names``: those arms only
    (rules/common.smk writes an arm's file when a job of that arm is planned, so a DAG parse
    writes nothing under results/ for a sweep nobody asked for)."""
    out = {}
    for arm in sweep.arms:
        if names is not None and arm.name not in names:
            continue
        p = arm_file(results, sweep.name, arm.name)
        text = arm_spec_text(sweep, arm)
        if not p.is_file() or p.read_text(encoding="utf-8") != text:
            atomic_write_text(p, text)
        out[arm.name] = p
    return out


def load_sweeps(folder: str | Path, results: str | Path, specs: dict) -> tuple[dict, dict]:
    """Every ``folder/*.yaml`` sweep: ({sweep name: Sweep}, {arm spec name: its file}), written
    by nobody yet (:func:`materialise` writes one when it is needed). An arm named like a spec in
    ``specs`` (or another sweep's arm) is an error."""
    sweeps, files = {}, {}
    for p in sorted(Path(folder).glob("*.yaml")):
        sw = load_sweep(p)
        if sw.name in specs:
            raise SpecError(f"{p}: the sweep name {sw.name!r} is also a spec's name "
                            f"(bench_{sw.name} would mean both)")
        for arm in sw.arms:
            if arm.name in specs or arm.name in files:
                raise SpecError(f"{p}: arm {arm.arm!r} makes the spec name {arm.name!r}, "
                                f"which already exists")
        files.update({a.name: arm_file(results, sw.name, a.name) for a in sw.arms})
        sweeps[sw.name] = sw
    return sweeps, files
