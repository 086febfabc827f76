"""The README's figures, each checked against the committed file it cites.

A quoted figure carries its source right after it, as an HTML comment (invisible on GitHub)::

    **97.3K target tokens/s**<!-- fig: bench/results/h200/smollm2-quality-run2/steady_state.json#tokens_per_s -->

The path is relative to the repository root; after ``#`` comes the key path in the JSON, dots
between keys, integers for list items (``batches.0.speedup``); ``KEY/KEY`` cites the ratio of two
numbers of the file (a speed-up over a baseline the file holds); a trailing ``*N`` scales the
value to the unit quoted (``step.2.s_per_step*1e3`` for ms, ``row_fill*100`` for a percentage,
``peak_flops_per_s*1e-12`` for TFLOP/s). The figure is the last number
before the comment (``**``, ``×``, ``,`` and a ``K``/``M`` suffix allowed); it must equal the
cited value rounded to the decimals it is quoted with (``97.3K`` = round(value / 1e3, 1)).

Lines in a *figure section* (:data:`SECTIONS`: the headline paragraphs, the captured step's,
the τ-per-doubling paragraph and the decoding bullets) may quote no speed-up (``N×``) and no
throughput (``N tok/s``, ``NK ... tokens/s``) without a citation. Tables rendered from JSON
(bench/md_block.py blocks) are checked by their own scripts' ``--check``.

    python -m bench.readme_figures             # check README.md; exit 1 naming each mismatch
    python -m bench.readme_figures docs/benchmarks.md   # its citations (no figure sections)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.entry import run
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]
CITE = re.compile(r"<!--\s*fig:\s*(?P<path>[^#\s]+)#(?P<key>[^\s]+)\s*-->")
SCALE = {"": 1.0, "K": 1e3, "M": 1e6}
# the README's paragraphs whose figures must all be cited: each from the line holding this text
# to the next blank line
SECTIONS = ("`make run` trains a real drafter", "On one H200 (`specs/smollm2-quality.yaml`, run 1",
            "Round 6 (2026-12-01", "On two H200s (", "same way, one CUDA graph per bucket",
            "τ grows about 0.2 per doubling", "Run 2 (this round's code",
            "- **Our target-only loop beats")
# a speed-up or a throughput quoted in prose
UNCITED = re.compile(r"\d[\d,.]*\s?×|\d[\d,.]*K? (?:target |new )?tok(?:en)?s?/s")


def cited_value(path: str, key: str) -> float:
    """The number at ``key`` (dotted) in the JSON file ``path`` (relative to the repo root);
    ``KEY/KEY``: the ratio of two numbers of that file; ``KEY*N``: the number times N."""
    if "*" in key:
        key, factor = key.rsplit("*", 1)
        try:
            return cited_value(path, key) * float(factor)
        except ValueError:
            raise DFlashError(f"{path}#{key}*{factor}: {factor!r} is not a number") from None
    if "/" in key:
        num, den = key.split("/", 1)
        return cited_value(path, num) / cited_value(path, den)
    f = REPO / path
    try:
        v = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{path}: not a readable JSON ({type(e).__name__}: {e})") from None
    for part in key.split("."):
        try:
            v = v[int(part)] if isinstance(v, list) else v[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise DFlashError(f"{path}#{key}: no key {part!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise DFlashError(f"{path}#{key}: {v!r} is not a number")
    return float(v)


def quoted(before: str) -> tuple[float, int, str] | None:
    """The last number of ``before`` (the text up to a citation): value, decimals, suffix."""
    m = None
    for m in re.finditer(r"(\d[\d,]*(?:\.\d+)?)([KM]?)", before):
        pass
    if m is None:
        return None
    num = m.group(1).replace(",", "")
    decimals = len(num.split(".")[1]) if "." in num else 0
    return float(num), decimals, m.group(2)


def citations(text: str) -> list[dict]:
    """Every citation of ``text``: line, quoted figure, the file's value, whether they agree."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        start = 0
        for c in CITE.finditer(line):
            q = quoted(CITE.sub("", line[start:c.start()]))
            start = c.end()
            rec = {"line": i, "path": c["path"], "key": c["key"]}
            if q is None:
                out.append(rec | {"error": "no number before the citation"})
                continue
            value = cited_value(c["path"], c["key"])
            num, decimals, suffix = q
            rec.update(quoted=num, suffix=suffix, value=value,
                       ok=round(value / SCALE[suffix], decimals) == num)
            out.append(rec)
    return out


def section_lines(text: str, sections: tuple[str, ...] = SECTIONS) -> list[tuple[int, str]]:
    """(line number, line) of the figure sections (:data:`SECTIONS`)."""
    lines, out = text.splitlines(), []
    for first in sections:
        on = False
        for i, line in enumerate(lines, 1):
            on = on or first in line
            if on and not line.strip():
                break
            if on:
                out.append((i, line))
    return out


def uncited(text: str, sections: tuple[str, ...] = SECTIONS) -> list[tuple[int, str]]:
    """Speed-ups and throughputs in the figure sections with no citation right after them."""
    bad = []
    for i, line in section_lines(text, sections):
        for m in UNCITED.finditer(line):
            if not CITE.match(line, m.end()) and not CITE.match(line[m.end():].lstrip("*")):
                bad.append((i, m.group(0)))
    return bad


def problems(md: Path, sections: tuple[str, ...] | None = None) -> list[str]:
    """One line per figure that disagrees with its file, lacks a number, or lacks a citation
    (the last in the figure sections: :data:`SECTIONS` for README.md, none for another file
    unless given, e.g. docs/benchmarks.md, whose citations alone are checked)."""
    sections = (SECTIONS if md.name == "README.md" else ()) if sections is None else sections
    text = md.read_text()
    out = []
    for c in citations(text):
        if "error" in c:
            out.append(f"{md.name}:{c['line']}: {c['error']} ({c['path']}#{c['key']})")
        elif not c["ok"]:
            out.append(f"{md.name}:{c['line']}: quoted {c['quoted']:g}{c['suffix']} but "
                       f"{c['path']}#{c['key']} = {c['value']:g}")
    for i, fig in uncited(text, sections):
        out.append(f"{md.name}:{i}: {fig!r} has no <!-- fig: FILE#KEY --> citation")
    if sections and not section_lines(text, sections):
        out.append(f"{md.name}: none of the figure sections {list(sections)} found")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("md", nargs="?", type=Path, default=REPO / "README.md")
    a = ap.parse_args(argv)
    bad = problems(a.md)
    for b in bad:
        print(b, file=sys.stderr)
    n = len(citations(a.md.read_text()))
    print(f"{a.md.name}: {n} cited figures, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    run(main)
