"""What code a stage runs, computed: its module's import closure inside ``dflash/`` plus the
package data those modules read. Snakemake makes its content hash a rule param, so an edit
reruns exactly the stages that run the edited file.

Computed, not listed by hand: a hand-kept list drifts (it once named a module that did not exist,
missed the report template, and left warmup unaware of the scheduler's dynamo settings).

* Imports are read from the source (``ast``), at any depth: the stages import heavy modules
  inside functions, and those count like top-level ones. Only ``dflash.*`` modules are followed;
  dynamic imports (``importlib.import_module(name)``) are not, which is what keeps the CLI's
  dispatch table from pulling every stage into every other.
* A few imports are declared not to be rerun triggers (:data:`NOT_RERUN_TRIGGERS`): the stage
  runs the module, but nothing it computes lands in the stage's output, so an edit there must
  not rerun the stage. The import stays plain (readers and tests/test_layering.py see it); the
  closure does not follow it for that stage.
* Package data (any non-Python file under ``dflash/``) belongs to a module that names the file or
  one of its folders in a string literal: ``Path(__file__).with_name("templates")`` reads every
  template, ``"spec.schema.yaml"`` the schema. Naming a folder over-approximates, never misses.
* A module's content is its syntax tree without docstrings (:func:`code_digest`), so an edit of
  comments, docstrings or layout reruns nothing; package data is hashed byte for byte.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from .manifest import fingerprint, sha256_bytes, sha256_file

PACKAGE = "dflash"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # dflash/ (this file is dflash/artifacts/)
ENTRY_MODULES = ("dflash.__main__", "dflash.cli")  # `python -m dflash <stage>` runs these too
# stage -> {module: why an edit of it does not change that stage's output}; the closure of the
# stage does not follow imports of these modules (nor what only they import)
_SHARERS = {"dflash.spec.sharers": "it names the other specs that share a store entry (the "
                                    "log, the manifest's shared_with), true when the entry was "
                                    "made; adding a spec does not rerun the entry, nor does this"}
NOT_RERUN_TRIGGERS: dict[str, dict[str, str]] = {
    "data": {"dflash.train.budget": "the disk budget check (model shapes, FLOPs) refuses a run "
                                    "before generation; it does not change the dataset",
             **_SHARERS},
    **{stage: dict(_SHARERS) for stage in ("env", "warmup", "decoders", "train", "bench")},
}


def module_file(name: str, root: Path = PACKAGE_DIR) -> Path | None:
    """``dflash.a.b`` -> ``root/a/b.py`` or ``root/a/b/__init__.py`` (None: not a module here)."""
    parts = name.split(".")[1:]
    base = root.joinpath(*parts)
    for cand in (base.with_suffix(".py") if parts else None, base / "__init__.py"):
        if cand is not None and cand.is_file():
            return cand
    return None


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


# (level, module, imported names) of each import statement; `import a.b` is (0, None, ("a.b",))
_ImportStmt = tuple[int, str | None, tuple[str, ...]]


@functools.lru_cache(maxsize=None)
def _facts(source: str, filename: str) -> tuple[tuple[_ImportStmt, ...], frozenset[str], str]:
    """A module's import statements, string literals and code digest from one parse. Keyed by
    the source text, so an edited file is parsed again; cached because one Snakefile parse
    fingerprints every stage, whose closures share most modules (parsing each module once per
    use made a `snakemake -n` take seconds, in every DAG test and every user's dry run)."""
    tree = ast.parse(source, filename=filename)
    imports: list[_ImportStmt] = []
    literals: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.append((0, None, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            literals.add(node.value)
    # last: it strips the docstrings from the tree in place (literals above still hold them)
    digest = sha256_bytes(ast.dump(_without_docstrings(tree)).encode())
    return tuple(imports), frozenset(literals), digest


def _facts_of(path: Path) -> tuple[tuple[_ImportStmt, ...], frozenset[str], str]:
    return _facts(path.read_text(encoding="utf-8"), str(path))


def imported_modules(name: str, root: Path = PACKAGE_DIR) -> set[str]:
    """The ``dflash.*`` modules that module ``name`` imports anywhere in its source."""
    path = module_file(name, root)
    if path is None:
        return set()
    pkg = _package_of(name, path)
    out: set[str] = set()
    for level, module, names in _facts_of(path)[0]:
        if module is None and not level:  # `import a.b`
            out.update(names)
            continue
        if level:
            base = pkg.split(".")
            base = base[:len(base) - level + 1]
            mod = ".".join(base + ([module] if module else []))
        else:
            mod = module or ""
        out.add(mod)
        # `from . import checkpoint` imports a module, `from .x import f` a name
        out.update(f"{mod}.{a}" for a in names)
    return {m for m in out if (m == PACKAGE or m.startswith(PACKAGE + "."))
            and module_file(m, root) is not None}


def _with_parents(name: str) -> list[str]:
    """Importing ``dflash.a.b`` runs ``dflash/__init__``, ``dflash/a/__init__`` and ``a/b``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_closure(roots: tuple[str, ...], root: Path = PACKAGE_DIR,
                   skip: frozenset[str] = frozenset()) -> set[str]:
    """Every module importing ``roots`` runs, not following imports of the modules in ``skip``."""
    seen: set[str] = set()
    todo = [p for r in roots for p in _with_parents(r)]
    while todo:
        m = todo.pop()
        if m in seen or module_file(m, root) is None:
            continue
        seen.add(m)
        for dep in imported_modules(m, root) - skip:
            todo.extend(_with_parents(dep))
    return seen


def _string_literals(path: Path) -> frozenset[str]:
    return _facts_of(path)[1]


def package_data(root: Path = PACKAGE_DIR) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
                  and "__pycache__" not in p.parts)


def data_read_by(modules: set[str], root: Path = PACKAGE_DIR) -> set[Path]:
    names: set[str] = set()
    for m in modules:
        names |= _string_literals(module_file(m, root))
    return {p for p in package_data(root)
            if names & ({p.name} | set(p.relative_to(root).parent.parts))}


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest(path: Path) -> str:
    """sha256 of what a file runs: a module's normalised syntax tree (comments, docstrings and
    formatting do not count), any other file's bytes."""
    if path.suffix != ".py":
        return sha256_file(path)
    return _facts_of(path)[2]


# rules whose command is a tool, not a stage: the module the rule's `dflash` command runs
TOOL_MODULES = {"sweep": "eval.sweep_report"}  # rules/sweeps.smk: dflash sweep-report


def stage_files(stage: str, root: Path = PACKAGE_DIR) -> tuple[Path, ...]:
    """Every file under ``root`` that the ``dflash <stage>`` command runs or reads."""
    module = TOOL_MODULES.get(stage, f"stages.{stage}")
    mods = import_closure((f"{PACKAGE}.{module}",) + ENTRY_MODULES, root,
                          frozenset(NOT_RERUN_TRIGGERS.get(stage, {})))
    files = {module_file(m, root) for m in mods} | data_read_by(mods, root)
    return tuple(sorted(files))


def stage_code_fingerprint(stage: str, root: str | Path = PACKAGE_DIR) -> str:
    """Content hash (:func:`code_digest`) of :func:`stage_files` (paths relative to the
    package, so a copy of the
    workflow elsewhere gets the same value)."""
    root = Path(root).resolve()
    return fingerprint({str(p.relative_to(root)): code_digest(p)
                        for p in stage_files(stage, root)})
