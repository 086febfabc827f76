"""Spec inheritance: a spec file may name a ``base`` spec and override some of its fields.

    # specs/smollm2-gamma4.yaml
    base: smollm2-quality        # specs/smollm2-quality.yaml (same folder), or a relative path
    name: smollm2-gamma4         # still the file stem
    loss: {gamma: 4}             # deep-merged into the base: mappings merge, anything else replaces

This module owns reading a spec file with its chain of bases into ONE raw mapping (what
:func:`dflash.spec.load.parse_spec` then validates as a whole: schema, defaults, cross-field rules)
and the provenance of every field (which file set it), so an error about a field names the file
that set it: the child or a base. A ``null`` in a child is an explicit value (e.g.
``optim.epochs: null`` with ``max_steps`` to switch a budget), and a null whose schema default
is null means "absent" as in any spec (``data.sources: null`` to give ``data.source`` instead).
Sweep arms (:mod:`dflash.spec.sweeps`) use the same merge.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from ..errors import SpecError

MAX_DEPTH = 16  # a chain of bases deeper than this is a mistake (or a cycle we report as one)
Provenance = dict[tuple, str]  # field path -> the file whose text set it


def read_yaml(path: Path, what: str = "spec") -> Any:
    """A YAML file's content; a missing, non-UTF-8 or malformed file is one SpecError."""
    file = str(path)
    if not path.is_file():
        raise SpecError(f"{file}: {what} file not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{file}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{file}: not a UTF-8 text file ({e.reason})") from None


def deep_merge(base: Any, override: Any) -> Any:
    """``override`` on top of ``base``: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = deep_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(override)


def provenance(data: Any, file: str, prefix: tuple = ()) -> Provenance:
    """Every field path of ``data`` (mappings and their leaves), attributed to ``file``."""
    out: Provenance = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out[prefix + (k,)] = file
            out.update(provenance(v, file, prefix + (k,)))
    return out


def base_path(child: Path, base: Any) -> Path:
    """Where ``base:`` points: a spec name in the child's folder, or a path relative to it."""
    if not isinstance(base, str) or not base.strip():
        raise SpecError(f"{child}: field 'base': must be a spec name (e.g. smollm2-quality) or a "
                        f"path to a .yaml file, got {base!r}")
    if base.endswith((".yaml", ".yml")):
        return child.parent / base
    return child.parent / f"{base}.yaml"


def resolve(path: Path, _chain: tuple[Path, ...] = ()) -> tuple[Any, Provenance, list[str]]:
    """The spec file with its bases merged in: (raw mapping, provenance, [base files, nearest
    first]). A file without ``base`` comes back as it is (not a mapping: parse_spec says so)."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict) or "base" not in data:
        return data, provenance(data, str(path)), []
    if len(_chain) >= MAX_DEPTH:
        raise SpecError(f"{path}: field 'base': more than {MAX_DEPTH} bases deep")
    parent = base_path(path, data["base"])
    seen = [p.resolve() for p in _chain + (path,)]
    if parent.resolve() in seen:
        loop = " -> ".join(str(p) for p in _chain + (path, parent))
        raise SpecError(f"{path}: field 'base': the bases form a cycle ({loop})")
    if not parent.is_file():
        raise SpecError(f"{path}: field 'base': base spec {data['base']!r} not found "
                        f"(looked for {parent})")
    try:
        base_data, base_prov, bases = resolve(parent, _chain + (path,))
    except SpecError as e:
        raise SpecError(f"{e} (the base of {path})") from None
    if not isinstance(base_data, dict):
        raise SpecError(f"{parent}: the base of {path} must be a YAML mapping of fields")
    child = {k: v for k, v in data.items() if k != "base"}
    return (deep_merge(base_data, child), {**base_prov, **provenance(child, str(path))},
            [str(parent)] + bases)


_FIELD = re.compile(r"field '([^']+)'")


def _path_of(field: str) -> tuple:
    """'topology.targets[0]' -> ('topology', 'targets', 0) (the messages' spelling)."""
    out: list = []
    for part in field.split("."):
        name, *idx = re.split(r"\[(\d+)\]", part)
        out += ([name] if name else []) + [int(i) for i in idx if i]
    return tuple(out)


def attribute(err: SpecError, file: str, prov: Provenance, bases: list[str]) -> SpecError:
    """``err`` (about the merged spec, worded for ``file``) with the file that set its field:
    ``specs/base.yaml (base of specs/child.yaml): field 'x.y': ...``. A field no file set (a
    missing required one, a default) is the child's, with its bases named."""
    msg = str(err)
    if not bases or not msg.startswith(f"{file}: "):
        return err
    m = _FIELD.search(msg)
    path = _path_of(m.group(1)) if m else ()
    owner = next((prov[path[:i]] for i in range(len(path), 0, -1) if path[:i] in prov), None)
    rest = msg[len(file) + 2:]
    if owner is None:
        return SpecError(f"{file} (with base {', '.join(bases)}): {rest}")
    if owner == file:
        return SpecError(f"{file}: {rest}")
    return SpecError(f"{owner} (base of {file}): {rest}")
