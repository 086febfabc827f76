"""`dflash export-check DIR`: is an exported drafter folder intact and loadable? Each check is a
function of the folder that raises :class:`dflash.errors.DFlashError` naming the file; add checks
to CHECKS (e.g. what a serving engine's loader requires)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .drafter import verify_export

CHECKS = [verify_export]  # content: every file's sha256 against checksums.json, config parses


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dflash export-check",
                                 description="check an exported drafter folder")
    ap.add_argument("dir", help="e.g. results/<spec>/train/drafter")
    a = ap.parse_args(argv)
    for check in CHECKS:
        check(Path(a.dir))  # DFlashError -> one line from the CLI, exit 2
    print(f"ok: {a.dir} ({', '.join(c.__name__ for c in CHECKS)})")
    return 0
