"""A generated block inside a markdown file: the text between ``<!-- ours:KEY:begin -->`` and
``<!-- ours:KEY:end -->``, rendered by a bench script from committed JSON, written with
``--write`` and checked with ``--check`` (bench/speedup_table.py, bench/ablation_table.py,
bench/frontier.py); and :func:`main_of`, the ``main`` of the scripts that also write a JSON and
a plot.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from dflash.artifacts.manifest import atomic_write_text
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


def main_of(description: str, *, collect: Callable[[], dict], render: Callable[[dict], str],
            plot: Callable[[dict, Path], None], dumps: Callable[[dict], str], json_path: Path,
            png_path: Path, begin: str, end: str) -> Callable[[list[str] | None], int]:
    """The ``main(argv)`` of a script whose JSON, plot and markdown block come from committed
    results: no flag prints the block; ``--write MD...`` writes the JSON, the plot and each
    file's block; ``--check MD...`` exits 1 naming what is stale (the JSON or a file's block)."""
    def main(argv=None) -> int:
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("--json", type=Path, default=json_path)
        ap.add_argument("--png", type=Path, default=png_path)
        g = ap.add_mutually_exclusive_group()
        g.add_argument("--write", nargs="+", type=Path, metavar="MD")
        g.add_argument("--check", nargs="+", type=Path, metavar="MD")
        a = ap.parse_args(argv)
        data = collect()
        block = render(data)
        if not (a.write or a.check):
            print(block)
            return 0
        stale = []
        if a.write:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(a.json, dumps(data))
            plot(data, a.png)
        elif not a.json.is_file() or a.json.read_text() != dumps(data):
            stale.append(str(a.json))
        return write_or_check(a.write or a.check, block, begin=begin, end=end,
                              write=bool(a.write), stale=stale)
    return main
