"""The house's size limits, checked: no function over 80 lines and no module over 450 in
``dflash/`` and ``bench/`` (the lines from ``def`` to the body's last, decorators not counted).

    python -m bench.code_sizes            # prints each one over; exit 1 if any
    python -m bench.code_sizes dflash     # one tree only
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

from bench.entry import run

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION, MAX_MODULE = 80, 450


def oversized(root: Path) -> list[str]:
    """``path:line name N lines`` for each function and module of ``root`` over its limit."""
    out = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        rel = p.relative_to(REPO) if p.is_relative_to(REPO) else p
        if (n := len(text.splitlines())) > MAX_MODULE:
            out.append(f"{rel}: module {n} lines > {MAX_MODULE}")
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    out.append(f"{rel}:{node.lineno} {node.name} {n} lines > {MAX_FUNCTION}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", default=["dflash", "bench"])
    found = [line for t in ap.parse_args().trees for line in oversized(REPO / t)]
    print("\n".join(found) or "every function <= 80 lines, every module <= 450")
    return 1 if found else 0


if __name__ == "__main__":
    run(main)
