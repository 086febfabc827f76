"""A generated block inside a markdown file: the text between ``<!-- ours:KEY:begin -->`` and
``<!-- ours:KEY:end -->``, rendered by a bench script from committed JSON, written with
``--write`` and checked with ``--check`` (bench/speedup_table.py, bench/ablation_table.py).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from dflash.errors import DFlashError


def splice(text: str, block: str, name: str, *, begin: str, end: str) -> str:
    """``text`` with the one block between the markers replaced by ``block``."""
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if len(pat.findall(text)) != 1:
        raise DFlashError(f"{name}: needs exactly one {begin} ... {end} block")
    return pat.sub(lambda _: f"{begin}\n{block}\n{end}", text)


def write_or_check(mds: list[Path], block: str, *, begin: str, end: str, write: bool,
                   stale: list[str] | None = None) -> int:
    """Each file's block replaced by ``block`` (``write``) or, checking, each file whose block
    differs added to ``stale``; -> 1 (after saying which) when anything is stale, else 0."""
    stale = list(stale or [])
    for md in mds:
        old = md.read_text()
        new = splice(old, block, str(md), begin=begin, end=end)
        if write and new != old:
            md.write_text(new)
        stale += [str(md)] if not write and new != old else []
    if stale:
        print(f"stale (rerun with --write): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0
