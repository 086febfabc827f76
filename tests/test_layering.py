"""The package's rooms import only the rooms below them (each sub-package's __init__ says which),
and no two modules import each other at import time: docs/design.md "Where things live"."""
import ast
import shutil
from pathlib import Path

import dflash

PKG = Path(dflash.__file__).parent
# room -> the rooms it may import (the top-level modules are the room "top")
MAY_IMPORT = {
    "top": {"top"},
    "artifacts": {"top", "artifacts"},
    "spec": {"top", "artifacts", "spec"},
    "runtime": {"top", "artifacts", "spec", "runtime"},
    "models": {"top", "artifacts", "spec", "models"},
    "decode": {"top", "artifacts", "spec", "runtime", "models", "decode"},
    "data": {"top", "artifacts", "spec", "runtime", "models", "decode", "data"},
    "train": {"top", "artifacts", "spec", "runtime", "models", "data", "train"},
    "eval": {"top", "artifacts", "spec", "runtime", "models", "data", "decode", "eval"},
    "env": {"top", "artifacts", "spec", "env"},
    "stages": {"top", "artifacts", "spec", "runtime", "models", "decode", "data", "train", "eval", "env",
               "stages"},
}
# above every room: commands
ENTRY_POINTS = {"dflash.cli", "dflash.__main__", "dflash.spec.validate", "dflash.generate"}


def _module(pkg: Path, path: Path) -> str:
    parts = [p for p in path.relative_to(pkg).with_suffix("").parts if p != "__init__"]
    return ".".join(["dflash", *parts])


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "top"


def _is_module(pkg: Path, mod: str) -> bool:
    p = pkg.parent.joinpath(*mod.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _import_froms(pkg: Path, path: Path, top_level_only: bool = False):
    """``(base, name, asname, is_module)`` of each ``from X import name`` in ``path`` whose
    (resolved) base is in dflash, and ``(name, None, asname, True)`` of each ``import dflash.x``:
    the one walk both checks below read imports with."""
    mod = _module(pkg, path)
    here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for n in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("dflash."):
                    yield a.name, None, a.asname, True
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = here.split(".")[:len(here.split(".")) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base != "dflash" and not base.startswith("dflash."):
                continue
            for a in n.names:
                yield base, a.name, a.asname, _is_module(pkg, f"{base}.{a.name}")


def _imports(pkg: Path, path: Path, top_level_only: bool) -> set[str]:
    """The dflash modules ``path`` imports (at any depth, or at its head only)."""
    out = {f"{base}.{name}" if name and is_mod else base
           for base, name, _, is_mod in _import_froms(pkg, path, top_level_only)}
    return {m for m in out if m.startswith("dflash.")}


def _files(pkg: Path):
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def upward_imports(pkg: Path) -> list[str]:
    bad = []
    for path in _files(pkg):
        mod = _module(pkg, path)
        if mod in ENTRY_POINTS:
            continue
        bad += [f"{mod} -> {d}" for d in sorted(_imports(pkg, path, False))
                if _room(d) not in MAY_IMPORT[_room(mod)]]
    return bad


def import_cycles(pkg: Path) -> list[list[str]]:
    graph = {_module(pkg, p): _imports(pkg, p, True) for p in _files(pkg)}
    done, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
        elif m not in done:
            stack.append(m)
            for d in sorted(graph.get(m, ())):
                visit(d)
            stack.pop()
            done.add(m)

    for m in sorted(graph):
        visit(m)
    return cycles


def private_imports(pkg: Path) -> list[str]:
    """``from dflash.x import _name`` or ``x._name`` on an imported dflash module, across files:
    a name another module needs is public (a leading underscore says "only this file")."""
    bad = []
    for path in _files(pkg):
        mod = _module(pkg, path)
        modules = set()  # local names bound to dflash modules
        for base, name, asname, is_mod in _import_froms(pkg, path):
            if name is None:  # `import dflash.x as y`
                modules |= {asname} if asname else set()
            elif is_mod:
                modules.add(asname or name)
            elif name.startswith("_") and not name.startswith("__"):
                bad.append(f"{mod} imports {base}.{name}")
        tree = ast.parse(path.read_text())
        bad += [f"{mod} uses {n.value.id}.{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in modules and n.attr.startswith("_")
                and not n.attr.startswith("__")]
    return bad


def test_no_module_imports_another_module_s_private_name():
    assert private_imports(PKG) == []


def test_a_private_import_is_seen(tmp_path):
    pkg = tmp_path / "dflash"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    ckpt = pkg / "train" / "checkpoint.py"
    ckpt.write_text(ckpt.read_text() + "\nfrom ..artifacts.manifest import _x\nfrom ..runtime import faults\n"
                    "faults._y\n")
    assert private_imports(pkg) == ["dflash.train.checkpoint imports dflash.artifacts.manifest._x",
                                    "dflash.train.checkpoint uses faults._y"]


def test_no_room_imports_a_room_above_it():
    assert upward_imports(PKG) == []


def test_no_import_time_cycles():
    assert import_cycles(PKG) == []


def test_an_upward_import_and_a_cycle_are_seen(tmp_path):
    pkg = tmp_path / "dflash"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    masks = pkg / "models" / "masks.py"
    masks.write_text(masks.read_text() + "\nfrom ..train.objective import Objective\n")
    assert "dflash.models.masks -> dflash.train.objective" in upward_imports(pkg)
    assert any("dflash.models.masks" in c for c in import_cycles(pkg))  # objective imports masks
    # artifacts/ stands below spec/ (the spec's types fingerprint through the manifest helper)
    manifest = pkg / "artifacts" / "manifest.py"
    manifest.write_text(manifest.read_text() + "\nfrom ..spec.load import load_spec\n")
    assert "dflash.artifacts.manifest -> dflash.spec.load" in upward_imports(pkg)
    assert any("dflash.artifacts.manifest" in c for c in import_cycles(pkg))
